"""The checking façade: ``PrecisionChecker``'s verbs and the validation of its options. The top
room: it plans a check, sets up the step session and hands it to a mode."""
