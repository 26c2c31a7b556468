"""Whole-model mode: the model compiled as the user compiles it (``torch.compile(model)``), checked
at the boundaries of its wrapped modules inside the graphs Dynamo captures.

``install(torch.compile(model, backend=B))`` puts a backend of dynaprobe's in place of ``B`` on
that compiled module. For every graph Dynamo captures, it

1. finds each wrapped module's calls in it: the nodes whose ``nn_module_stack`` holds the module
   (keyed by ``id(module)``, ``@n`` for its n-th call in the frame), or, in a frame Dynamo
   started at the module itself (a graph break split it), the frame's own nodes;
2. takes the call's boundary: the values it reads from outside (its inputs; parameters and
   buffers apart) and the values it defines that are used outside (its outputs), the outputs
   indexed as the other modes index the module's returned value (``tensor_leaves``: the n-th
   tensor it returns is ``fwd_output[n]``, labelled by its key path; read while Dynamo traces
   the call, ``_tag_outputs``), values used outside that it does not return after them;
3. copies the call's nodes into a graph of their own (inputs, then parameters and buffers, as
   placeholders), which is the module's eager forward for this traced path;
4. adds the boundary values to the graph's outputs and puts a gradient tap (``_Tap``: an identity
   in the forward, ``dynaprobe::grad_tap`` in the backward) on each boundary edge, then compiles
   the graph with ``B``.

At run time the compiled graph returns the model's outputs to the caller and the boundary values to
the checker, which records them as the compiled side, runs each call's eager graph on the same
(compiled) inputs and the real parameters, and, in the backward, receives through the taps the
gradient arriving at each output (grad_output) and leaving through each input (grad_input) of the
compiled backward; the eager graph's backward runs with that grad_output, as in single-pass.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._C.vocabulary import (
    KIND_FWD_INPUT,
    KIND_FWD_OUTPUT,
    KIND_GRAD_INPUT,
    KIND_GRAD_OUTPUT,
    SIDE_COMPILED,
    SIDE_EAGER,
    SIDE_REFERENCE,
)
from dynaprobe._mechanics.capture import RngState, _in_eager_backward, draws_its_own_random
from dynaprobe._mechanics.graphs import GraphRecorder
from dynaprobe._mechanics.reference import (
    ReferencePolicy,
    ReferenceRun,
    accelerator_draws,
    no_autocast,
    outputs_differ,
    shapes_differ,
    upcast_copy,
)
from dynaprobe._modes.graph_calls import (
    CallFinder,
    CallInGraph,
    copy_crossing_writes,
    fill_boundary,
    load_comptime,
    mark_outputs,
    widened,
)
from dynaprobe._steps.compiling import Compiler
from dynaprobe._steps.planning import Plan
from dynaprobe._steps.session import StepSession
from dynaprobe._steps.step import (
    PendingBackward,
    Step,
    Target,
    compiled_param_grad_hook,
    record_shared_param_grads,
    run_pending,
)

# grad_tap key -> the function receiving the gradient. Keys are never reused.
_TAPS: Dict[int, Callable[[torch.Tensor], None]] = {}
_TAP_KEYS = itertools.count()
_TAP_LOCK = threading.Lock()


@torch.library.custom_op("dynaprobe::grad_tap", mutates_args=())
def _grad_tap(grad: torch.Tensor, key: int) -> torch.Tensor:
    """The backward of ``_Tap``: hands the gradient to the checker and passes it on (a copy: an
    operator may not return its input). Opaque to the compilers, so it runs as it is."""
    receive = _TAPS.get(key)
    if receive is not None:
        receive(grad)
    return grad.clone()


@_grad_tap.register_fake
def _(grad: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(grad)


class _Tap(torch.autograd.Function):
    """Identity in the forward (a view: no copy, nothing for a compiler to fuse around), the
    gradient tap ``key`` in the backward."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, key: int) -> torch.Tensor:
        ctx.key = key
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return torch.ops.dynaprobe.grad_tap(grad, ctx.key), None


def install(compiled, model_plan: Plan, session: StepSession, compiler: Compiler,
            **options) -> "WholeModel":
    """install() of ``compiled``, a model the user compiled whole: the targets of
    ``model_plan`` checked inside the graphs ``compiler`` (the user's backend) compiles;
    ``options``: WholeModel's."""
    model = compiled._orig_mod
    modules = dict(model.named_modules())
    targets = [Target(display, modules[name], None, None) for display, name in model_plan.targets]
    return WholeModel(compiled, targets, type(model).__name__, compiler.graphs, session,
                      **options)


