"""PrecisionChecker: the spec's API (wrap / ignore / install / collect / compare / report)."""

from __future__ import annotations

import copy
import datetime
import itertools
import math
import os
import re
import socket
import threading
import types
import warnings
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from dynaprobe import _C, _options
from dynaprobe._capture import (
    RngState,
    Shard,
    _eager_backward,
    _in_eager_backward,
    autocast_context,
    autocast_device_type,
    devices_of,
    input_leaves,
    local_tensor,
    map_output_tensors,
    map_tensors,
    tensor_leaves,
)
from dynaprobe._isolation import ModuleGlobals, ModuleState, copy_arguments
from dynaprobe._graphs import GraphRecorder, write_graph_files
from dynaprobe._result import CompareResult

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_checker_numbers = itertools.count()  # default dump folders of checkers in one process differ
LOSS_MODULE = "LOSS"  # Keep in sync with formats::kLossModule.


def _under(name: str, prefix: str) -> bool:
    return prefix == "" and name != "" or name.startswith(prefix + ".")


def _own_entry(forward: Callable, name: str) -> Callable:
    """A function calling ``forward``, with a code object of its own.

    Dynamo keeps its compiled code, its recompile limit (8) and its skip decisions per code
    object, and every instance of a class shares that class's ``forward`` code (every torch.nn
    module even shares one). Compiling ``forward`` itself would let the ninth wrapped block of a
    model, or every built-in module after an ``nn.Identity`` whose empty graph gets its code
    skipped, silently run eagerly. One entry code object per wrapped module keeps each module's
    compilation its own.
    """

    def entry(*args, **kwargs):
        return forward(*args, **kwargs)

    label = re.sub(r"\W", "_", name)
    code = entry.__code__.replace(co_name=f"dynaprobe_{label}",
                                  co_qualname=f"dynaprobe_{label}")
    # Dynamo installs the compiled functions into the entry's globals: give it those of the
    # module's own code, where they would go without dynaprobe.
    home = getattr(getattr(forward, "__func__", forward), "__globals__", entry.__globals__)
    return types.FunctionType(code, home, code.co_name, entry.__defaults__, entry.__closure__)


def _probe(tensor: torch.Tensor, hook: Callable) -> torch.Tensor:
    """An identity view of ``tensor`` that calls ``hook(grad)`` in the backward.

    Probing a module's inputs and outputs through their own views gives the gradients at the
    module boundary, as ``register_full_backward_hook`` means them: the view of an output gets
    only the gradient arriving from outside the module (a hook on the output itself would also
    see the paths through the module's other outputs computed from it), and the view of an input
    the gradient leaving the module through that argument.
    """
    if not tensor.requires_grad:
        return tensor
    view = tensor.view_as(tensor)
    view.register_hook(hook)
    return view


def _rank_and_world() -> Tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _gather_to_rank0(value, timeout: float) -> Optional[list]:
    """Every rank's ``value`` on rank 0 (a list in rank order), None on the others; a RuntimeError
    that says what happened instead of a hang when a rank does not come."""
    dist = torch.distributed
    rank, world = _rank_and_world()
    try:
        if dist.get_backend() == "gloo":  # names the ranks that did not come, after timeout
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout),
                                   wait_all_ranks=True)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(value, gathered, dst=0)
    except RuntimeError as error:
        raise RuntimeError(
            f"dynaprobe: gather_report() on rank {rank}: not all {world} ranks reached "
            f"gather_report() within {timeout:g} s (a rank failed or stopped before it, or did "
            f"not call it): {error}") from error
    return gathered


