"""PrecisionChecker: the spec's API (wrap / ignore / install / collect / compare / report), a
façade over modules of one concern each: _planning (targets), _compiling (torch.compile, graph
breaks), _single_pass and _two_pass (the modes), _step (what one step records), _distributed
(ranks), _options (argument checks), _result (what users get back)."""

from __future__ import annotations

import atexit
import copy
import datetime
import os
import socket
import sys
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from dynaprobe._C import vocabulary
from dynaprobe import _C, _options, _replay_store, _storage
from dynaprobe._capture import autocast_device_type, devices_of
from dynaprobe._compiling import Compiler
from dynaprobe._distributed import (
    gather_to_rank0,
    is_deepcopy_forbidden,
    nested_fully_shard,
    rank_and_world,
    resolve_dump_dir,
)
from dynaprobe._environment import environment
from dynaprobe._graphs import write_graph_files
from dynaprobe._planning import describe_model, plan
from dynaprobe._reference import ReferencePolicy, expect_reference, user_autocast
from dynaprobe._result import CompareResult
from dynaprobe._single_pass import SinglePass
from dynaprobe._step import Step, Target
from dynaprobe._two_pass import run_sides
from dynaprobe._whole_model import WholeModel

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)

# Checkers with a step whose file may still be being committed (collect() in a run).
_committing_checkers: "weakref.WeakSet[PrecisionChecker]" = weakref.WeakSet()


@atexit.register
def _commit_before_exit() -> None:
    """The steps collect() reported are on disk when the interpreter exits."""
    for checker in list(_committing_checkers):
        try:
            checker.wait_committed()
        except Exception as error:  # the step is lost: say so, and let the exit go on
            print(f"dynaprobe: {error}", file=sys.stderr)


def _write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