class WholeModel:
    """The installation on an ``OptimizedModule``: its backend replaced by ``_backend`` below,
    which compiles through ``graphs`` (the user's backend), the hooks, and what the graphs Dynamo
    captured hold of each target. ``session`` gives the step being checked (``current``) and the
    step begun, if any (``step``)."""

    def __init__(self, optimized, targets: List[Target], model_name: str, graphs: GraphRecorder,
                 session: StepSession, capture_input: bool,
                 reference: ReferencePolicy, tolerances: _C.Judging):
        self.optimized = optimized
        self.reference = reference  # which calls get a reference, in which dtype
        self.tolerances = tolerances  # what "failing" means
        self.model: nn.Module = optimized._orig_mod
        self.targets = targets
        self.model_name = model_name
        self.graphs = graphs
        self.session = session
        self.capture_input = capture_input
        self.finder = CallFinder(self.model, targets)
        self.tensor_names = self.finder.tensor_names()
        self.calls: List[CallInGraph] = []
        self.functions: Dict[str, List[str]] = {}  # target -> compiled functions holding it
        # This step: target -> the graphs that ran a frame started at it (a graph break).
        self.pieces: Dict[str, set] = {}
        self.errors: List[str] = []  # graphs that could not be analysed (compiled as they are)
        self.tap_keys: List[int] = []
        self.restore: List[Callable[[], None]] = []
        self._hook_parameters()
        if load_comptime() is not None:
            for target in targets:
                self.restore.append(target.module.register_forward_hook(mark_outputs).remove)
        self._swap_backend()

    # ------------------------------------------------------------------ install / remove
    def _swap_backend(self) -> None:
        optimized = self.optimized
        context = optimized.dynamo_ctx
        replacement = torch.compile(self.model, backend=self._backend,
                                    fullgraph=bool(getattr(context, "fullgraph", False)),
                                    dynamic=getattr(context, "_dynamic", None))
        optimized.dynamo_ctx = replacement.dynamo_ctx
        optimized._initialize()

        def undo() -> None:
            optimized.dynamo_ctx = context
            optimized._initialize()

        self.restore.append(undo)

    def _hook_parameters(self) -> None:
        """Training (compiled) gradients summed per parameter; the eager backwards run once the
        compiled backward has delivered a target's gradients (its parameters' are accumulated)."""
        hooked = set()
        for target in self.targets:
            for name, param in target.params:
                if name in target.shards:  # FSDP2: see _check
                    continue
                if id(param) not in hooked:
                    hooked.add(id(param))
                    self.restore.append(param.register_hook(
                        compiled_param_grad_hook(self.session, param)).remove)
                self.restore.append(param.register_post_accumulate_grad_hook(
                    lambda _, target=target: self._run_pending(target)).remove)

    def remove(self) -> None:
        for undo in reversed(self.restore):
            undo()
        self.restore.clear()
        with _TAP_LOCK:
            for key in self.tap_keys:
                _TAPS.pop(key, None)
        self.tap_keys.clear()

    def finish(self, step: Step) -> None:
        """Runs the eager backwards still pending before the step is written."""
        run_pending(step, "no gradient left the module through an input")
        for call in self.calls:
            call.pending.clear()

    def conclude(self, step: Step) -> None:
        """collect(), once the step has run: what it learned of each target and the summed
        parameter gradients (whole-model mode keeps no replay data: user-guide.md)."""
        self.summarize(step)
        record_shared_param_grads(step, self.targets)

    def summarize(self, step: Step) -> None:
        """Per-step facts about each target: calls, the compiled functions it was found in, the
        graph breaks splitting it, and a WARN note when it was not compared."""
        for target in self.targets:
            functions = self.functions.get(target.name, [])
            calls = [c for c in self.calls if c.target is target]
            pieces = len(self.pieces.pop(target.name, ()))
            attributes = step.attributes.setdefault(target.name, {})
            attributes.update({
                vocabulary.ATTRIBUTE_CALLS: str(target.calls),
                vocabulary.ATTRIBUTE_COMPILED_FUNCTIONS: ",".join(functions),
                vocabulary.ATTRIBUTE_GRAPH_BREAKS: str(max(pieces - 1, 0)),
            })
            unchecked = sorted({c.unchecked for c in calls if c.unchecked})
            if unchecked:
                step.note(target.name, vocabulary.NOTE_NOT_COMPILED,
                          "some calls were not compared: " + "; ".join(unchecked))
            elif pieces:
                attributes[vocabulary.ATTRIBUTE_GRAPH_BREAK_REASONS] = (
                    "Dynamo compiled its forward as a frame of its own (a graph break at its "
                    "call or inside it): each graph's part of it is compared as one call, and "
                    "no fusion crosses its boundary")
            if target.calls == 0 and not unchecked:
                step.note(target.name, vocabulary.NOTE_NOT_COMPILED,
                          "no operation of it was found in the graphs Dynamo captured in this "
                          "step: it was not called, or ran outside them (a graph break made "
                          "Dynamo skip the frame calling it, or it has no tensor operations); "
                          "it was not compared" + "".join(
                              f"; a graph could not be analysed: {e}" for e in self.errors))

    # ------------------------------------------------------------------ compile time
    def _backend(self, gm: fx.GraphModule, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        output_node = next(n for n in gm.graph.nodes if n.op == "output")
        original = output_node.args[0]
        as_tuple = isinstance(original, (tuple, list))
        flat = list(original) if as_tuple else [original]
        count = len(flat)
        try:  # reads the graph only: on failure it is compiled as it is, and the failure said
            calls = self.finder.find_calls(gm)
            copy_crossing_writes(gm, calls)
            for call, nodes in calls:
                fill_boundary(gm, call, nodes, placeholders, flat)
        except Exception as error:
            self.errors.append(f"{type(error).__name__}: {error}".splitlines()[0])
            warnings.warn(f"dynaprobe: a graph of the compiled model could not be analysed "
                          f"({self.errors[-1]}); its modules are not compared", stacklevel=2)
            return self.graphs.compile(self.model_name, gm, example_inputs)
        checked = [(call, nodes) for call, nodes in calls if not call.unchecked]
        # Inputs first: a block's input is often the previous block's output, whose tap then
        # comes before the input's (the gradient passes grad_input of the second block, then
        # arrives at the first's output together with any other use's).
        for call, nodes in checked:
            self._tap_inputs(gm, call, nodes)
        for call, nodes in checked:
            self._tap_outputs(gm, call, nodes)
        kept = output_node.args[0]
        kept = list(kept) if as_tuple else [kept]
        output_node.args = (tuple(kept + flat[count:]),)
        gm.graph.lint()
        gm.recompile()
        compiled = self.graphs.compile(self.model_name, gm, example_inputs)
        function = self.graphs.functions[self.model_name][-1]
        for call, _ in calls:
            call.function = function
            self._found_in(call.target, function)
        self.calls.extend(call for call, _ in calls)
        return self._runner(compiled, [call for call, _ in checked], count, as_tuple)

    def _found_in(self, target: Target, function: str) -> None:
        names = self.functions.setdefault(target.name, [])
        if function not in names:
            names.append(function)

    def _tap_outputs(self, gm: fx.GraphModule, call: CallInGraph, nodes: set) -> None:
        """A gradient tap on each output, between it and its uses outside the call (the graph's
        own outputs among them): grad_output, the gradient arriving from outside. Placed where
        the call ends: a view taken before the call's last write of the value would be a view
        whose base changed."""
        values = {n.name: n for n in gm.graph.nodes}
        end = next(n for n in reversed(gm.graph.nodes) if n in nodes)
        for label, index in zip(call.output_labels, call.output_indices):
            node = values[label]
            if node.meta["example_value"].requires_grad:
                with gm.graph.inserting_after(end):
                    tap = self._tap(gm, node, call, KIND_GRAD_OUTPUT, index)
                node.replace_all_uses_with(tap, lambda user: user is not tap and user not in nodes)

    def _tap_inputs(self, gm: fx.GraphModule, call: CallInGraph, nodes: set) -> None:
        """A gradient tap on each input, between it and its uses inside the call: grad_input,
        the gradient leaving the call through it."""
        values = {n.name: n for n in gm.graph.nodes}
        for index, label in enumerate(call.input_labels):
            node = values[label]
            if node.meta["example_value"].requires_grad:
                call.tapped_inputs += 1
                first_use = next(n for n in gm.graph.nodes
                                 if n in nodes and node in n.all_input_nodes)
                with gm.graph.inserting_before(first_use):
                    tap = self._tap(gm, node, call, KIND_GRAD_INPUT, index)
                node.replace_all_uses_with(tap, lambda user: user in nodes)

    def _tap(self, gm: fx.GraphModule, node: fx.Node, call: CallInGraph, kind: str,
             index: int) -> fx.Node:
        with _TAP_LOCK:
            key = next(_TAP_KEYS)
            _TAPS[key] = self._receiver(call, kind, index)
        self.tap_keys.append(key)
        tap = gm.graph.call_function(_Tap.apply, (node, key))
        tap.meta.update(node.meta)
        return tap

    # ------------------------------------------------------------------ run time
    def _runner(self, compiled, calls: List[CallInGraph], count: int, as_tuple: bool) -> Callable:

        def run(*args):
            step = self.session.current(self.targets) if calls else None
            if step is not None:
                devices = {a.device for a in args if isinstance(a, torch.Tensor)}
                rng_before = RngState(devices)
            out = compiled(*args)
            if step is not None:
                rng_after = RngState(devices)
                try:
                    for call in calls:
                        if not call.unchecked:
                            rng_before.restore()
                            self._check(step, call, args, out, rng_before)
                finally:
                    rng_after.restore()
            kept = out[:count]
            return tuple(kept) if as_tuple or isinstance(out, tuple) else list(kept)

        return run

    def _check(self, step: Step, call: CallInGraph, args: tuple, out, rng: RngState) -> None:
        """Records one call's boundary, runs its eager graph on the same inputs, from ``rng``
        (the RNG state the graph began with, restored), and prepares its eager backward."""
        target = call.target if call.root is None else self.finder.root_target(call, args)
        if target is None:  # the frame's graph, run for a module that is not wrapped
            return
        index = target.calls
        target.calls += 1
        if call.partial:
            self.pieces.setdefault(target.name, set()).add(id(call))
            self._found_in(target, call.function)

        def value(source: Tuple[str, int]) -> torch.Tensor:
            return args[source[1]] if source[0] == "arg" else out[source[1]]

        inputs = [value(s) for s in call.inputs]
        if self.capture_input:
            for i, (label, tensor) in enumerate(zip(call.input_labels, inputs)):
                step.record(target.name, index, KIND_FWD_INPUT, i, SIDE_COMPILED, tensor, label)
        grad_mode = torch.is_grad_enabled()
        leaves = []
        eager_inputs = []
        for i, tensor in enumerate(inputs):
            copy = tensor.detach().clone()
            if grad_mode and tensor.requires_grad:
                copy.requires_grad_(True)
                leaves.append((i, copy))
            eager_inputs.append(copy)
        params = [args[i].detach().clone() if buffer else args[i]
                  for i, buffer in zip(call.params, call.buffers)]
        try:
            with torch.set_grad_enabled(grad_mode):
                eager_out = call.eager(*eager_inputs, *params)
        except Exception as error:  # never break training because of the checker
            step.note(target.name, vocabulary.NOTE_HOOK_ERROR,
                      f"eager re-run failed: {type(error).__name__}: {error}")
            return
        if draws_its_own_random(self.graphs.backend):
            step.note_random_draws(target.name, rng.drawn_until(RngState(rng.devices)))
        compiled_out = [value(source) for source in call.outputs]
        reference = self._reference(step, call, target, index, inputs, params, eager_out,
                                    compiled_out, grad_mode, rng)
        for i, (at, label) in enumerate(zip(call.output_indices, call.output_paths)):
            step.record(target.name, index, KIND_FWD_OUTPUT, at, SIDE_COMPILED, compiled_out[i], label)
            step.record(target.name, index, KIND_FWD_OUTPUT, at, SIDE_EAGER, eager_out[i], label)
        if not grad_mode:
            return
        eager_outputs = [(at, t) for at, t in zip(call.output_indices, eager_out)
                         if t.requires_grad]
        # Parameter gradients are compared for the parameters the training hooks see: under FSDP2
        # the graph gets the unsharded parameters, whose gradients the eager backward gives
        # w.r.t. this rank's batch while training's are reduce-scattered: not compared.
        own = {id(p) for _, p in target.params}
        named = [(self.tensor_names.get(id(p), ""), p) for p in params
                 if isinstance(p, nn.Parameter) and p.requires_grad and id(p) in own]
        pending = PendingBackward(step, target, index, eager_outputs, leaves, named, reference)
        if eager_outputs:
            step.pending.append(pending)
            call.pending.append((pending, set()))

    def _reference(self, step: Step, call: CallInGraph, target: Target, index: int, inputs: list,
                   params: list, eager_out, compiled_out: list, grad_mode: bool,
                   rng: RngState) -> Optional[ReferenceRun]:
        """The call's eager graph evaluated in the reference dtype, autocast off, on the
        compiled side's inputs and the real parameters, upcast, from the RNG state ``rng`` the
        eager graph began with (its dropout masks are eager's); records its outputs and returns
        what its backward needs. None without a reference (a failure is a NO_REFERENCE row)."""
        tensors = [t for t in inputs + params if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors}
        decision = self.reference.for_call(step, target.name, tensors, None, None, devices)
        dtype = decision.dtype(lambda: outputs_differ(
            list(eager_out), compiled_out, lambda out: [("", t) for t in out], target.name,
            self.tolerances))
        if dtype is None:
            return None
        if rng.accelerator_drawn():
            step.reference_missing(target.name, accelerator_draws(dtype))
            return None
        rng.restore()
        try:
            wide_inputs = [upcast_copy(t, dtype, leaf=grad_mode and t.requires_grad)
                           for t in inputs]
            leaves = [(i, wide) for i, wide in enumerate(wide_inputs) if wide.requires_grad]
            wide_params = [upcast_copy(p, dtype, leaf=grad_mode and isinstance(p, nn.Parameter)
                                       and p.requires_grad) for p in params]
            pairs = [(param, wide) for param, wide in zip(params, wide_params)
                     if wide.requires_grad]
            if dtype not in call.widened:
                call.widened[dtype] = widened(call.eager, dtype)
            with no_autocast(devices), torch.set_grad_enabled(grad_mode):
                out = call.widened[dtype](*wide_inputs, *wide_params)
        except Exception as error:  # never break training because of the checker
            step.reference_missing(target.name, f"{type(error).__name__}: {error}")
            return None
        differ = shapes_differ(list(out), list(eager_out))
        if differ:
            step.reference_missing(target.name, differ)
            return None
        for i, (at, label) in enumerate(zip(call.output_indices, call.output_paths)):
            step.record(target.name, index, KIND_FWD_OUTPUT, at, SIDE_REFERENCE, out[i], label)
        if not grad_mode:
            return None
        own = {id(p) for _, p in target.params}
        return ReferenceRun([(at, t) for at, t in zip(call.output_indices, out) if t.requires_grad],
                            leaves,
                            [(param, wide) for param, wide in pairs if id(param) in own])

    def _receiver(self, call: CallInGraph, kind: str, index: int) -> Callable[[torch.Tensor], None]:
        """What a tap does with the gradient: records it for the latest call of this graph that
        has not received it yet (calls run backward in the reverse order of their forward)."""

        def receive(grad: torch.Tensor) -> None:
            step = self.session.step
            if step is None or _in_eager_backward():
                return
            for pending, inputs_seen in reversed(call.pending):
                if pending.step is not step:
                    continue
                if kind == KIND_GRAD_OUTPUT and index not in pending.grads:
                    pending.on_output_grad(index, grad.clone())
                    step.record(pending.target.name, pending.call, kind, index, SIDE_COMPILED, grad)
                    return
                if kind == KIND_GRAD_INPUT and index not in inputs_seen:
                    inputs_seen.add(index)
                    step.record(pending.target.name, pending.call, kind, index, SIDE_COMPILED, grad)
                    if len(inputs_seen) == call.tapped_inputs:
                        # The compiled backward has passed this call: every grad_output has
                        # arrived, and FSDP2 has not yet freed the parameters it gathered.
                        pending.run()
                    return

        return receive

    def _run_pending(self, target: Target) -> None:
        step = self.session.step
        if step is None:
            return
        for call in self.calls:
            for pending, _ in call.pending:
                if pending.target is target:
                    pending.run()