def _is_deepcopy_forbidden(model: nn.Module) -> bool:
    """FSDP2 (fully_shard) and other DTensor-sharded models cannot be deep-copied."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        FSDPModule = ()
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


class _Target:
    """A wrapped module that is a compile target, and how it is run on this side."""

    def __init__(self, name: str, module: nn.Module, run: Callable, eager: Optional[Callable]):
        self.name = name
        self.module = module
        self.run = run  # what the model executes: compiled (or eager on a two-pass eager copy)
        self.eager = eager  # single-pass: the original forward, re-run eagerly
        # Single-pass: the parameters of the latest call (under FSDP2 the full parameters the
        # forward used, registered in place of the DTensor shards while it runs).
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # FSDP2/DTensor-sharded parameters by name: this rank's shard, to cut gradients to.
        self.shards = {n: s for n, s in ((n, Shard.of(p)) for n, p in self.params) if s}
        self.calls = 0


class _PendingBackward:
    """The eager re-run of one call, waiting for the real backward to deliver grad_output."""

    def __init__(self, step: "_Step", target: _Target, call: int, eager_outputs: list,
                 leaves: list, params: list):
        self.step = step
        self.target = target
        self.call = call
        self.params = params  # the parameters this call's eager forward used
        self.eager_outputs = eager_outputs  # (index, tensor) pairs that require grad
        self.leaves = leaves  # (input index, eager input leaf)
        self.grads: Dict[int, torch.Tensor] = {}
        self.done = False

    def on_output_grad(self, index: int, grad: torch.Tensor) -> None:
        self.grads[index] = grad.detach()

    def run(self) -> None:
        """Runs the eager backward with the grad_output the compiled module received."""
        if self.done or not self.grads:
            return
        self.done = True
        outputs, grad_outputs = [], []
        for index, tensor in self.eager_outputs:
            outputs.append(tensor)
            grad = self.grads.get(index)
            grad_outputs.append(grad if grad is not None and grad.shape == tensor.shape
                                else torch.zeros_like(tensor))
        params = [p for _, p in self.params]
        inputs = [leaf for _, leaf in self.leaves] + params
        if inputs:
            try:
                with _eager_backward(), torch.enable_grad():
                    grads = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
            except Exception as error:  # never break the training backward because of the checker
                self.step.note(self.target.name, "HOOK_ERROR",
                               f"eager backward failed: {type(error).__name__}: {error}")
                grads = ()
            for (index, leaf), grad in zip(self.leaves, grads):
                if grad is not None:
                    self.step.record(self.target.name, self.call, "grad_input", index, "eager", grad)
            for param, grad in zip(params, grads[len(self.leaves):]):
                if grad is not None:
                    self.step.add_param_grad("eager", param, grad)
        self.eager_outputs = self.leaves = self.params = []

    def params_freed(self) -> bool:
        """FSDP2 frees the full parameters' storage when it reshards after the backward: the
        eager graph, which saved them, cannot run any more."""
        return any(p.untyped_storage().size() == 0 and p.numel() > 0 for _, p in self.params)


class _Step:
    """Everything captured during one step, until collect()."""

    def __init__(self, checker: "PrecisionChecker", index: int):
        self.checker = checker
        self.index = index
        self.pending: List[_PendingBackward] = []
        self.param_grads: Dict[str, Dict[int, torch.Tensor]] = {"eager": {}, "compiled": {}}
        self.shards: Dict[int, Shard] = {}  # id(full parameter) -> this rank's shard (FSDP2)
        self.notes: Dict[str, Tuple[str, str]] = {}
        self.attributes: Dict[str, Dict[str, str]] = {}  # per module, for /modules
        self.error: Optional[BaseException] = None
        # Backward hooks may run on autograd's device threads; the recorder takes one call at a
        # time.
        self.lock = threading.Lock()

    def record(self, module: str, call: int, kind: str, index: int, side: str,
               tensor: torch.Tensor, label: str = "") -> None:
        if self.error is not None:
            return
        try:
            with self.lock:
                self.checker._recorder.record(module, call, kind, index, side,
                                              local_tensor(tensor.detach()), label)
        except Exception as error:  # disk full, ...: reported by collect(), training goes on
            self.error = error

    def add_param_grad(self, side: str, param: torch.Tensor, grad: torch.Tensor) -> None:
        sums = self.param_grads[side]
        key = id(param)
        shard = self.shards.get(key)
        grad = shard.cut(grad.detach()) if shard is not None else grad.detach()
        sums[key] = grad.clone() if key not in sums else sums[key] + grad

    def note(self, module: str, note: str, reason: str) -> None:
        self.notes.setdefault(module, (note, reason))


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
        self._dump_dir_resolved = False  # see the dump_dir property
        self._wrapped: List[nn.Module] = []
        self._ignored: List[nn.Module] = []
        self._recorder = None
        self._step_index = 0
        self._step: Optional[_Step] = None
        self._installed: Optional[nn.Module] = None
        self._targets: List[_Target] = []
        self._restore: List[Callable[[], None]] = []
        self._hooked: Dict[object, torch.Tensor] = {}  # single-pass: parameters given hooks
        self._warned: set = set()  # (module, argument type): warnings said once
        self._module_notes: List[Tuple[str, Dict[str, str]]] = []
        self._graphs = GraphRecorder(backend)
        self._capture_side: Optional[str] = None  # capture(): the one side this dump holds
        self._devices: Dict[str, str] = {}  # provenance: device and dtype of the model
        # module -> (graph breaks, their reasons), from the module's first compilation
        self._graph_breaks: Dict[str, Tuple[int, List[str]]] = {}
        self._recorded_loss = None  # record_loss(): the loss of the step being checked

    # ------------------------------------------------------------------ wrap / ignore
    def wrap(self, module: nn.Module, name: Optional[str] = None) -> nn.Module:
        """Marks a module for compilation and comparison (the root model too).

        ``name`` is accepted for compatibility with the original tool and not used: reports name
        modules by their path in the model given to install()/compare(), so that every process
        and every dump agrees on them.
        """
        if not any(m is module for m in self._wrapped):
            self._wrapped.append(module)
        return module

    def wrap_by_policy(self, model: nn.Module, module_types) -> nn.Module:
        """Marks every submodule of the given types (a class or a tuple of classes), like FSDP's
        ModuleWrapPolicy."""
        module_types = _options.expect_module_types("module_types", module_types)
        for _, module in model.named_modules():
            if isinstance(module, module_types):
                self.wrap(module)
        return model

    def wrap_all_children(self, model: nn.Module, depth: int = 1) -> nn.Module:
        """Marks submodules ``depth`` levels below the direct children (depth=0: the direct
        children). Containers (ModuleList, ModuleDict, Sequential) are looked through without
        using up depth; modules without children are marked where the recursion reaches them."""
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
        if not any(m is module for m in self._ignored):
            self._ignored.append(module)
        return module

    def ignore_by_policy(self, model: nn.Module, module_types) -> nn.Module:
        """Ignores every submodule of the given types (a class or a tuple of classes)."""
        module_types = _options.expect_module_types("module_types", module_types)
        for _, module in model.named_modules():
            if isinstance(module, module_types):
                self.ignore(module)
        return model

    # ------------------------------------------------------------------ plan
    def _describe_model(self, model: nn.Module) -> None:
        """Provenance of the model: where it runs and in which dtypes (cross-machine reports)."""
        params = list(model.parameters())
        devices = sorted({str(p.device) for p in params}) or ["cpu"]
        described = []
        for device in devices:
            if device.startswith("cuda") and torch.cuda.is_available():
                described.append(f"{device} ({torch.cuda.get_device_name(torch.device(device))})")
            else:
                described.append(device)
        self._devices = {
            "device": ", ".join(described),
            "param_dtypes": ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in params})),
        }

    def _plan(self, model: nn.Module):
        """The compile targets (outermost wrapped modules, not ignored), in model order, and the
        /modules entries describing every wrapped or ignored module."""
        names = {}
        for name, module in model.named_modules():
            names.setdefault(id(module), name)
        root_name = type(model).__name__

        def display(name: str) -> str:
            return name if name else root_name

        wrapped = sorted((names[id(m)] for m in self._wrapped if id(m) in names),
                         key=lambda n: list(names.values()).index(n))
        ignored = [names[id(m)] for m in self._ignored if id(m) in names]
        unknown = [m for m in self._wrapped if id(m) not in names]
        if unknown:
            raise ValueError(f"{len(unknown)} wrapped module(s) are not part of the model passed "
                             f"to install()/compare(): wrap modules of this model")
        if not wrapped:
            raise ValueError("no module is wrapped: call wrap(), wrap_by_policy() or "
                             "wrap_all_children() before install() or compare()")
        self._describe_model(model)
        _options.expect_autocast(self.cast_dtype, autocast_device_type(devices_of([], model)))
        targets, entries = [], []
        for name in wrapped:
            outer = next((w for w in wrapped if w != name and _under(name, w)), None)
            ignored_by = next((i for i in ignored if i == name or _under(name, i)), None)
            if ignored_by is not None:
                continue
            if outer is not None:
                entries.append((display(name), {"role": "wrapped", "note": "SKIP_inside_compiled",
                                                "reason": f"inside {display(outer)}, which is "
                                                          "compiled as a whole"}))
                continue
            targets.append(name)
            entries.append((display(name), {"role": "wrapped"}))
        for name in ignored:
            entries.append((display(name), {"role": "ignored"}))
        order = list(names.values())
        entries.sort(key=lambda e: order.index(e[0]) if e[0] in order else -1)
        return [(display(n), n) for n in targets], entries

    # ------------------------------------------------------------------ dump
    def _provenance(self, mode: str) -> Dict[str, str]:
        rank, world = _rank_and_world()
        backend = self.backend if isinstance(self.backend, str) else getattr(
            self.backend, "__name__", type(self.backend).__name__)
        return {
            "producer": "dynaprobe.PrecisionChecker",
            "torch_version": torch.__version__,
            "backend": backend,
            "mode": mode,
            "rank": str(rank),
            "world_size": str(world),
            "scenario": self.scenario,
            "atol": repr(float(self.threshold)),
            "rtol": repr(float(self.rtol)),
            "cast_dtype": str(self.cast_dtype) if self.cast_dtype is not None else "None",
            "capture_input": "true" if self.capture_input else "false",
            **self._devices,
            "host": socket.gethostname(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }

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
            rank, world = _rank_and_world()
            if self._dump_dir is not None:
                if world > 1:
                    self._dump_dir = os.path.join(self._dump_dir, f"rank{rank}")
            else:
                stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
                run = f"{stamp}-{os.getpid()}-{next(_checker_numbers)}"
                if world > 1:  # rank 0's name for all: one run folder, rank<R>/ in it
                    names = [run]
                    torch.distributed.broadcast_object_list(names, src=0)
                    run = names[0]
                self._dump_dir = os.path.join("dynaprobe_runs", run, f"rank{rank}")
            self._dump_dir_resolved = True
        return self._dump_dir

    @property
    def run_dir(self) -> str:
        """The run folder: the folder above ``dump_dir`` when that is ``rank<R>`` (the default,
        and every multi-rank run), else ``dump_dir``. ``dynaprobe compare RUN_DIR --merged-csv
        PATH`` reports every rank of it."""
        parent, leaf = os.path.split(os.path.normpath(self.dump_dir))
        return parent if leaf == f"rank{_rank_and_world()[0]}" else self.dump_dir

    def _begin_step(self, targets: List[_Target]) -> _Step:
        if self._recorder is None:
            mode = ("single_pass" if self.single_pass else "two_pass") if self._capture_side is None \
                else f"{self._capture_side}_only"
            self._recorder = _C.Recorder(self.dump_dir, self._provenance(mode),
                                         memory_budget_bytes=self.memory_budget_bytes)
        self._recorder.begin_step(self._step_index)
        for target in targets:
            target.calls = 0
        self._step = _Step(self, self._step_index)
        return self._step

    def _current_step(self) -> _Step:
        """Single-pass: the step being checked, begun by the first wrapped call after install()
        or collect()."""
        return self._step if self._step is not None else self._begin_step(self._targets)

    def _finish_step(self, compare: bool = True):
        step = self._step
        graphs = self._graphs.take()
        for graph in graphs:
            self._recorder.record_graph(graph.name, graph.kind, graph.text,
                                        {"function": graph.function, "module": graph.module})
        if self.dump_graphs and graphs:
            write_graph_files(graphs, self.graph_dir)
        for name, attributes in self._module_notes:
            attributes = dict(attributes, **step.attributes.get(name, {}))
            if name in step.notes and "note" not in attributes:
                attributes["note"], attributes["reason"] = step.notes[name]
            self._recorder.record_module(name, attributes)
        path = self._recorder.end_step()  # raises a background write error (disk full, ...)
        self._step = None
        self._step_index += 1
        if step.error is not None:
            raise step.error
        if not compare:
            return path
        comparison = _C.compare(self.dump_dir, self.dump_dir, step=step.index)
        return CompareResult.from_report(comparison.steps[0], self.dump_dir, path, comparison)

    def _record_targets_summary(self, step: _Step, targets: List[_Target]) -> None:
        """Per-step facts about each compiled module: whether it ran, what Dynamo compiled it
        into, its graph breaks. A module that ran without Dynamo compiling anything for it was
        compared eager against eager: a warning, never a pass."""
        for target in targets:
            functions = self._graphs.functions.get(target.name, [])
            breaks, reasons = self._graph_breaks.get(target.name, (0, []))
            step.attributes.setdefault(target.name, {}).update({
                "calls": str(target.calls),
                "compiled_functions": ",".join(functions),
                "graph_breaks": str(breaks),
            })
            if reasons:
                step.attributes[target.name]["graph_break_reasons"] = "; ".join(reasons)
            failures = self._graphs.failures.get(target.name, [])
            if failures:
                step.attributes[target.name]["compile_errors"] = "; ".join(failures)
            if target.calls == 0:
                step.note(target.name, "NOT_RUN", "the wrapped module was not called in this step")
            elif not functions:
                reason = "Dynamo compiled no graph for it (frame skipped, fallback to eager after " \
                         "an error, or no tensor operations): eager was compared with eager"
                if failures:
                    reason += "; " + "; ".join(failures)
                if reasons:
                    reason += "; Dynamo reported: " + "; ".join(reasons)
                step.note(target.name, "NOT_COMPILED", reason)

    def _record_param_grads(self, step: _Step, pairs) -> None:
        """pairs: (target name, [(param name, eager param, compiled param)])."""
        for name, params in pairs:
            for index, (param_name, eager_param, compiled_param) in enumerate(params):
                shard = step.shards.get(id(compiled_param))
                label = param_name if shard is None else (
                    f"{param_name} ({shard.describe()}, this rank's batch, before "
                    f"reduce-scatter)")
                for side, param in (("eager", eager_param), ("compiled", compiled_param)):
                    grad = None if param is None else step.param_grads[side].get(id(param))
                    if grad is not None:
                        step.record(name, 0, "param_grad", index, side, grad, label)

    # ------------------------------------------------------------------ single-pass
    def install(self, model: nn.Module) -> nn.Module:
        """Single-pass: compiles the wrapped modules of ``model`` in place and starts checking.

        Every call of a wrapped module then runs compiled (the training path) and is re-run
        eagerly on the same inputs for comparison. Call ``collect(loss)`` after each checked
        step, and ``uninstall()`` to restore the model.
        """
        if not self.single_pass:
            if _is_deepcopy_forbidden(model):
                raise RuntimeError(
                    "install() only supports single_pass=True, and two-pass (single_pass=False) "
                    "deep-copies the model, which FSDP2/DTensor-sharded models forbid: use "
                    "PrecisionChecker(single_pass=True) with install(model) and collect(loss)")
            raise RuntimeError("install() only supports single_pass=True; for two-pass use "
                               "compare(run_step, model)")
        if self._installed is not None:
            raise RuntimeError("this checker is already installed on a model; call uninstall() "
                               "first")
        targets, self._module_notes = self._plan(model)
        self.dump_dir  # noqa: B018 - several ranks agree on their run folder now, all together
        self._installed = model
        modules = dict(model.named_modules())
        for display, name in targets:
            module = modules[name]
            original = module.forward
            target = _Target(display, module, self._compile(display, original), original)
            self._targets.append(target)
            self._patch_forward(module, self._single_pass_forward(target))
            self._warn_nested_fully_shard(display, module)
        return model

    def _warn_nested_fully_shard(self, name: str, module: nn.Module) -> None:
        """A wrapped module holding fully_shard units below it: their parameters are still
        sharded when it is called (each unit gathers its own inside), so their gradients are not
        compared; its eager re-run gathers them again, on every rank alike."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - torch without distributed
            return
        nested = [n for n, m in module.named_modules() if n and isinstance(m, FSDPModule)]
        if not nested:
            return
        for entry, attributes in self._module_notes:
            if entry == name:
                attributes["nested_fully_shard"] = ", ".join(nested)
        warnings.warn(
            f"dynaprobe: wrapped module {name} contains fully_shard units ({', '.join(nested)}): "
            "the gradients of their parameters are not compared (they are sharded when it is "
            "called); wrap the fully_shard units themselves to compare them", stacklevel=3)

    def _compile(self, name: str, forward: Callable) -> Callable:
        """torch.compile of a wrapped module's forward, through the graph recorder, counting the
        graph breaks Dynamo meets while compiling it."""
        compiled = torch.compile(_own_entry(forward, name), backend=self._graphs.for_module(name))
        counters = torch._dynamo.utils.counters

        # Dynamo counts explicit graph breaks under "graph_break" and what it cannot trace
        # (data-dependent control flow, ...) under "unimplemented"; both name the reason. A break
        # is counted in every frame it splits, so the number of breaks comes from the graphs the
        # first compilation produced: n graphs, n - 1 breaks.
        kinds = ("graph_break", "unimplemented")

        def run(*args, **kwargs):
            first = name not in self._graph_breaks
            before = {kind: dict(counters[kind]) for kind in kinds}
            graphs_before = len(self._graphs.functions.get(name, []))
            try:
                return compiled(*args, **kwargs)
            finally:
                if first:
                    reasons = set()
                    for kind in kinds:
                        for reason, count in counters[kind].items():
                            if count > before[kind].get(reason, 0):
                                # Dynamo's reasons run to several lines (explanation, hint,
                                # link): the first says what broke the graph.
                                reasons.add((reason.strip().splitlines() or ["?"])[0].strip())
                    graphs = len(self._graphs.functions.get(name, [])) - graphs_before
                    self._graph_breaks[name] = (max(graphs - 1, 0), sorted(reasons))

        return run

    def uninstall(self) -> None:
        """Restores the wrapped modules' original forwards and removes every hook."""
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()
        self._hooked.clear()
        self._targets.clear()
        self._installed = None
        self._recorded_loss = None
        if self._step is not None:  # a step begun but never collected is discarded
            self._step = None
            self._recorder = None

    def _patch_forward(self, module: nn.Module, forward: Callable) -> None:
        had_own = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        # Dynamo must not trace dynaprobe's own code when a caller compiles around it; the
        # compiled function inside still compiles (recursive=False).
        module.forward = torch._dynamo.disable(forward, recursive=False)

        def undo() -> None:
            if had_own:
                module.forward = previous
            else:
                del module.forward

        self._restore.append(undo)

    def _call_params(self, step: _Step, target: _Target) -> list:
        """The parameters a call of ``target`` uses, with the hooks that sum their training
        gradients. They are looked up at each call: FSDP2 registers the full (unsharded)
        parameters on the module for the forward, in place of the DTensor shards."""
        params = [(n, p) for n, p in target.module.named_parameters() if p.requires_grad]
        target.params = params
        for param_name, param in params:
            shard = target.shards.get(param_name)
            if shard is not None:
                step.shards[id(param)] = shard
            if id(param) not in self._hooked:  # once per parameter, even if shared by targets
                self._hooked[id(param)] = param
                self._restore.append(param.register_hook(self._param_hook(param)).remove)
            if (id(target), id(param)) not in self._hooked:
                self._hooked[(id(target), id(param))] = param
                self._restore.append(param.register_post_accumulate_grad_hook(
                    self._accumulated_hook(target)).remove)
        return params

    def _param_hook(self, param: torch.Tensor):
        def hook(grad: torch.Tensor) -> None:
            if self._step is not None and not _in_eager_backward():
                self._step.add_param_grad("compiled", param, grad)

        return hook

    def _accumulated_hook(self, target: _Target):
        def hook(_: torch.Tensor) -> None:
            # The training backward has passed this module: grad_output is known.
            if self._step is not None:
                for pending in self._step.pending:
                    if pending.target is target:
                        pending.run()

        return hook

    def _single_pass_forward(self, target: _Target) -> Callable:
        def forward(*args, **kwargs):
            return self._checked_call(self._current_step(), target, args, kwargs)

        return forward

    def _checked_call(self, step: _Step, target: _Target, args: tuple, kwargs: dict):
        call = target.calls
        target.calls += 1
        name = target.name
        inputs = input_leaves(args, kwargs)
        devices = devices_of([t for _, t in inputs], target.module)
        grad_mode = torch.is_grad_enabled()
        try:
            if self.capture_input:
                # Single-pass feeds both sides the same inputs: recorded once, for both.
                for index, (label, tensor) in enumerate(inputs):
                    step.record(name, call, "fwd_input", index, "compiled", tensor, label)
            # Copies taken before the training call, which may change its inputs (a cache it
            # appends to, a tensor modified in place) and its module's state.
            eager_args, eager_kwargs, shared = copy_arguments(
                args, kwargs, lambda i, t: t.detach().clone())
            if shared:
                self._warn_shared_arguments(step, name, shared)
            state_before = ModuleState(target.module, clone_buffers=True)
            rng_before = RngState(devices)
            params = self._call_params(step, target)
        except Exception as error:  # never break training because of the checker
            step.note(name, "HOOK_ERROR", f"{type(error).__name__}: {error}")
            return target.run(*args, **kwargs)

        if grad_mode:
            args, kwargs = map_tensors(args, kwargs, lambda index, tensor: _probe(
                tensor, self._compiled_grad_input_hook(step, target, call, index)))

        with autocast_context(self.cast_dtype, devices):
            compiled_out = target.run(*args, **kwargs)

        leaves = []
        state_after = ModuleState(target.module)
        rng_after = RngState(devices)
        names_after = ModuleGlobals(target.module)
        try:
            state_before.apply()
            rng_before.restore()

            def eager_input(index: int, tensor: torch.Tensor) -> torch.Tensor:
                original = inputs[index][1]
                if grad_mode and original.requires_grad and (tensor.is_floating_point()
                                                             or tensor.is_complex()):
                    tensor.requires_grad_(True)
                    leaves.append((index, tensor))
                return tensor

            eager_args, eager_kwargs = map_tensors(eager_args, eager_kwargs, eager_input)
            with torch.set_grad_enabled(grad_mode), autocast_context(self.cast_dtype, devices):
                eager_out = target.eager(*eager_args, **eager_kwargs)
        except Exception as error:
            step.note(name, "HOOK_ERROR", f"eager re-run failed: {type(error).__name__}: {error}")
            return compiled_out
        finally:
            state_after.apply()
            rng_after.restore()
            rebound = names_after.restore()
            if rebound:
                self._warn_once(
                    name, "globals", f"dynaprobe: {name}: its forward rebinds module-level names "
                    f"({', '.join(rebound)}): a global side effect. dynaprobe put back what the "
                    "eager re-run changed; other global effects (files, in-place changes to "
                    "module-level objects) it cannot undo.")

        compiled_leaves = tensor_leaves(compiled_out)
        eager_leaves = tensor_leaves(eager_out)
        for index, (label, tensor) in enumerate(compiled_leaves):
            step.record(name, call, "fwd_output", index, "compiled", tensor, label)
        for index, (label, tensor) in enumerate(eager_leaves):
            step.record(name, call, "fwd_output", index, "eager", tensor, label)

        if not grad_mode:
            return compiled_out
        eager_outputs = [(i, t) for i, (_, t) in enumerate(eager_leaves) if t.requires_grad]
        pending = _PendingBackward(step, target, call, eager_outputs, leaves, params)
        if eager_outputs:
            step.pending.append(pending)
        return map_output_tensors(compiled_out, lambda index, tensor: _probe(
            tensor, self._grad_output_hook(step, pending, index)))

    def _warn_shared_arguments(self, step: _Step, name: str, shared: List[str]) -> None:
        """An argument the eager re-run could not get a copy of: what it does to it, training
        sees. Said once per module and kind of argument, and kept in the dump."""
        step.attributes.setdefault(name, {})["shared_arguments"] = "; ".join(shared)
        for what in shared:
            self._warn_once(
                name, what, f"dynaprobe: {name}: an argument of type {what} cannot be "
                "deep-copied, so the eager re-run shares it with the training call: changes the "
                "re-run makes to it are visible to training. Make it copyable (copy.deepcopy) to "
                "isolate it.")

    def _warn_once(self, module: str, topic: str, message: str) -> None:
        if (module, topic) not in self._warned:
            self._warned.add((module, topic))
            warnings.warn(message, stacklevel=5)

    def _grad_output_hook(self, step: _Step, pending: _PendingBackward, index: int):
        def hook(grad: torch.Tensor) -> None:
            if grad is None:
                return
            pending.on_output_grad(index, grad)
            # Seeds both sides' backward: recorded once, for both.
            step.record(pending.target.name, pending.call, "grad_output", index, "compiled", grad)

        return hook

    def _compiled_grad_input_hook(self, step: _Step, target: _Target, call: int, index: int):
        def hook(grad: torch.Tensor) -> None:
            step.record(target.name, call, "grad_input", index, "compiled", grad)
            # The compiled backward of this call is done: every grad_output has arrived.
            for pending in step.pending:
                if pending.target is target and pending.call == call:
                    pending.run()

        return hook

    def record_loss(self, loss: Union[torch.Tensor, float]) -> None:
        """Single-pass: records the loss of the step being checked, for ``collect()`` called
        without one (msProbe's ``record_loss``). A loss given to ``collect(loss)`` wins. The
        loss belongs to that one step: the next step has none unless recorded again.

        Args:
            loss: the step's loss, a one-element tensor (kept detached; no device sync) or a
                number.
        """
        self._recorded_loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)

    def collect(self, loss: Optional[torch.Tensor] = None) -> CompareResult:
        """Single-pass: finishes the step that just ran, writes it and returns its comparison.

        Checking continues with the next step until ``uninstall()``.
        """
        if self._installed is None:
            raise RuntimeError("collect() needs install(model) first (single-pass), then a "
                               "training or inference step")
        step = self._current_step()
        for pending in step.pending:
            if not pending.done and pending.grads and pending.params_freed():
                step.note(pending.target.name, "HOOK_ERROR",
                          "eager backward not run: no gradient reached the module's inputs or "
                          "parameters during the backward, and FSDP2 has since freed the full "
                          "parameters it saved")
                continue
            pending.run()
        step.pending.clear()
        if loss is None:
            loss = self._recorded_loss
        self._recorded_loss = None
        if loss is not None:
            value = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            step.record(LOSS_MODULE, 0, "loss", 0, "compiled", value.reshape(()))
        self._record_targets_summary(step, self._targets)
        self._record_param_grads(step, [
            (t.name, [(n, p, p) for n, p in t.params]) for t in self._targets])
        return self._finish_step()

    # ------------------------------------------------------------------ compare
    def compare(self, fn: Callable[[nn.Module], torch.Tensor], model: nn.Module) -> CompareResult:
        """Runs ``fn(model)`` (one training or inference step returning a scalar) and compares.

        single_pass=True: installs on ``model``, runs the step once, collects, uninstalls.
        single_pass=False: runs the step on an eager and on a compiled deep copy of ``model``
        with the same RNG state; ``model`` itself is left untouched.
        """
        if self.single_pass:
            if self._installed is not None:
                raise RuntimeError("compare() cannot run while install() is active; call "
                                   "collect() instead, or uninstall() first")
            self.install(model)
            try:
                loss = fn(model)
                return self.collect(loss)
            finally:
                self.uninstall()
        return self._compare_two_pass(fn, model)

    def _compare_two_pass(self, fn: Callable, model: nn.Module) -> CompareResult:
        if _is_deepcopy_forbidden(model):
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
        step when ``side="compiled"``.
        """
        if side not in ("eager", "compiled"):
            raise ValueError(f"side must be 'eager' or 'compiled', not {side!r}")
        self._capture_side = side
        return self._run_sides(fn, model, [(side, model)], compare=False)

    def _run_sides(self, fn: Callable, model: nn.Module, sides: list, compare: bool = True):
        """Runs ``fn`` on each (side, model) in turn, from the same RNG state, recording the
        wrapped modules of each; compares them unless ``compare`` is False."""
        targets, self._module_notes = self._plan(model)
        by_side: Dict[str, List[_Target]] = {}
        for side, side_model in sides:
            modules = dict(side_model.named_modules())
            by_side[side] = []
            for display, name in targets:
                module = modules[name]
                original = module.forward
                run = original if side == "eager" else self._compile(display, original)
                target = _Target(display, module, run, None)
                by_side[side].append(target)
                self._patch_forward(module, self._one_side_forward(target, side))
                for _, param in target.params:
                    self._restore.append(param.register_hook(
                        self._side_param_hook(side, param)).remove)
        step = self._begin_step([t for ts in by_side.values() for t in ts])
        try:
            rng = RngState(devices_of([], model))
            for i, (side, side_model) in enumerate(sides):
                if i:
                    rng.restore()
                loss = fn(side_model)
                if loss is not None:
                    value = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(
                        float(loss))
                    step.record(LOSS_MODULE, 0, "loss", 0, side, value.reshape(()))
            if "compiled" in by_side:
                self._record_targets_summary(step, by_side["compiled"])
            first = next(iter(by_side.values()))
            self._record_param_grads(step, [
                (target.name, [(param_name,
                                *(by_side[s][i].params[j][1] if s in by_side else None
                                  for s in ("eager", "compiled")))
                               for j, (param_name, _) in enumerate(target.params)])
                for i, target in enumerate(first)])
            return self._finish_step(compare=compare)
        finally:
            for undo in reversed(self._restore):
                undo()
            self._restore.clear()
            self._step = None

    def _one_side_forward(self, target: _Target, side: str) -> Callable:
        def forward(*args, **kwargs):
            step = self._step
            if step is None:
                return target.run(*args, **kwargs)
            call = target.calls
            target.calls += 1
            inputs = input_leaves(args, kwargs)
            if self.capture_input:
                for index, (label, tensor) in enumerate(inputs):
                    step.record(target.name, call, "fwd_input", index, side, tensor, label)
            if torch.is_grad_enabled():
                args, kwargs = map_tensors(args, kwargs, lambda index, tensor: _probe(
                    tensor, self._side_grad_hook(step, target, call, "grad_input", index, side)))
            devices = devices_of([t for _, t in inputs], target.module)
            with autocast_context(self.cast_dtype, devices):
                out = target.run(*args, **kwargs)
            for index, (label, tensor) in enumerate(tensor_leaves(out)):
                step.record(target.name, call, "fwd_output", index, side, tensor, label)
            if not torch.is_grad_enabled():
                return out
            return map_output_tensors(out, lambda index, tensor: _probe(
                tensor, self._side_grad_hook(step, target, call, "grad_output", index, side)))

        return forward

    @staticmethod
    def _side_grad_hook(step: _Step, target: _Target, call: int, kind: str, index: int,
                        side: str):
        def hook(grad: Optional[torch.Tensor]) -> None:
            # An output the loss does not depend on (e.g. attention weights) gets no gradient:
            # autograd calls its hook with None.
            if grad is not None:
                step.record(target.name, call, kind, index, side, grad)

        return hook

    def _side_param_hook(self, side: str, param: torch.Tensor):
        def hook(grad: torch.Tensor) -> None:
            if self._step is not None:
                self._step.add_param_grad(side, param, grad)

        return hook

    # ------------------------------------------------------------------ report
    def report(self, result: CompareResult, csv_path: Optional[str] = None) -> None:
        """Prints the stdout report; with ``csv_path``, also writes the CSV report there."""
        print(result.text(), end="")
        if csv_path:
            directory = os.path.dirname(os.path.abspath(csv_path))
            os.makedirs(directory, exist_ok=True)
            with open(csv_path, "w", encoding="utf-8", newline="") as f:
                f.write(result.csv())
            print(f"CSV report saved to: {csv_path}")

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
        rank, world = _rank_and_world()
        mine = [result.merged_csv(rank) for result in results]
        gathered = _gather_to_rank0(mine, timeout) if world > 1 else [mine]
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
            os.makedirs(os.path.dirname(os.path.abspath(csv_path)), exist_ok=True)
            with open(csv_path, "w", encoding="utf-8", newline="") as f:
                f.write(text)
            print(f"Merged CSV report saved to: {csv_path}")
        return text