class PrecisionChecker:
    """Compares a model's wrapped modules run eagerly and under ``torch.compile``.

    Args:
        backend: the ``torch.compile`` backend (a name or a callable).
        threshold: absolute tolerance ``atol`` of the comparison (the spec's ``allclose`` check,
            ``|eager - compiled| <= atol + rtol * |compiled|``).
        dump_graphs: save the graphs Dynamo and AOTAutograd produce to ``graph_dir``.
        graph_dir: where graph dumps go.
        cast_dtype: run wrapped modules under ``torch.autocast`` with this dtype, both sides.
        capture_input: record and compare module inputs (FORWARD INPUT).
        single_pass: compare inside one training run (True) or run an eager and a compiled copy
            of the model (False).
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

    def __init__(
        self,
        backend="aot_eager",
        threshold: float = 1e-4,
        dump_graphs: bool = False,
        graph_dir: str = "./graph_dump",
        cast_dtype: Optional[torch.dtype] = None,
        capture_input: bool = True,
        single_pass: bool = True,
        *,
        dump_dir: Optional[str] = None,
        scenario: str = "",
        rtol: float = 1e-3,
        memory_budget_bytes: int = 1 << 30,
        reference: Optional[str] = "auto",
        verdict: str = "reference",
        tolerances: Optional[Dict[str, Tuple[float, float]]] = None,
        dtype_aware_tolerances: bool = True,
        dump: str = "full",
        check_every: int = 1,
        check_steps=None,
        disk_budget_bytes: Optional[int] = None,
        replay: Optional[str] = None,
        strict_io: bool = False,
    ):
        self.backend = _options.expect_backend(backend)
        self.threshold = _options.expect_tolerance("threshold", threshold)
        self.dump_graphs = _options.expect_flag("dump_graphs", dump_graphs)
        self.graph_dir = _options.expect_path("graph_dir", graph_dir)
        self.cast_dtype = _options.expect_cast_dtype(cast_dtype)
        self.capture_input = _options.expect_flag("capture_input", capture_input)
        self.single_pass = _options.expect_flag("single_pass", single_pass)
        if not isinstance(scenario, str):
            raise TypeError(f"scenario must be a str, but received {scenario!r}")
        self.scenario = scenario
        self.rtol = _options.expect_tolerance("rtol", rtol)
        self.memory_budget_bytes = _options.expect_positive_int("memory_budget_bytes",
                                                                memory_budget_bytes)
        self._dump_dir = _options.expect_path("dump_dir", dump_dir, optional=True)
        self.reference = expect_reference(reference, self.single_pass)
        self.verdict = _options.expect_verdict(verdict)
        self.tolerances = _options.expect_tolerance_rules(tolerances)
        self.dtype_aware_tolerances = _options.expect_flag("dtype_aware_tolerances",
                                                           dtype_aware_tolerances)
        self.dump = _storage.expect_dump_mode(dump)
        if self.reference not in (None, "auto") and self.dump != "full":
            raise ValueError(f"reference={self.reference!r} needs dump='full': the reference "
                             "is compared with the stored tensors of both sides")
        self._schedule = _storage.Schedule(_options.expect_positive_int("check_every", check_every),
                                           _storage.expect_steps(check_steps))
        self.disk_budget_bytes = None if disk_budget_bytes is None else \
            _options.expect_positive_int("disk_budget_bytes", disk_budget_bytes)
        self.replay = _replay_store.expect_replay(replay, self.single_pass, self.dump)
        self.strict_io = _options.expect_flag("strict_io", strict_io)
        self._writes = _storage.Writes(self.strict_io)
        # The first stored step says where the dump is: install()/collect() runs with an estimate
        # of the run's disk use, compare() with the command that reads it again (capture()
        # returns its file).
        self._estimated = False
        self._committing = None  # the last ended step, while its file may still be written
        self._one_step = False  # compare(): a step on its own, not a run of steps
        self._dump_dir_resolved = False  # see the dump_dir property
        self._wrapped: List[nn.Module] = []
        self._ignored: List[nn.Module] = []
        self._recorder = None
        self._step_index = 0
        self._step: Optional[Step] = None
        self._installed: Optional[nn.Module] = None
        # install(): the installation, per module or on a model compiled whole
        self._single_pass: Optional[Union[SinglePass, WholeModel]] = None
        self._module_notes: List[Tuple[str, Dict[str, str]]] = []
        self._compiler = Compiler(backend)
        self._capture_side: Optional[str] = None  # capture(): the one side this dump holds
        self._devices: Dict[str, str] = {}  # provenance: device and dtype of the model
        self._model_devices: set = set()  # the devices of the model (autocast's device type)
        self._recorded_loss = None  # record_loss(): the loss of the step being checked
        # install(): the provenance, worked out before any step: a step may begin inside a region
        # Dynamo traces, which must not see the checker's own code (socket, clock).
        self._installed_provenance: Optional[Dict[str, str]] = None

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
        for _, module in model.named_modules():
            if isinstance(module, module_types):
                self.wrap(module)
        return model

    def wrap_all_children(self, model: nn.Module, depth: int = 1) -> nn.Module:
        """Marks submodules ``depth`` levels below the direct children (depth=0: the direct
        children). Containers (ModuleList, ModuleDict, Sequential) are looked through without
        using up depth; modules without children are marked where the recursion reaches them."""
        _options.expect_module("checker.wrap_all_children(model, depth=1)", "model", model)
        depth = _options.expect_depth(depth)

        def visit(module: nn.Module, remaining: int) -> None:
            for child in module.children():
                if isinstance(child, _CONTAINERS):
                    visit(child, remaining)
                elif remaining <= 0 or not any(True for _ in child.children()):
                    self.wrap(child)
                else:
                    visit(child, remaining - 1)

        visit(model, depth)
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
        for _, module in model.named_modules():
            if isinstance(module, module_types):
                self.ignore(module)
        return model

    # ------------------------------------------------------------------ plan
    def _plan(self, model: nn.Module) -> List[Tuple[str, str]]:
        """The compile targets of ``model`` (display name, path); keeps the /modules entries
        and the model's provenance for the dump; refuses a cast_dtype autocast would drop."""
        targets, self._module_notes = plan(model, self._wrapped, self._ignored)
        self._devices = describe_model(model)
        self._model_devices = devices_of([], model)
        _options.expect_autocast(self.cast_dtype, autocast_device_type(self._model_devices))
        return targets

    # ------------------------------------------------------------------ dump
    def _provenance(self, mode: str, backend=None,
                    compile_scope: str = "per_module") -> Dict[str, str]:
        rank, world = rank_and_world()
        backend = self.backend if backend is None else backend
        backend = backend if isinstance(backend, str) else getattr(
            backend, "compiler_name", getattr(backend, "__name__", type(backend).__name__))
        return {
            "producer": "dynaprobe.PrecisionChecker",
            "torch_version": torch.__version__,
            "backend": backend,
            vocabulary.PROVENANCE_MODE: mode,
            "compile_scope": compile_scope,
            vocabulary.PROVENANCE_RANK: str(rank),
            "world_size": str(world),
            vocabulary.PROVENANCE_SCENARIO: self.scenario,
            vocabulary.PROVENANCE_ATOL: repr(float(self.threshold)),
            vocabulary.PROVENANCE_RTOL: repr(float(self.rtol)),
            vocabulary.PROVENANCE_CAST_DTYPE: str(self.cast_dtype) if self.cast_dtype is not None
            else "None",
            vocabulary.PROVENANCE_CAPTURE_INPUT: "true" if self.capture_input else "false",
            vocabulary.PROVENANCE_REFERENCE: str(self._reference_policy().mode),
            vocabulary.PROVENANCE_VERDICT: self.verdict,
            vocabulary.PROVENANCE_TOLERANCE_RULES: "".join(f"{atol!r} {rtol!r} {pattern}\n"
                                       for pattern, (atol, rtol) in self.tolerances.items()),
            vocabulary.PROVENANCE_DTYPE_AWARE_TOLERANCES:
                "true" if self.dtype_aware_tolerances else "false",
            **self._devices,
            **environment(),
            "host": socket.gethostname(),
            vocabulary.PROVENANCE_CREATED: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }

    def _reference_policy(self) -> ReferencePolicy:
        """What ``reference`` runs: "auto" needs the stored tensors (dump="full"); under
        "failing" or "stats" low-precision rows keep the tolerances' verdict (a warning says so
        at the first such call)."""
        if self.reference == "auto" and self.dump != "full":
            return ReferencePolicy(None, unavailable=f"dump={self.dump!r} stores no tensors to "
                                   "judge against a reference: low-precision rows are judged by "
                                   "the dtype's tolerances alone; use dump='full' for the "
                                   "reference's verdict")
        return ReferencePolicy(self.reference)

    @property
    def dump_dir(self) -> str:
        """The folder of this rank's dump (one step file per collect()/compare()).

        Default: ``./dynaprobe_runs/<run>/rank<R>``. With several ranks (torch.distributed
        initialized, world size > 1) all ranks write into one run folder: rank 0 names it and
        broadcasts the name when ``install()``/``compare()``/``capture()`` first needs it (every
        rank calls those), and a ``dump_dir`` given to the constructor names the run folder,
        each rank writing ``<dump_dir>/rank<R>``. In a single process ``dump_dir`` is the dump.
        """
        if not self._dump_dir_resolved:
            self._dump_dir = resolve_dump_dir(self._dump_dir)
            self._dump_dir_resolved = True
        return self._dump_dir

    @property
    def run_dir(self) -> str:
        """The run folder: the folder above ``dump_dir`` when that is ``rank<R>`` (the default,
        and every multi-rank run), else ``dump_dir``. ``dynaprobe compare RUN_DIR --merged-csv
        PATH`` reports every rank of it."""
        parent, leaf = os.path.split(os.path.normpath(self.dump_dir))
        return parent if leaf == f"rank{rank_and_world()[0]}" else self.dump_dir

    def _begin_step(self, targets: List[Target]) -> Step:
        if self._recorder is None:
            mode = {None: vocabulary.MODE_SINGLE_PASS if self.single_pass else vocabulary.MODE_TWO_PASS,
                    "eager": vocabulary.MODE_EAGER_ONLY,
                    "compiled": vocabulary.MODE_COMPILED_ONLY}[self._capture_side]
            provenance = dict(self._installed_provenance or self._provenance(mode))
            # The first checked call runs inside the user's torch.autocast, if any.
            autocast = user_autocast(self._model_devices) if self._installed is not None \
                else None
            if autocast is not None and self.cast_dtype is None:
                provenance[vocabulary.PROVENANCE_AUTOCAST] = str(autocast)
            self._recorder = _C.Recorder(self.dump_dir, provenance,
                                         memory_budget_bytes=self.memory_budget_bytes,
                                         store="full" if self._capture_side else self.dump,
                                         strict_io=self.strict_io)
        self._recorder.begin_step(self._step_index)
        for target in targets:
            target.calls = 0
        self._step = Step(self._recorder, self._step_index)
        return self._step

    def _current_step(self) -> Optional[Step]:
        """Single-pass: the step being checked, begun by the first wrapped call after install()
        or collect(); None in a step that is not checked (check_every, check_steps)."""
        if self._step is None and not self._schedule.checks(self._step_index):
            return None
        return self._step if self._step is not None else self._begin_step(
            self._single_pass.targets)

    def _finish_step(self, compare: bool = True):
        step = self._step
        graphs = self._compiler.graphs.take()
        for graph in graphs:
            self._recorder.record_graph(graph.name, graph.kind, graph.text,
                                        {"function": graph.function, "module": graph.module})
        if self.dump_graphs and graphs:
            write_graph_files(graphs, self.graph_dir)
        for name, attributes in self._module_notes:
            attributes = dict(attributes, **step.attributes.get(name, {}))
            if name in step.notes and vocabulary.ATTRIBUTE_NOTE not in attributes:
                note, reason = step.notes[name]
                attributes[vocabulary.ATTRIBUTE_NOTE] = note
                attributes[vocabulary.ATTRIBUTE_REASON] = reason
            self._recorder.record_module(name, attributes)
        # Ends the step once it is judged; its file is committed in the background while
        # training goes on (raises a background error: disk full, ... with strict_io).
        pending = self._recorder.finish_step()
        self._step = None
        self._step_index += 1
        # capture() exists for its file: losing it raises, whatever strict_io says.
        writes = self._writes if compare else _storage.Writes(strict=True)
        commit = _storage.Commit(pending, writes, self.dump_dir)
        # One step in flight: the one before is committed by now (or said not stored).
        previous, self._committing = self._committing, commit
        _committing_checkers.add(self)
        if previous is not None:
            previous.wait()
        in_run = self._installed is not None and not self._one_step
        if (not in_run or self.disk_budget_bytes is not None or not self._estimated
                or self._writes.failing):
            # The disk budget and the first step's estimate need the file's size; while writes
            # fail, the report says at once whether this step was stored.
            self.wait_committed()
        stored = commit.done and commit.error is None
        try:
            if self.disk_budget_bytes is not None and stored:
                _storage.enforce_budget(self.dump_dir, self.disk_budget_bytes, pending.file)
            if not self._estimated and in_run and stored:
                self._estimated = True
                _storage.report_first_step(self.dump_dir, pending.file, self.dump,
                                           self._schedule, step.index, self.disk_budget_bytes)
            elif not self._estimated and not in_run and stored and compare:  # compare()
                self._estimated = True
                print(f"dynaprobe: step {step.index} written to {self.dump_dir} "
                      f"(dynaprobe compare {self.dump_dir})", file=sys.stderr)
        except OSError as error:  # the folder went away meanwhile: the dump's loss, not training's
            if self.strict_io:
                raise
            self._writes.failed(self.dump_dir, step.index, error)
        if step.error is not None:
            if self.strict_io:
                raise step.error
            print(f"dynaprobe: step {step.index} was lost ({step.error}); training goes on",
                  file=sys.stderr)
            return None
        if not compare:
            return pending.file
        # The report comes from the step as judged in memory, the same as `dynaprobe compare`
        # of its file; pairs not judged in memory wait for the file.
        comparison = _C.compare_pending(pending)
        return CompareResult.from_report(comparison.steps[0], self.dump_dir, pending.file,
                                         comparison, commit)

    def wait_committed(self) -> None:
        """Waits until the last checked step's file is committed. ``collect()`` returns once a
        step is judged and reported, and its file is written while training goes on; the next
        ``collect()``, ``uninstall()`` and ``CompareResult.dump_file`` wait for it. With
        ``strict_io=True`` raises the error that lost the step's file (disk full, ...); else
        says it on stderr (once) and the step's result has ``stored`` False."""
        committing, self._committing = self._committing, None
        if committing is not None:
            committing.wait()

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
        _options.expect_module("checker.install(model)", "model", model)
        if not self.single_pass:
            if is_deepcopy_forbidden(model):
                raise RuntimeError(
                    "install() only supports single_pass=True, and two-pass (single_pass=False) "
                    "deep-copies the model, which FSDP2/DTensor-sharded models forbid: use "
                    "PrecisionChecker(single_pass=True) with install(model) and collect(loss)")
            raise RuntimeError("install() only supports single_pass=True; for two-pass use "
                               "compare(run_step, model)")
        if self._installed is not None:
            raise RuntimeError("this checker is already installed on a model; call uninstall() "
                               "first")
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            return self._install_whole_model(model)
        planned = self._plan(model)
        self.dump_dir  # noqa: B018 - several ranks agree on their run folder now, all together
        self._installed_provenance = self._provenance(vocabulary.MODE_SINGLE_PASS)
        modules = dict(model.named_modules())
        targets = []
        for display, name in planned:
            module = modules[name]
            original = module.forward
            targets.append(Target(display, module, self._compiler.compile(display, original),
                                  original))
            self._warn_nested_fully_shard(display, module)
        self._single_pass = SinglePass(targets, self._current_step, lambda: self._step,
                                       self.capture_input, self.cast_dtype,
                                       self._reference_policy(), (self.threshold, self.rtol),
                                       self.replay, self.backend, self._compiler.graphs)
        self._installed = model
        return model

    def _install_whole_model(self, compiled: nn.Module) -> nn.Module:
        """install() on a model compiled whole: see install()."""
        if self.cast_dtype is not None:
            raise ValueError("install() of a compiled model (whole-model mode) checks the model "
                             "as it was compiled: cast_dtype is not available (enter "
                             "torch.autocast around the step instead); create the checker "
                             "without it")
        model = compiled._orig_mod
        backend = torch._dynamo.eval_frame.innermost_backend(compiled.dynamo_ctx.callback)
        planned = self._plan(model)
        self.dump_dir  # noqa: B018 - several ranks agree on their run folder now, all together
        self._installed_provenance = self._provenance(vocabulary.MODE_SINGLE_PASS, backend,
                                                      "whole_model")
        modules = dict(model.named_modules())
        targets = [Target(display, modules[name], None, None) for display, name in planned]
        self._per_module_compiler, self._compiler = self._compiler, Compiler(backend)
        self._single_pass = WholeModel(compiled, targets, type(model).__name__,
                                       self._compiler.graphs, self._current_step,
                                       lambda: self._step, self.capture_input,
                                       self._reference_policy(), (self.threshold, self.rtol))
        self._installed = compiled
        return compiled

    def _warn_nested_fully_shard(self, name: str, module: nn.Module) -> None:
        """A wrapped module holding fully_shard units below it: their parameters are still
        sharded when it is called (each unit gathers its own inside), so their gradients are not
        compared; its eager re-run gathers them again, on every rank alike."""
        nested = nested_fully_shard(module)
        if not nested:
            return
        for entry, attributes in self._module_notes:
            if entry == name:
                attributes[vocabulary.ATTRIBUTE_NESTED_FULLY_SHARD] = ", ".join(nested)
        warnings.warn(
            f"dynaprobe: wrapped module {name} contains fully_shard units ({', '.join(nested)}): "
            "the gradients of their parameters are not compared (they are sharded when it is "
            "called); wrap the fully_shard units themselves to compare them", stacklevel=3)

    def uninstall(self) -> None:
        """Restores the wrapped modules' original forwards and removes every hook."""
        if self._single_pass is not None:
            self._single_pass.remove()
            self._single_pass = None
        if isinstance(self._installed, torch._dynamo.eval_frame.OptimizedModule):
            self._compiler = self._per_module_compiler
        self._installed = None
        self._installed_provenance = None
        self._recorded_loss = None
        if self._step is not None:  # a step begun but never collected is discarded
            self._step = None
            self._recorder = None
        self.wait_committed()

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
        if self._installed is None:
            raise RuntimeError("collect() needs install(model) first (single-pass), then a "
                               "training or inference step: checker.install(model); loss = "
                               "step(model); checker.collect(loss)")
        _options.expect_loss("loss", loss)
        step = self._current_step()
        if step is None:
            self._step_index += 1
            self._recorded_loss = None
            return None
        self._single_pass.finish(step)
        if loss is None:
            loss = self._recorded_loss
        self._recorded_loss = None
        if loss is not None:
            step.record_loss("compiled", loss)
        targets = self._single_pass.targets
        whole_model = isinstance(self._single_pass, WholeModel)
        if whole_model:
            self._single_pass.summarize(step)
        else:
            self._compiler.summarize(step, targets)
        step.record_param_grads([(t.name, [(n, p, p, p) for n, p in t.params])
                                 for t in targets])
        if not whole_model:  # whole-model mode keeps no replay data (user-guide.md)
            self._single_pass.decide_replays(step, final=True)
        return self._finish_step()

    # ------------------------------------------------------------------ compare
    def compare(self, fn: Callable[[nn.Module], torch.Tensor], model: nn.Module) -> CompareResult:
        """Runs ``fn(model)`` (one training or inference step returning a scalar) and compares.

        single_pass=True: installs on ``model``, runs the step once, collects, uninstalls.
        single_pass=False: runs the step on an eager and on a compiled deep copy of ``model``
        with the same RNG state; ``model`` itself is left untouched.
        """
        _options.expect_step("checker.compare(lambda m: m(x).sum(), model)", fn, model)
        if self.single_pass:
            if self._installed is not None:
                raise RuntimeError("compare() cannot run while install() is active; call "
                                   "collect() instead, or uninstall() first")
            self.install(model)
            self._one_step = True  # not a run: no estimate of a run's disk use, no overlap
            try:
                loss = fn(model)
                return self.collect(loss)
            finally:
                self._one_step = False
                self.uninstall()
        if is_deepcopy_forbidden(model):
            raise RuntimeError(
                "two-pass (single_pass=False) deep-copies the model, which FSDP2/DTensor-sharded "
                "models forbid; use single-pass: PrecisionChecker(single_pass=True) with "
                "install(model) and collect(loss)")
        return self._run_sides(fn, model, [("eager", copy.deepcopy(model)),
                                           ("compiled", copy.deepcopy(model))])

    def capture(self, fn: Callable[[nn.Module], torch.Tensor], model: nn.Module,
                side: str) -> str:
        """Runs ``fn(model)`` once on one side only and writes it to the dump; returns the step
        file. For comparing runs made in different processes or on different machines: capture
        ``side="eager"`` on one and ``side="compiled"`` on the other (same model code, same
        seed and inputs), then ``dynaprobe compare EAGER_DUMP COMPILED_DUMP``.

        ``model`` itself runs (no copy; FSDP2 models work), its wrapped modules compiled for the
        step when ``side="compiled"``. The file is what it is for: a step that cannot be written
        raises ``DumpIOError``, whatever ``strict_io`` says.
        """
        _options.expect_step('checker.capture(lambda m: m(x).sum(), model, side="eager")', fn,
                             model)
        if side not in ("eager", "compiled"):
            raise ValueError(f"side must be 'eager' or 'compiled', not {side!r}")
        self._capture_side = side
        return self._run_sides(fn, model, [(side, model)], compare=False)

    def _run_sides(self, fn: Callable, model: nn.Module, sides: list, compare: bool = True):
        """Runs ``fn`` on each (side, model) in turn (two-pass, capture()) and finishes the
        step; compares it unless ``compare`` is False."""
        targets = self._plan(model)
        step = self._begin_step([])
        try:
            by_side = run_sides(step, fn, model, sides, targets, self._compiler.compile,
                                self.capture_input, self.cast_dtype,
                                self._reference_policy() if compare else ReferencePolicy(None))
            if "compiled" in by_side:
                self._compiler.summarize(step, by_side["compiled"])
            return self._finish_step(compare=compare)
        finally:
            self._step = None

    # ------------------------------------------------------------------ replay
    def bisect(self, module: str, call: Optional[int] = None, step: Optional[int] = None,
               stages=None, inductor_subsystems: bool = False, unpickle: bool = False,
               from_class: bool = False, ops: bool = False):
        """Replays a stored call of ``module`` (kept by ``replay=``) from this checker's dump
        through torch.compile's stages (eager, aot_eager, aot_eager_decomp_partition, inductor,
        inductor with fallback_random) and returns a ``dynaprobe.bisect.BisectResult``: the
        report's metrics at each stage against eager, and the first stage whose numbers change,
        forward and backward (docs/user-guide.md).

        Args:
            module: the module path, as the report names it.
            call: which call (default: the first one kept); step: which step (default: the
                first keeping replay data of ``module``).
            stages: ``dynaprobe.bisect.Stage`` values in pipeline order (default: the five
                above, then the backend and inductor config the call was captured with, when
                they are not stock: ``dynaprobe.bisect.recorded_stage``).
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
        from dynaprobe import bisect as stage_bisect  # noqa: PLC0415 - its own module
        from dynaprobe._replay import load_call  # noqa: PLC0415

        if not isinstance(module, str):
            raise TypeError(f"module must be the module's path as the report names it (a str), "
                            f"but received {type(module).__name__}: call it as "
                            f"checker.bisect(\"model.layers.0\")")
        stored = load_call(self.dump_dir, module, call, step)
        return stage_bisect.bisect_call(stored, stages,
                                        inductor_subsystems=inductor_subsystems,
                                        unpickle=unpickle, from_class=from_class or unpickle,
                                        ops=ops, backend=self.backend)

    # ------------------------------------------------------------------ report
    def report(self, result: Optional[CompareResult], csv_path: Optional[str] = None,
               **format_paths: Optional[str]) -> None:
        """Prints the stdout report; with ``csv_path``, also writes the CSV report there. A step
        that was not checked (collect() returned None) has no report: nothing is printed.

        Every report format of ``dynaprobe compare --FORMAT PATH`` can be written too, as
        ``FORMAT_path=PATH``: ``html_path`` (the self-contained HTML report: error along the
        network, histograms of |diff|, graph code; docs/report-format.md#html), ``json_path``
        (every row with every metric), ``merged_csv_path`` (``rank,scenario`` + 9 columns).
        """
        formats = {name.replace("-", "_") + "_path": (name, title)
                   for name, title in _C.report_formats()}
        unknown = sorted(set(format_paths) - set(formats))
        if unknown:
            raise TypeError(f"report() got unexpected keyword argument(s) {', '.join(unknown)}; "
                            f"the report formats are {', '.join(['csv_path', *formats])}")
        if result is None:
            return
        if not isinstance(result, CompareResult):
            raise TypeError(f"result must be what collect() or compare() returned (a "
                            f"CompareResult), but received {type(result).__name__}: call it as "
                            f"checker.report(checker.collect(loss))")
        print(result.text(), end="")
        if csv_path:
            _write_text(csv_path, result.csv())
            print(f"CSV report saved to: {csv_path}")
        for keyword, (name, title) in formats.items():
            path = format_paths.get(keyword)
            if path:
                _write_text(path, result.render(name))
                print(f"{title} report saved to: {path}")

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
        results = [results] if isinstance(results, CompareResult) else list(results)
        rank, world = rank_and_world()
        mine = [result.merged_csv(rank) for result in results]
        gathered = gather_to_rank0(mine, timeout) if world > 1 else [mine]
        if rank != 0:
            return None
        if len({len(texts) for texts in gathered}) > 1:
            raise ValueError("gather_report(): the ranks passed different numbers of results ("
                             + ", ".join(f"rank {r}: {len(t)}" for r, t in enumerate(gathered))
                             + "); pass the same scenarios in the same order on every rank")
        text = _C.render_merged_csv([])  # the header
        for index in range(len(mine)):
            for texts in gathered:
                text += texts[index].split("\n", 1)[1]  # without its header
        if csv_path:
            _write_text(csv_path, text)
            print(f"Merged CSV report saved to: {csv_path}")
        return text
