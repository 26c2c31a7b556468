"""PrecisionChecker: the spec's API, a façade of verbs (wrap / ignore / install / collect /
compare / capture / report) over modules of one concern each: _session (the steps' lifecycle),
_planning, _compiling, the modes (which receive the session), _provenance, _reporting, _result."""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from dynaprobe._C import vocabulary
from dynaprobe._C.vocabulary import SIDE_COMPILED, SIDE_EAGER, STORE_FULL
from dynaprobe._checking import options as _options
from dynaprobe._mechanics.distributed import is_deepcopy_forbidden
from dynaprobe._mechanics.provenance import provenance
from dynaprobe._mechanics.reference import ReferencePolicy
from dynaprobe._modes import single_pass as _single_pass
from dynaprobe._modes import whole_model as _whole_model
from dynaprobe._modes.two_pass import run_step
from dynaprobe._results import reporting as _reporting
from dynaprobe._results.result import CompareResult
from dynaprobe._steps import planning as _planning
from dynaprobe._steps.compiling import Compiler
from dynaprobe._steps.session import CAPTURE_MODES, Dumps, Installation, Setup, StepSession


class PrecisionChecker(_options.CheckerOptions):
    """Compares a model's wrapped modules run eagerly and under ``torch.compile``.

    Args:
        backend: the ``torch.compile`` backend (a name or a callable).
        threshold: absolute tolerance ``atol`` of the comparison (the spec's ``allclose`` check,
            ``|eager - compiled| <= atol + rtol * |compiled|``).
        dump_graphs: save the graphs Dynamo and AOTAutograd produce to ``graph_dir``.
        graph_dir: where graph dumps go.
        cast_dtype: run wrapped modules under ``torch.autocast`` with this dtype, both sides.
        capture_input: record and compare module inputs (FORWARD INPUT).
        single_pass: compare inside one training run (True) or an eager and a compiled copy (False).
        dump_dir: the folder this checker's dump goes to; default
            ``./dynaprobe_runs/<time>-<pid>-<n>/rank<R>``. With several ranks it names the run
            folder, each rank writing ``<dump_dir>/rank<R>`` (see the ``dump_dir`` property).
        scenario: a label for this configuration, shown in the multi-rank CSV.
        rtol: relative tolerance of the comparison.
        memory_budget_bytes: host memory for snapshots waiting to be written; the training
            thread waits when it is full (nothing is dropped).
        reference: re-run wrapped calls once more eagerly in a wider dtype (the module's
            weights and the call's inputs upcast, autocast off) and judge each difference
            against it: within eager's own error it is noise (a pass), beyond it a divergence
            (a FAIL). ``"auto"`` (default): every call computing in bf16 or fp16 (weights,
            inputs, ``cast_dtype`` or your own ``torch.autocast``), in float32; full-precision
            calls keep the tolerances alone. ``"fp64"`` / ``"fp32"``: every call, in that dtype.
            ``"failing"`` (single-pass): only calls whose forward output fails the tolerances.
            None: no reference. Two-pass runs it as a third copy of the step.
        verdict: what decides a row that has a reference verdict: ``"reference"`` (default)
            or ``"tolerances"`` (the spec's tolerance check alone; the verdict is still shown).
        tolerances: per-pattern ``(atol, rtol)``, e.g. ``{"layers.*.mlp": (1e-3, 1e-2),
            "grad_*": (1e-3, 1e-2)}``: a pattern (shell-style) matches a row's module, its check
            type or ``<module>.<check type>``; the last matching pattern wins. Stored in the dump,
            so ``dynaprobe compare`` applies them too.
        dtype_aware_tolerances: judge bf16, fp16 and fp8 rows with at least their dtype's floor
            (bf16: atol 1e-2, rtol 1.6e-2; docs/user-guide.md); float32 keeps
            ``threshold``/``rtol``.
        dump: what a checked step stores. Every compared pair is judged in memory as it is
            captured and its metrics are stored; ``"full"`` (default) also stores every tensor,
            ``"failing"`` only the tensors of rows that FAIL or WARN, ``"stats"`` none (dtype,
            shape and metrics only). ``dynaprobe compare`` re-renders every mode as the
            in-process report; judging again with other tolerances needs the tensors.
            ``capture()`` always stores full tensors; ``reference`` needs ``"full"``.
        check_every: single-pass: check every N-th step (steps 0, N, 2N, ... of collect()); the
            other steps run the compiled modules only and collect() returns None.
        check_steps: single-pass: the steps to check (collect() indices from 0); wins over
            ``check_every``.
        disk_budget_bytes: the most bytes this rank's dump may hold; after each step the oldest
            committed steps are removed to fit (never the one just written). None: no limit.
        replay: single-pass: which calls keep what a replay needs (``python -m dynaprobe.repro``,
            ``checker.bisect()``): their inputs and argument structure, grad_output, the
            module's weights and buffers, RNG state and class, in the step file (records of kind
            ``replay``). ``"failing"``: the calls with a row that fails, forward or backward,
            as the report judges it (decided when the backward pass ends, or at collect());
            ``"all"``: every call; ``"none"``. None (default): ``"failing"``, except under
            ``dump="stats"`` and in two-pass, which keep none.
        strict_io: False (default): a dump that cannot be written (no space, an I/O error, the
            folder removed or read-only, another process writing the same ``dump_dir``) costs
            the dump, never the training: each step is still judged in memory, ``collect()``
            returns its result with ``stored`` False, stderr says so once, and every checked
            step tries to write again. True: such an error is raised (``DumpIOError``).
    """

    def __init__(self, backend="aot_eager", threshold: float = 1e-4, dump_graphs: bool = False,
                 graph_dir: str = "./graph_dump", cast_dtype: Optional[torch.dtype] = None,
                 capture_input: bool = True, single_pass: bool = True, *,
                 dump_dir: Optional[str] = None, scenario: str = "", rtol: float = 1e-3,
                 memory_budget_bytes: int = 1 << 30, reference: Optional[str] = "auto",
                 verdict: str = "reference",
                 tolerances: Optional[Dict[str, Tuple[float, float]]] = None,
                 dtype_aware_tolerances: bool = True, dump: str = "full", check_every: int = 1,
                 check_steps=None, disk_budget_bytes: Optional[int] = None,
                 replay: Optional[str] = None, strict_io: bool = False):
        super().__init__(backend, threshold, dump_graphs, graph_dir, cast_dtype, capture_input,
                         single_pass, dump_dir=dump_dir, scenario=scenario, rtol=rtol,
                         memory_budget_bytes=memory_budget_bytes, reference=reference,
                         verdict=verdict, tolerances=tolerances,
                         dtype_aware_tolerances=dtype_aware_tolerances, dump=dump,
                         check_every=check_every, check_steps=check_steps,
                         disk_budget_bytes=disk_budget_bytes, replay=replay, strict_io=strict_io)
        # The dump folders, each with its step session: the lifecycle of the steps.
        self._dumps = Dumps(self._dump_dir_given, self._schedule, dump=self.dump,
                            memory_budget_bytes=self.memory_budget_bytes,
                            disk_budget_bytes=self.disk_budget_bytes, strict_io=self.strict_io)
        self._wrapped: List[nn.Module] = []
        self._ignored: List[nn.Module] = []
        # install(): the installation, per module or on a model compiled whole
        self._installation: Optional[Installation] = None
        self._compiler = Compiler(backend)
        self._per_module_compiler = self._compiler  # while a model compiled whole is installed
        self._recorded_loss = None  # record_loss(): the loss of the step being checked

    # ------------------------------------------------------------------ wrap / ignore
    def wrap(self, module: nn.Module, name: Optional[str] = None) -> nn.Module:
        """Marks a module for compilation and comparison (the root model too).

        ``name`` is accepted for compatibility with the original tool and not used: reports name
        modules by their path in the model given to install()/compare(), so that every process
        and every dump agrees on them.
        """
        _options.expect_module("checker.wrap(model.layers[0])", "module", module)
        if not any(m is module for m in self._wrapped):
            self._wrapped.append(module)
        return module

    def wrap_by_policy(self, model: nn.Module, module_types) -> nn.Module:
        """Marks every submodule of the given types (a class or a tuple of classes), like FSDP's
        ModuleWrapPolicy."""
        _options.expect_module("checker.wrap_by_policy(model, (DecoderLayer,))", "model", model)
        module_types = _options.expect_module_types("module_types", module_types)
        for module in _planning.of_types(model, module_types):
            self.wrap(module)
        return model

    def wrap_all_children(self, model: nn.Module, depth: int = 1) -> nn.Module:
        """Marks submodules ``depth`` levels below the direct children (depth=0: the direct
        children). Containers (ModuleList, ModuleDict, Sequential) are looked through without
        using up depth; modules without children are marked where the recursion reaches them."""
        _options.expect_module("checker.wrap_all_children(model, depth=1)", "model", model)
        depth = _options.expect_depth(depth)
        for module in _planning.children_at_depth(model, depth):
            self.wrap(module)
        return model

    def ignore(self, module: nn.Module) -> nn.Module:
        """Leaves a module out of the verdict: it still runs, its rows read ``skip IGNORED``."""
        _options.expect_module("checker.ignore(model.lm_head)", "module", module)
        if not any(m is module for m in self._ignored):
            self._ignored.append(module)
        return module

    def ignore_by_policy(self, model: nn.Module, module_types) -> nn.Module:
        """Ignores every submodule of the given types (a class or a tuple of classes)."""
        _options.expect_module("checker.ignore_by_policy(model, (nn.Dropout,))", "model", model)
        module_types = _options.expect_module_types("module_types", module_types)
        for module in _planning.of_types(model, module_types):
            self.ignore(module)
        return model

    # ------------------------------------------------------------------ dump
    @property
    def dump_dir(self) -> str:
        """The folder of this rank's dump (one step file per collect()/compare()).

        Default: ``./dynaprobe_runs/<run>/rank<R>``. With several ranks (torch.distributed
        initialized, world size > 1) all ranks write into one run folder: rank 0 names it and
        broadcasts the name when ``install()``/``compare()``/``capture()`` first needs it (every
        rank calls those), and a ``dump_dir`` given to the constructor names the run folder,
        each rank writing ``<dump_dir>/rank<R>``. In a single process ``dump_dir`` is the dump.
        """
        return self._dumps.dump_dir

    @property
    def run_dir(self) -> str:
        """The run folder: the folder above ``dump_dir`` when that is ``rank<R>`` (the default,
        and every multi-rank run), else ``dump_dir``. ``dynaprobe compare RUN_DIR --merged-csv
        PATH`` reports every rank of it."""
        return self._dumps.run_dir

    def wait_committed(self) -> None:
        """Waits until the last checked step's file is committed. ``collect()`` returns once a
        step is judged and reported, and its file is written while training goes on; the next
        ``collect()``, ``uninstall()`` and ``CompareResult.dump_file`` wait for it. With
        ``strict_io=True`` raises the error that lost the step's file (disk full, ...); else
        says it on stderr (once) and the step's result has ``stored`` False."""
        self._dumps.wait_committed()

    def _set_up(self, session: StepSession, plan: _planning.Plan, mode: str, backend=None,
                compile_scope: str = "per_module") -> None:
        """Sets ``session`` up for the steps of a verb checking ``plan`` in ``mode``: a capture
        stores full tensors; single-pass names the user's autocast (without cast_dtype)."""
        session.prepare(Setup(
            provenance(self, plan.devices, mode, backend, compile_scope), self._judging,
            STORE_FULL if mode in CAPTURE_MODES.values() else self.dump, plan.modules,
            self._compiler.graphs, self.graph_dir if self.dump_graphs else None,
            plan.model_devices if mode == vocabulary.MODE_SINGLE_PASS and self.cast_dtype is None
            else None))

    # ------------------------------------------------------------------ single-pass
    def install(self, model: nn.Module) -> nn.Module:
        """Single-pass: compiles the wrapped modules of ``model`` in place and starts checking.

        Every call of a wrapped module then runs compiled (the training path) and is re-run
        eagerly on the same inputs for comparison. Call ``collect(loss)`` after each checked
        step, and ``uninstall()`` to restore the model.

        Given a model the user compiled whole (``torch.compile(model, backend=B)``, an
        ``OptimizedModule``), the checker compiles nothing of its own: it checks the wrapped
        modules at their boundaries inside the graphs Dynamo captures of the whole model, which
        ``B`` compiles as it would without the checker, with their boundary values as extra
        outputs (whole-model mode, docs/user-guide.md). ``backend`` and ``cast_dtype`` of the
        checker are then not used.
        """
        _options.expect_installable(model, self.single_pass, self._installation,
                                    self.cast_dtype, is_deepcopy_forbidden)
        whole = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
        plan = _planning.plan_check(model._orig_mod if whole else model, self._wrapped,
                                    self._ignored, self.cast_dtype)
        session = self._dumps.session()  # every rank agrees on the run folder, together
        options = dict(capture_input=self.capture_input, tolerances=self._judging,
                       reference=ReferencePolicy(self.reference))
        if whole:
            backend = torch._dynamo.eval_frame.innermost_backend(model.dynamo_ctx.callback)
            self._per_module_compiler, self._compiler = self._compiler, Compiler(backend)
            self._set_up(session, plan, vocabulary.MODE_SINGLE_PASS, backend, "whole_model")
            self._installation = _whole_model.install(model, plan, session, self._compiler,
                                                      **options)
        else:
            self._set_up(session, plan, vocabulary.MODE_SINGLE_PASS)
            self._installation = _single_pass.install(
                model, plan, session, self._compiler, cast_dtype=self.cast_dtype,
                replay=self.replay, backend=self.backend, **options)
        session.in_run = True
        return model

    def uninstall(self) -> None:
        """Restores the wrapped modules' original forwards and removes every hook."""
        if self._installation is not None:
            self._installation.remove()
            self._installation = None
        self._compiler = self._per_module_compiler
        self._recorded_loss = None
        self._dumps.end_run()

    def record_loss(self, loss: Union[torch.Tensor, float]) -> None:
        """Single-pass: records the loss of the step being checked, for ``collect()`` called
        without one (msProbe's ``record_loss``). A loss given to ``collect(loss)`` wins. The
        loss belongs to that one step: the next step has none unless recorded again.

        Args:
            loss: the step's loss, a one-element tensor (kept detached; no device sync) or a
                number.
        """
        _options.expect_loss("loss", loss)
        self._recorded_loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)

    def collect(self, loss: Optional[torch.Tensor] = None) -> Optional[CompareResult]:
        """Single-pass: finishes the step that just ran, writes it and returns its comparison;
        None for a step that is not checked (``check_every``, ``check_steps``).

        Checking continues with the next step until ``uninstall()``.
        """
        _options.expect_installed(self._installation)
        _options.expect_loss("loss", loss)
        recorded, self._recorded_loss = self._recorded_loss, None
        return self._installation.session.collect(self._installation,
                                                  recorded if loss is None else loss)

    # ------------------------------------------------------------------ compare / capture
    def compare(self, fn: Callable[[nn.Module], torch.Tensor], model: nn.Module) -> CompareResult:
        """Runs ``fn(model)`` (one training or inference step returning a scalar) and compares.

        single_pass=True: installs on ``model``, runs the step once, collects, uninstalls.
        single_pass=False: runs the step on an eager and on a compiled deep copy of ``model``
        with the same RNG state; ``model`` itself is left untouched.
        """
        _options.expect_step("checker.compare(lambda m: m(x).sum(), model)", fn, model)
        _options.expect_comparable(model, self.single_pass, self._installation,
                                   is_deepcopy_forbidden)
        if self.single_pass:
            self.install(model)
            # A step on its own, not a run: no estimate of a run's disk use, no overlap.
            self._installation.session.in_run = False
            try:
                return self.collect(fn(model))
            finally:
                self.uninstall()
        return self._run_sides(fn, model, [(SIDE_EAGER, copy.deepcopy(model)),
                                           (SIDE_COMPILED, copy.deepcopy(model))])

    def capture(self, fn: Callable[[nn.Module], torch.Tensor], model: nn.Module,
                side: str) -> str:
        """Runs ``fn(model)`` once on one side only and writes it to the dump; returns the step
        file. For comparing runs made in different processes or on different machines: capture
        ``side="eager"`` on one and ``side="compiled"`` on the other (same model code, same
        seed and inputs), then ``dynaprobe compare EAGER_DUMP COMPILED_DUMP``.

        ``model`` itself runs (no copy; FSDP2 models work), its wrapped modules compiled for the
        step when ``side="compiled"``. The file is what it is for: a step that cannot be written
        raises ``DumpIOError``, whatever ``strict_io`` says.

        A checker that captures both sides keeps each in a dump of its own, each side's steps
        numbered from 0: the side captured first in ``dump_dir``, the other in
        ``<run_dir>/<side>`` (with ``rank<R>`` below it when ``dump_dir`` is a rank folder).
        """
        _options.expect_step('checker.capture(lambda m: m(x).sum(), model, side="eager")', fn,
                             model)
        _options.expect_side(side)
        return self._run_sides(fn, model, [(side, model)], capture=side)

    def _run_sides(self, fn: Callable, model: nn.Module, sides: list,
                   capture: Optional[str] = None):
        """Runs ``fn`` on each (side, model) in turn (two-pass, capture()) and finishes the
        step; compares it unless it is a ``capture`` of one side."""
        plan = _planning.plan_check(model, self._wrapped, self._ignored, self.cast_dtype)
        mode = CAPTURE_MODES[capture] if capture else vocabulary.MODE_TWO_PASS
        session = self._dumps.session(capture, mode)  # single-pass steps' dump: one of its own
        self._set_up(session, plan, mode)
        return run_step(session, fn, model, sides, plan.targets, self._compiler,
                        self.capture_input, self.cast_dtype,
                        ReferencePolicy(None if capture else self.reference),
                        compare=capture is None)

    # ------------------------------------------------------------------ replay
    def bisect(self, module: str, call: Optional[int] = None, step: Optional[int] = None,
               stages=None, inductor_subsystems: bool = False, unpickle: bool = False,
               from_class: bool = False, ops: bool = False):
        """Replays a stored call of ``module`` (kept by ``replay=``) from this checker's dump
        through torch.compile's stages (eager, aot_eager, aot_eager_decomp_partition, inductor,
        inductor with fallback_random) and returns a ``dynaprobe.bisect.BisectResult``: the
        report's metrics at each stage against eager, and the first stage whose numbers change,
        forward and backward (docs/guide/diagnosis.md).

        Args:
            module: the module path, as the report names it.
            call: which call (default: the first one kept); step: which step (default: the
                first keeping replay data of ``module``). Only the steps this checker stored
                are replayed: a reused ``dump_dir``'s earlier steps are refused, saying so.
            stages: ``dynaprobe.bisect.Stage`` values in pipeline order, and ``"recorded"``
                for the backend and inductor config the call was captured with (default: the
                five above, then ``"recorded"`` when they are not stock). The stock stages
                compile under inductor's stock config, whatever this process has set.
            inductor_subsystems: when inductor is the first stage to fail, name its subsystem
                with ``torch._inductor.compiler_bisector`` (resets Dynamo; slow).
            from_class: replay through the module rebuilt from its class instead of the
                graphs Dynamo captured of the call (the default; no model code needed).
            ops: also name the first op of the call's aten graphs, forward and backward, whose
                value under the recorded backend fails against eager beyond fp64 noise, with
                its source line and, under inductor, its kernel (``result.ops``).
            unpickle: with ``from_class``, rebuild the module from the pickle the dump holds
                when its class needs constructor arguments; runs code the dump carries: only
                for dumps you trust.
        """
        from dynaprobe._offline import bisect as stage_bisect  # noqa: PLC0415 - its own module
        from dynaprobe._offline.replay import load_call  # noqa: PLC0415

        if not isinstance(module, str):
            raise TypeError(f"module must be the module's path as the report names it (a str), "
                            f"but received {type(module).__name__}: call it as "
                            f"checker.bisect(\"model.layers.0\")")
        stored = load_call(self.dump_dir, module, call, step, among=self._own_steps(step))
        return stage_bisect.bisect_call(stored, stages,
                                        inductor_subsystems=inductor_subsystems,
                                        unpickle=unpickle, from_class=from_class or unpickle,
                                        ops=ops, backend=self.backend)

    def remedy(self, module: Optional[str] = None, call: Optional[int] = None,
               step: Optional[int] = None, repeats: int = 5):
        """Replays the stored call of each failing module (default: those of the first step
        this checker stored with a failing row, root cause first; ``module``: that one) under
        candidate changes: inductor switches that change numerics, each switch the capture set
        put back, the stock backends and the module left uncompiled. Judges each against eager
        as the report does, times those that pass every row (median of ``repeats`` runs of the
        call, forward and backward) and returns a ``dynaprobe.remedy.RemedyResult``: per module
        the changes tried and the cheapest that passes (``.remedy``), as code to paste
        (``.code()``; docs/guide/diagnosis.md, From a finding to a fix)."""
        from dynaprobe._offline.remedy import remedy_dump  # noqa: PLC0415 - its own module

        return remedy_dump(self.dump_dir, None if module is None else [module], step, call,
                           among=self._own_steps(step), backend=self.backend, repeats=repeats)

    def confirm(self, remedy, fn: Callable[[nn.Module], torch.Tensor], model: nn.Module,
                repeats: int = 3):
        """Applies a remedy (what ``remedy()`` returned, one of its modules, or a dict of module
        -> ``dynaprobe.remedy.Change``) and proves it on the next checked step: ``fn(model)``
        runs on an eager copy and on a copy whose wrapped modules compile with the changes. It
        is confirmed when every row passes and the losses and gradient norms match within the
        tolerances; the step is also timed eager, compiled without the remedy and with it
        (median of ``repeats`` runs after the compile). Returns a
        ``dynaprobe.remedy.Confirmation`` (``.text()``: "confirmed on step N" and the speed
        kept). A confirmed remedy stays applied: later checked steps compile those modules with
        it (single-pass: the checker is installed again on ``model`` with it)."""
        from dynaprobe._checking.confirming import confirm  # noqa: PLC0415 - its own module

        return confirm(self, remedy, fn, model, repeats)

    def _own_steps(self, step: Optional[int]) -> List[int]:
        """The steps this checker stored in its dump, which alone it replays: a reused
        ``dump_dir``'s earlier steps (another run's weights and numbers) are refused, saying
        so, as is ``step`` when it is not one of them."""
        from dynaprobe._offline.stored_call import ReplayError  # noqa: PLC0415

        written = self._dumps.written_steps()
        if not written:
            raise ReplayError(
                f"this checker has stored no step in {self.dump_dir}: a step that was not stored "
                "(result.stored is False; stderr said why) cannot be replayed, and the steps of "
                "an earlier run in a reused dump_dir hold that run's weights and numbers")
        if step is not None and step not in written:
            raise ReplayError(
                f"step {step} of {self.dump_dir} was not written by this checker (its steps: "
                f"{', '.join(map(str, written))}): an earlier run's step in a reused dump_dir "
                "holds that run's weights and numbers. Replay it from a shell if you mean to "
                "(dynaprobe bisect DUMP --module M --step S), or give each run a dump_dir of its "
                "own")
        return written

    # ------------------------------------------------------------------ report
    def report(self, result: Optional[CompareResult], csv_path: Optional[str] = None,
               only_failing: bool = False, **format_paths: Optional[str]) -> None:
        """Prints the stdout report; with ``csv_path``, also writes the CSV report there. A step
        that was not checked (collect() returned None) has no report: nothing is printed.
        ``only_failing``: the stdout report shows its FAIL and WARN rows alone (every file
        report keeps every row).

        Every report format of ``dynaprobe compare --FORMAT PATH`` can be written too, as
        ``FORMAT_path=PATH``: ``html_path`` (the self-contained HTML report: error along the
        network, histograms of |diff|, graph code; docs/report-format.md#html), ``json_path``
        (every row with every metric), ``merged_csv_path`` (``rank,scenario`` + 9 columns).
        """
        _reporting.print_report(result, csv_path, format_paths, only_failing)

    def gather_report(self, results, csv_path: Optional[str] = None, *,
                      timeout: float = 300.0) -> Optional[str]:
        """Multi-rank: one CSV for the whole job, the spec's ``rank,scenario`` + 9 columns.

        Every rank calls it, after ``collect()``, with its result or a list of results (one per
        scenario, e.g. from several checkers, in the same order on every rank). Rank 0 gathers
        them over the default process group, writes ``csv_path`` (if given) and returns the CSV
        text; the other ranks return None. Rows go scenario by scenario (in the order given),
        rank by rank within a scenario; ``scenario`` is each checker's ``scenario`` label. The
        same rows as ``dynaprobe compare RUN_DIR --merged-csv PATH`` gives for one run folder.

        A rank that has not arrived after ``timeout`` seconds (it failed, or skipped the call)
        makes the waiting ranks raise RuntimeError instead of hanging; with the gloo backend the
        message names the missing ranks (other backends wait for the process group's timeout).
        """
        return _reporting.gather_merged_csv(results, csv_path, timeout)
