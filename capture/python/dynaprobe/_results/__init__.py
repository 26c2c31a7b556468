"""Results: the compared rows of a step (``CompareResult``), a run of steps and ranks, the
reports printed from them, and ``assert_precision``."""
