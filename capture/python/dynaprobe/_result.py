"""The result of a comparison: a value, never an exception."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from dynaprobe import _C


@dataclass(frozen=True)
class Row:
    """One line of the report.

    ``check_type`` is ``fwd_input``, ``fwd_output``, ``grad_input``, ``grad_output``,
    ``param_grad``, or ``note`` for a note about a whole module (``IGNORED``, ``NOT_RUN``, ...).
    ``status`` is ``PASS``, ``FAIL``, ``SKIP`` or ``WARN``.
    """

    module: str
    call: int
    check_type: str
    tensor_index: int
    status: str
    note: str = ""
    reason: str = ""
    label: str = ""
    max_abs: float = math.nan
    mean_abs: float = math.nan
    max_rel: float = math.nan
    shape: Optional[tuple] = None
    eager_dtype: Optional[str] = None
    compiled_dtype: Optional[str] = None
    metrics: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status in ("PASS", "SKIP")


def _row_from_dict(d: dict) -> Row:
    metrics = d["metrics"] or {}
    side = d["eager"] or d["compiled"]
    # A shape mismatch FAILs without metrics: the report shows them as inf.
    missing = math.inf if d["eager"] and d["compiled"] and not d["metrics"] else math.nan
    return Row(
        module=d["module"],
        call=d["call"],
        check_type=d["check_type"],
        tensor_index=d["tensor_index"],
        status=d["status"],
        note=d["note"],
        reason=d["reason"],
        label=d["label"],
        max_abs=metrics.get("max_abs", missing),
        mean_abs=metrics.get("mean_abs", missing),
        max_rel=metrics.get("max_rel", missing),
        shape=side["shape"] if side else None,
        eager_dtype=d["eager"]["dtype"] if d["eager"] else None,
        compiled_dtype=d["compiled"]["dtype"] if d["compiled"] else None,
        metrics=metrics,
    )


class CompareResult:
    """What ``collect()`` and ``compare()`` return: the rows of one step and its verdict.

    ``bool(result)`` is ``result.all_pass``; iterating yields the rows. The same step can be
    compared again later from its dump with ``dynaprobe compare <dump_dir> --step <step>``.
    """

    def __init__(self, report: Any, dump_dir: str, dump_file: str, comparison: Any = None):
        self._report = report
        self._comparison = comparison  # the engine's Comparison of this step (merged CSV)
        self.dump_dir = dump_dir
        self.dump_file = dump_file
        self.rows = [_row_from_dict(d) for d in report.rows]

    @property
    def step(self) -> int:
        return self._report.step

    @property
    def modules(self) -> dict:
        """What the capture recorded about each wrapped or ignored module in this step:
        ``{module: {attribute: value}}`` with ``role``, ``note``/``reason`` (``NOT_COMPILED``,
        ``NOT_RUN``, ...) and, for compiled modules, ``compiled_functions`` (Dynamo's
        ``__compiled_fn_<n>`` names, comma-separated: the graphs of the dump and of
        ``graph_dir`` carry them), ``graph_breaks``, ``graph_break_reasons`` and ``calls``."""
        return {name: dict(attributes) for name, attributes in self._report.modules.items()}

    def _step_comparison(self) -> Any:
        if self._comparison is None:
            self._comparison = _C.compare(self.dump_dir, self.dump_dir, step=self.step)
        return self._comparison

    @property
    def scenario(self) -> str:
        """The checker's ``scenario`` label, from the dump's provenance."""
        return self._step_comparison().compiled_provenance.get("scenario", "")

    def merged_csv(self, rank: int) -> str:
        """The multi-rank CSV of this step alone: ``rank,scenario`` and the 9 columns."""
        return _C.render_merged_csv([(rank, self.scenario, self._step_comparison())])

    @property
    def all_pass(self) -> bool:
        """True when the loss check and every row pass; skipped and ignored rows do not count."""
        return self._report.all_pass

    @property
    def loss_eager(self) -> float:
        """The eager loss; NaN in single-pass, which does not run the whole model eagerly."""
        value = None if self._report.single_pass else self._report.loss_eager
        return math.nan if value is None else value

    @property
    def loss_compiled(self) -> float:
        value = self._report.loss_compiled
        return math.nan if value is None else value

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_eager - self.loss_compiled)

    @property
    def failures(self) -> list:
        """Rows that FAIL or WARN."""
        return [row for row in self.rows if row.status in ("FAIL", "WARN")]

    def text(self) -> str:
        """The stdout report."""
        return self._report.render_text()

    def csv(self) -> str:
        """The 9-column CSV report."""
        return _C.render_csv([self._report])

    def __bool__(self) -> bool:
        return self.all_pass

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        verdict = "ALL PASS" if self.all_pass else f"FAILED ({len(self.failures)} rows)"
        return f"<CompareResult step={self.step} {verdict} rows={len(self.rows)} dump={self.dump_file}>"
