"""One checked step: the session that numbers and writes steps, what a step records, the plan of
what is wrapped and compiled, and the compiler."""
