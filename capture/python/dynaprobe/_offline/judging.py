"""Judging a replay's runs with the engine, as the report judges the original dump: a recorder
that keeps the dump's tolerances and rules (``judging_recorder``), the comparison of eager runs
with other runs (``judge``), and the rows' metrics as lines (``metrics_lines``).
"""

from __future__ import annotations

import tempfile
from typing import List, Optional, Tuple

import torch

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._C.vocabulary import (
    KIND_FWD_OUTPUT,
    KIND_GRAD_INPUT,
    KIND_PARAM_GRAD,
    SIDE_COMPILED,
    SIDE_EAGER,
    SIDE_REFERENCE,
)
from dynaprobe._offline.stored_call import Run, StoredCall
from dynaprobe._results.result import CompareResult

# The provenance a replay's judging keeps from the original dump: the tolerances and how rows
# are judged, so that the metrics and verdicts are the report's.
_JUDGING_KEYS = (vocabulary.PROVENANCE_ATOL, vocabulary.PROVENANCE_RTOL,
                 vocabulary.PROVENANCE_TOLERANCE_RULES,
                 vocabulary.PROVENANCE_DTYPE_AWARE_TOLERANCES, vocabulary.PROVENANCE_CAST_DTYPE,
                 vocabulary.PROVENANCE_VERDICT)


def judging_recorder(call: StoredCall, folder: str, producer: str = "dynaprobe replay",
                     **extra: str):
    """A recorder writing a dump that the engine judges as the original dump was judged: its
    tolerances, rules and dtype floors (single-pass: one set of inputs for both sides);
    ``extra`` provenance besides."""
    provenance = {key: call.provenance[key] for key in _JUDGING_KEYS if key in call.provenance}
    provenance.update({vocabulary.PROVENANCE_PRODUCER: producer, vocabulary.PROVENANCE_MODE:
                       vocabulary.MODE_SINGLE_PASS, vocabulary.PROVENANCE_CAPTURE_INPUT: "false",
                       vocabulary.PROVENANCE_TORCH_VERSION: torch.__version__, **extra})
    return _C.Recorder(folder, provenance)


def judge(call: StoredCall, pairs: List[Tuple[Run, Run]], folder: Optional[str] = None,
          references: Optional[List[Run]] = None) -> List[CompareResult]:
    """The engine's comparison of each (eager run, other run), one step each, judged with the
    original dump's tolerances: the report's metrics and verdicts for these runs. With
    ``references`` (a run per pair, in a higher precision), each row's reference verdict
    decides it, as under ``PrecisionChecker(reference="fp64")``."""
    if not pairs:  # nothing ran (every stage of a bisection failed to compile, say)
        return []
    folder = folder or tempfile.mkdtemp(prefix="dynaprobe-replay-")
    recorder = judging_recorder(call, folder)
    for index, (eager, other) in enumerate(pairs):
        recorder.begin_step(index)
        sides = [(SIDE_EAGER, eager), (SIDE_COMPILED, other)]
        if references is not None:
            sides.append((SIDE_REFERENCE, references[index]))
        for side, run in sides:
            for position, tensor in enumerate(run.outputs):
                recorder.record(call.module, call.call, KIND_FWD_OUTPUT, position, side, tensor,
                                run.labels.get((KIND_FWD_OUTPUT, position), ""))
            for position, grad in sorted(run.grad_input.items()):
                recorder.record(call.module, call.call, KIND_GRAD_INPUT, position, side, grad,
                                run.labels.get((KIND_GRAD_INPUT, position), ""))
            for position, (name, grad) in enumerate(run.param_grad):
                recorder.record(call.module, 0, KIND_PARAM_GRAD, position, side, grad, name)
        recorder.end_step()
    comparison = _C.compare(folder, folder)
    return [CompareResult.from_report(report, folder, "", comparison)
            for report in comparison.steps]


def metrics_lines(rows) -> List[str]:
    """One line per row: status, check, and the report's metrics (exact: ``repr`` of each)."""
    lines = []
    for row in rows:
        if row.check_type == "note":
            lines.append(f"  {row.status:4} {row.module} {row.note} {row.reason}")
            continue
        what = f"{row.check_type}[{row.tensor_index}]" + (f" {row.label}" if row.label else "")
        lines.append(f"  {row.status:4} {what:32} max_abs={row.max_abs!r} "
                     f"mean_abs={row.mean_abs!r} max_rel={row.max_rel!r}")
    return lines
