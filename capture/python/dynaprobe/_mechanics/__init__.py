"""Capture mechanics that the modes share: probes and copies of a call's tensors, isolation of the
eager re-run, the reference, Dynamo graph recording, the replay data kept during training and the
graph runner that replays it, the dump folder's committed steps and disk budget, distributed and
environment facts."""
