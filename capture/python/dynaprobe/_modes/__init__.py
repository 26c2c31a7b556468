"""The ways a step is checked, each run inside training: single-pass (the compiled module trains,
its eager twin re-runs on copies), whole-model (a model compiled whole, its wrapped modules found
in Dynamo's graphs) and two-pass (the step run once per side)."""
