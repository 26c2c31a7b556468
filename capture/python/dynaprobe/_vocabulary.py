"""The names that cross the Python/C++ seam, taken from the extension (``dynaprobe._C.vocabulary``,
defined once in formats/include/dynaprobe/formats/vocabulary.h, formats/record.h and
analyze/report.h): record kinds, sides and statuses under short names for the modules that
record and read rows. No module spells these names itself."""

from __future__ import annotations

from dynaprobe._C import vocabulary

# Record kinds (formats::Kind).
FWD_INPUT: str = vocabulary.KIND_FWD_INPUT
FWD_OUTPUT: str = vocabulary.KIND_FWD_OUTPUT
GRAD_INPUT: str = vocabulary.KIND_GRAD_INPUT
GRAD_OUTPUT: str = vocabulary.KIND_GRAD_OUTPUT
PARAM_GRAD: str = vocabulary.KIND_PARAM_GRAD
LOSS: str = vocabulary.KIND_LOSS
REPLAY: str = vocabulary.KIND_REPLAY
# Sides (formats::Side).
EAGER: str = vocabulary.SIDE_EAGER
COMPILED: str = vocabulary.SIDE_COMPILED
REFERENCE: str = vocabulary.SIDE_REFERENCE
SIDES = (EAGER, COMPILED, REFERENCE)
# The module path of the whole-network loss records (formats::kLossModule).
LOSS_MODULE: str = vocabulary.LOSS_MODULE
# What a checked step stores, PrecisionChecker(dump=...) (capture::StoreMode).
STORE_MODES: tuple = vocabulary.STORE_MODES
STORE_FULL: str = vocabulary.STORE_FULL
# Row statuses (analyze::Status).
PASS: str = vocabulary.STATUS_PASS
FAIL: str = vocabulary.STATUS_FAIL
SKIP: str = vocabulary.STATUS_SKIP
WARN: str = vocabulary.STATUS_WARN
