"""What a dump says about how and where it was captured: the provenance of its step files, from
the checker's options, the mode, the model's devices and the machine (docs/dump-format.md)."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Dict

import torch

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._mechanics.distributed import rank_and_world
from dynaprobe._mechanics.environment import environment


def backend_name(backend) -> str:
    """A torch.compile backend as the provenance names it."""
    return backend if isinstance(backend, str) else getattr(
        backend, "compiler_name", getattr(backend, "__name__", type(backend).__name__))


def judging(checker) -> _C.Judging:
    """The tolerances ``checker`` (a PrecisionChecker) judges with, as the engine takes them:
    built once, when the checker is made (``CheckerOptions._judging``), and passed on.
    ``_C.rows_pass`` judges with them (what "failing" means for the reference), and
    ``_C.Recorder`` judges its pairs with them and writes them into the provenance (atol, rtol,
    tolerance_rules, dtype_aware_tolerances), so that their text is formatted in one place
    (analyze/judging.h)."""
    return _C.Judging(checker.threshold, checker.rtol,
                      [(pattern, atol, rtol)
                       for pattern, (atol, rtol) in (checker.tolerances or {}).items()],
                      checker.dtype_aware_tolerances, checker.verdict == "reference")


def provenance(checker, devices: Dict[str, str], mode: str, backend=None,
               compile_scope: str = "per_module") -> Dict[str, str]:
    """The provenance of a dump ``checker`` (a PrecisionChecker: its options) captures in
    ``mode`` from a model on ``devices`` (``_planning.describe_model``); ``backend``: the one
    that compiles, when not the checker's (a model compiled whole). The tolerances are not in
    it: the recorder writes them from ``judging(checker)``."""
    rank, world = rank_and_world()
    backend = checker.backend if backend is None else backend
    return {
        vocabulary.PROVENANCE_PRODUCER: "dynaprobe.PrecisionChecker",
        vocabulary.PROVENANCE_TORCH_VERSION: torch.__version__,
        vocabulary.PROVENANCE_BACKEND: backend_name(backend),
        vocabulary.PROVENANCE_MODE: mode,
        vocabulary.PROVENANCE_COMPILE_SCOPE: compile_scope,
        vocabulary.PROVENANCE_RANK: str(rank),
        vocabulary.PROVENANCE_WORLD_SIZE: str(world),
        # The run folder's name, the same on every rank: a rank folder copied from another run
        # says so (dynaprobe compare's run warnings).
        vocabulary.PROVENANCE_RUN:
            os.path.basename(os.path.normpath(os.path.abspath(checker.run_dir))),
        vocabulary.PROVENANCE_SCENARIO: checker.scenario,
        vocabulary.PROVENANCE_CAST_DTYPE: str(checker.cast_dtype)
        if checker.cast_dtype is not None else "None",
        vocabulary.PROVENANCE_CAPTURE_INPUT: "true" if checker.capture_input else "false",
        vocabulary.PROVENANCE_REFERENCE: str(checker.reference),
        vocabulary.PROVENANCE_VERDICT: checker.verdict,
        **devices,
        **environment(),
        vocabulary.PROVENANCE_HOST: socket.gethostname(),
        vocabulary.PROVENANCE_CREATED:
            datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
