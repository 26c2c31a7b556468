"""The result of a comparison: a value, never an exception.

``CompareResult`` holds the engine's report of one step (its ``rows``) and, as msProbe's
``CompareResult`` does, one ``ModuleDiff`` per module (its ``diffs``): a view of the same rows.
``TensorDiff``, ``ModuleDiff`` and ``CompareResult`` take msProbe's field names, so code written
against msprobe.pytorch.compile_accuracy_checker.precision_checker can build and read them
(docs/moving-from-msprobe.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._mechanics import storage as _storage


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
    compiled_shape: Optional[tuple] = None  # differs from ``shape`` in a shape mismatch
    # With a reference (PrecisionChecker(reference=...), on by default in bf16/fp16):
    # {"verdict": "noise" | "divergence", "dtype": "fp32" | "fp64", "tolerance_status": the
    # tolerance check's "PASS"/"FAIL" when the verdict decided ``status``, else None,
    # "eager_rmse", "compiled_rmse", "eager_max_abs", "compiled_max_abs", "factor"}; None
    # without a reference.
    reference: Optional[dict] = None
    # {"atol", "rtol"} the row was judged with when not the step's (a tolerance rule of
    # PrecisionChecker(tolerances=...) or the dtype-aware floor), else None.
    tolerances: Optional[dict] = None
    # The pass of the row's kind, the model's "pass": "forward" or "backward"
    # (vocabulary.PASS_*); None for a note about a whole module. Left out of repr(), which keeps
    # the fields it had.
    pass_: Optional[str] = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return self.status in (vocabulary.STATUS_PASS, vocabulary.STATUS_SKIP)


# The flat worst-element keys of earlier versions: (its key in metrics["worst"], value without one).
_LEGACY_WORST_KEYS = {"worst_index": ("flat_index", -1), "worst_eager": ("eager", 0.0),
                      "worst_compiled": ("compiled", 0.0)}


class Metrics(dict):
    """A row's metrics: the JSON report's ``metrics`` object, key for key (``max_abs``, ...,
    ``mismatch_fraction``, ``worst``: ``{"flat_index", "index", "eager", "compiled"}`` or None,
    ``histogram``). The flat ``worst_index``, ``worst_eager`` and ``worst_compiled`` of earlier
    versions still read (``-1`` and ``0.0`` without a worst element) but are not keys: prefer
    ``metrics["worst"]``."""

    def __missing__(self, key: str) -> Any:
        if key not in _LEGACY_WORST_KEYS:
            raise KeyError(key)
        field_name, default = _LEGACY_WORST_KEYS[key]
        worst = self.get("worst")
        return default if worst is None else worst[field_name]


def _shape(side: Optional[dict]) -> Optional[tuple]:
    return tuple(side["shape"]) if side else None


def _row_from_dict(d: dict) -> Row:
    metrics = Metrics(d["metrics"] or {})
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
        shape=_shape(side),
        eager_dtype=d["eager"]["dtype"] if d["eager"] else None,
        compiled_dtype=d["compiled"]["dtype"] if d["compiled"] else None,
        metrics=metrics,
        compiled_shape=_shape(d["compiled"]),
        reference=d["reference"],
        tolerances=d["tolerances"],
        pass_=d["pass"],
    )


# The kinds a ModuleDiff lists, from the engine's table of kinds (every compared kind but the
# loss, which is the LOSS row's): a new kind appears here with no change.
_TENSOR_KINDS = tuple(kind for kind in vocabulary.KINDS if kind != vocabulary.KIND_LOSS)


@dataclass
class TensorDiff:
    """One tensor compared eager against compiled: msProbe's ``TensorDiff``.

    Attributes:
        max_abs: ``abs(eager - compiled).max()``; ``inf`` for a shape mismatch.
        mean_abs: ``abs(eager - compiled).mean()``; ``inf`` for a shape mismatch.
        max_rel: ``(abs(eager - compiled) / (abs(eager) + 1e-8)).max()``; ``inf`` for a shape
            mismatch.
        allclose: whether its report row passes: within tolerance, or judged noise by the
            reference (and not beyond fp32 noise) where that decides.
        shape: the tensor's shape; for a shape mismatch ``(eager shape, compiled shape)``.
    """

    max_abs: float
    mean_abs: float
    max_rel: float
    allclose: bool
    shape: tuple

    def __str__(self) -> str:
        """The report's text for the tensor: ``[OK] max_abs=…  mean_abs=…  max_rel=…  shape=…``
        (``[!!]`` when it is not ``allclose``), rendered by the engine as its report rows are.
        A shape that is not a tuple (one built by hand) is shown as ``str()`` shows it."""
        shape = _C.shape_text(self.shape) if type(self.shape) is tuple else str(self.shape)
        return _C.tensor_detail(self.allclose, self.max_abs, self.mean_abs, self.max_rel, shape)


def _is_skip_note(note: str) -> bool:
    # The analyzer's note table (the spec's SKIP_* markers and IGNORED are skips).
    return _C.note_status(note) == vocabulary.STATUS_SKIP


@dataclass
class ModuleDiff:
    """Everything compared for one module: msProbe's ``ModuleDiff``, plus ``param_grad`` and
    ``rows``.

    Each list is None when nothing of that kind was compared. A module called several times in
    the step lists the tensors of every call, call by call.

    Attributes:
        name: the module's path in the model (the class name for the root model).
        fwd_input: the module's input tensors.
        fwd_output: its output tensors.
        grad_input: the gradients leaving it through its inputs.
        grad_output: the gradients it received from downstream.
        note: why the module was skipped (``IGNORED``, ``SKIP_...``) or not (fully) compared
            (``MISSING_...``, ``NOT_COMPILED``, ``NOT_RUN``, ``HOOK_ERROR``); empty otherwise.
        param_grad: the gradients of its parameters (dynaprobe only).
        rows: the report rows this view was made from (dynaprobe only; empty when built by hand):
            calls, labels, statuses, every note and its reason.
    """

    name: str
    fwd_input: Optional[List[TensorDiff]] = None
    fwd_output: Optional[List[TensorDiff]] = None
    grad_input: Optional[List[TensorDiff]] = None
    grad_output: Optional[List[TensorDiff]] = None
    note: str = ""
    param_grad: Optional[List[TensorDiff]] = None
    rows: List[Row] = field(default_factory=list, repr=False, compare=False)

    @property
    def passed(self) -> bool:
        """True when the module is skipped (a ``SKIP_...`` or ``IGNORED`` note), or has no note
        and every tensor is ``allclose``. A warning note (``MISSING_...``, ``NOT_COMPILED``, ...)
        fails, as its WARN row fails the report."""
        if self.note:
            return _is_skip_note(self.note)
        return all(
            tensor.allclose for kind in _TENSOR_KINDS for tensor in getattr(self, kind) or ()
        )


def _tensor_diff(row: Row) -> Optional[TensorDiff]:
    """A tensor row as a TensorDiff; None when one side lacks the tensor (the row's note says
    why) or the row is a note about the whole module."""
    if row.pass_ is None or row.eager_dtype is None or row.compiled_dtype is None:
        return None
    if row.metrics:
        # The row's verdict: the tolerances', or the reference's (or the fp32 screen's) where
        # that decides, as the report's [OK]/[!!] flag shows it.
        return TensorDiff(row.max_abs, row.mean_abs, row.max_rel, row.status == "PASS", row.shape)
    return TensorDiff(
        row.max_abs,
        row.mean_abs,
        row.max_rel,
        False,  # a shape mismatch
        (row.shape, row.compiled_shape),
    )


def _module_note(rows: List[Row]) -> str:
    """The one note a ModuleDiff has room for: the first warning's (the module fails), else a
    skip note when every row of the module is skipped. A skip note on some tensors of a module
    whose other tensors were compared stays in ``rows``: as the module's note it would make code
    that treats SKIP notes as passes overlook those tensors."""
    for row in rows:
        if row.status == vocabulary.STATUS_WARN:
            return row.note
    return rows[0].note if all(row.status == vocabulary.STATUS_SKIP for row in rows) else ""


def _module_diffs(rows: List[Row]) -> List[ModuleDiff]:
    """One ModuleDiff per module, in the order of the report."""
    diffs: Dict[str, ModuleDiff] = {}
    for row in rows:
        if row.module not in diffs:
            diffs[row.module] = ModuleDiff(name=row.module)
        diff = diffs[row.module]
        diff.rows.append(row)
        tensor = _tensor_diff(row)
        if tensor is not None:
            if getattr(diff, row.check_type) is None:
                setattr(diff, row.check_type, [])
            getattr(diff, row.check_type).append(tensor)
    for diff in diffs.values():
        diff.note = _module_note(diff.rows)
    return list(diffs.values())


def _dtype(name: str) -> Optional[torch.dtype]:
    """``"torch.bfloat16"`` -> ``torch.bfloat16``; None for ``""``."""
    value = getattr(torch, name.removeprefix("torch."), None) if name else None
    return value if isinstance(value, torch.dtype) else None


class CompareResult:
    """What ``collect()`` and ``compare()`` return: the rows of one step and its verdict.

    ``bool(result)`` is ``result.all_pass``; iterating yields the rows; ``diffs`` shows them as
    msProbe's ``ModuleDiff`` values. The same step can be compared again later from its dump
    with ``dynaprobe compare <dump_dir> --step <step>``.

    Built with msProbe's fields, ``CompareResult(loss_eager, loss_compiled, diffs, cast_dtype)``,
    it is a plain value with no report behind it: ``all_pass`` comes from ``diffs``, and the
    members that need the engine's report (``text()``, ``csv()``, ``step``, ...) raise
    ValueError.

    Args:
        loss_eager: the eager loss (NaN when there is none, as in single-pass).
        loss_compiled: the compiled loss.
        diffs: one ModuleDiff per module.
        cast_dtype: the autocast dtype of the check, if any.
    """

    def __init__(
        self,
        loss_eager: float,
        loss_compiled: float,
        diffs: Optional[List[ModuleDiff]] = None,
        cast_dtype: Optional[torch.dtype] = None,
    ):
        self._report = None
        self._comparison = None
        self.dump_dir: Optional[str] = None
        self._dump_file: Optional[str] = None
        self._commit = None  # _storage.Commit of a step collect() reported before its commit
        self.rows: List[Row] = []
        self.loss_eager = float(loss_eager)
        self.loss_compiled = float(loss_compiled)
        self.diffs = [] if diffs is None else diffs
        self.cast_dtype = cast_dtype

    @property
    def dump_file(self) -> Optional[str]:
        """The step's file; None when it was not stored (see ``stored``). A step collect()
        reported while its file was still being written is waited for here: the file is
        committed when this returns (with ``strict_io=True``, the error that lost it is
        raised)."""
        return self._dump_file if self.stored else None

    @property
    def stored(self) -> bool:
        """Whether the step's file was written (waits for it like ``dump_file``). False when the
        dump could not be written (no space, an I/O error, the folder gone or read-only, another
        process writing the same ``dump_dir``): the step was judged in memory, and this result
        and its report are all there is of it; ``not_stored_reason`` says why."""
        return self.not_stored_reason is None

    @property
    def not_stored_reason(self) -> Optional[str]:
        """Why the step's file was not written, None when it was (waits for it)."""
        error = self._commit.wait() if self._commit is not None else None
        return None if error is None else str(error)

    def _wait_for_file(self) -> None:
        if self._commit is not None:
            self._commit.wait()

    @classmethod
    def from_report(
        cls, report: Any, dump_dir: str, dump_file: str, comparison: Any = None,
        commit: Any = None,
    ) -> "CompareResult":
        """The result of one step of the engine's comparison.

        Args:
            report: the engine's StepReport of the step.
            dump_dir: the dump folder.
            dump_file: the step's file.
            comparison: the engine's Comparison the report belongs to (else made on demand).
            commit: the commit of ``dump_file`` (``_storage.Commit``), for a step still being
                written.
        """
        result = cls.__new__(cls)
        result._init_from_report(report, dump_dir, dump_file, comparison)
        result._commit = commit
        return result

    def _init_from_report(
        self, report: Any, dump_dir: str, dump_file: str, comparison: Any
    ) -> None:
        self._report = report
        self._comparison = comparison  # the engine's Comparison of this step (merged CSV)
        self.dump_dir = dump_dir
        self._dump_file = dump_file
        self._commit = None
        self.rows = [_row_from_dict(d) for d in report.rows]
        # The eager loss is NaN in single-pass, which does not run the whole model eagerly.
        eager = None if report.single_pass else report.loss_eager
        self.loss_eager = math.nan if eager is None else eager
        self.loss_compiled = math.nan if report.loss_compiled is None else report.loss_compiled
        self.diffs = _module_diffs(self.rows)
        self.cast_dtype = _dtype(report.cast_dtype)

    def _engine_report(self) -> Any:
        if self._report is None:
            raise ValueError(
                "this CompareResult was built from values (loss_eager, loss_compiled, diffs), "
                "not returned by collect() or compare(): it has no report, step or dump. Use a "
                "result of collect()/compare(), or read its values (str() of a TensorDiff is "
                "its report line)"
            )
        return self._report

    @property
    def step(self) -> int:
        return self._engine_report().step

    @property
    def modules(self) -> dict:
        """What the capture recorded about each wrapped or ignored module in this step:
        ``{module: {attribute: value}}`` with ``role``, ``note``/``reason`` (``NOT_COMPILED``,
        ``NOT_RUN``, ...) and, for compiled modules, ``compiled_functions`` (Dynamo's
        ``__compiled_fn_<n>`` names, comma-separated: the graphs of the dump and of
        ``graph_dir`` carry them), ``graph_breaks``, ``graph_break_reasons`` and ``calls``."""
        return {
            name: dict(attributes) for name, attributes in self._engine_report().modules.items()
        }

    def _step_comparison(self) -> Any:
        if self._comparison is None:
            self._comparison = _C.compare(self.dump_dir, self.dump_dir, step=self.step)
        return self._comparison

    @property
    def scenario(self) -> str:
        """The checker's ``scenario`` label, from the dump's provenance."""
        return self._step_comparison().compiled_provenance.get(vocabulary.PROVENANCE_SCENARIO, "")

    def merged_csv(self, rank: int) -> str:
        """The multi-rank CSV of this step alone: ``rank,scenario`` and the 9 columns."""
        return _C.render_merged_csv([(rank, self.scenario, self._step_comparison())])

    @property
    def all_pass(self) -> bool:
        """True when the loss check and every row pass; skipped and ignored rows do not count.

        Built from values: True when every ModuleDiff in ``diffs`` passes (``ModuleDiff.passed``);
        there is no loss check without tolerances.
        """
        if self._report is None:
            return all(diff.passed for diff in self.diffs)
        return self._report.all_pass

    @property
    def loss_diff(self) -> float:
        """``abs(loss_eager - loss_compiled)``: NaN when either is NaN (single-pass)."""
        return abs(self.loss_eager - self.loss_compiled)

    @property
    def root_cause(self) -> Optional[dict]:
        """Where the step's differences start, None when every row passes or skips:
        ``{"forward": finding, "backward": finding, "next": str}``, each finding ``None`` (both,
        when rows WARN but none FAILs: ``next`` is then about the first that warns) or a dict
        with ``module``, ``call``, ``check_type``, ``tensor_index``, ``label``, ``origin``
        (``"local"``: the module's inputs, or the gradient it received, matched; ``"carried"``:
        they already differed; ``"unknown"``) and ``evidence`` in words. The same object as the JSON
        report's ``root_cause``; the text report ends with it."""
        return self._engine_report().root_cause

    @property
    def provenance(self) -> dict:
        """What the dump says of the capture (the compiled side's provenance): backend, mode,
        tolerances, ``reference``, ``verdict``, ``cast_dtype``, ``autocast`` (the user's own
        torch.autocast, when detected), torch version, device, ... (docs/dump-format.md)."""
        return dict(self._step_comparison().compiled_provenance)

    @property
    def counts(self) -> dict:
        """What ``all_pass`` rests on, as the RESULT line states it (the JSON report's
        ``result``): ``verdict``, rows by status (``pass``, ``fail``, ``warn``, ``skip``),
        ``compared``, ``noise_pass`` (passes that fail the tolerances but are within the
        reference's noise), ``no_reference_calls``, ``loss_fail``, ``nothing_compared``."""
        return self._engine_report().counts

    @property
    def failures(self) -> list:
        """Rows that FAIL or WARN."""
        return [row for row in self.rows
                if row.status in (vocabulary.STATUS_FAIL, vocabulary.STATUS_WARN)]

    def text(self, only_failing: bool = False) -> str:
        """The stdout report; ``only_failing``: its FAIL and WARN rows alone (the RESULT line
        and the root cause are the whole step's). A step whose file is known not to have been
        written when the report is made (``stored``) says so after its RESULT line."""
        commit = self._commit
        known = commit is not None and commit.done and commit.error is not None
        return self._engine_report().render_text(
            not_stored=_storage.brief(commit.error) if known else "", only_failing=only_failing)

    def csv(self) -> str:
        """The 9-column CSV report."""
        return _C.render_csv([self._engine_report()])

    def render(self, format: str, rank: int = 0) -> str:
        """This step's report in a registered format (``_C.report_formats()``: ``"json"``,
        ``"html"``, ``"merged-csv"``), as ``dynaprobe compare DUMP --step N --FORMAT PATH``
        writes it; ``rank`` labels the step's rank."""
        self._wait_for_file()  # the formats that show graphs read them from the step files
        return _C.render_report(
            format, [(rank, self.scenario, self._step_comparison(), self.dump_dir)])

    def __bool__(self) -> bool:
        return self.all_pass

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        if self._report is None:
            verdict = vocabulary.VERDICT_ALL_PASS if self.all_pass else vocabulary.VERDICT_FAILED
            return (
                f"<CompareResult loss_eager={self.loss_eager} loss_compiled="
                f"{self.loss_compiled} {verdict} diffs={len(self.diffs)}>"
            )
        verdict = (vocabulary.VERDICT_ALL_PASS if self.all_pass
                   else f"{vocabulary.VERDICT_FAILED} ({len(self.failures)} rows)")
        return (
            f"<CompareResult step={self.step} {verdict} rows={len(self.rows)} "
            f"dump={self._dump_file}>"
        )
