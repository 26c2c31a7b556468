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

import copy
import itertools
import operator
import re
import threading
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from dynaprobe._C import vocabulary
from dynaprobe._mechanics.capture import RngState, _in_eager_backward
from dynaprobe._mechanics.graphs import GraphRecorder
from dynaprobe._mechanics.reference import (
    LOW_PRECISION,
    Judging,
    ReferencePolicy,
    ReferenceRun,
    call_precision,
    no_autocast,
    outputs_differ,
    shapes_differ,
    upcast,
)
from dynaprobe._steps.planning import Plan
from dynaprobe._steps.step import (
    PendingBackward,
    Step,
    Target,
    compiled_param_grad_hook,
    record_shared_param_grads,
    run_pending,
)
from dynaprobe._vocabulary import (
    COMPILED,
    EAGER,
    FWD_INPUT,
    FWD_OUTPUT,
    GRAD_INPUT,
    GRAD_OUTPUT,
    REFERENCE,
)

# torch._dynamo's comptime, imported by the first whole-model install (_load_comptime):
# `import dynaprobe` imports no Dynamo, which doubles its import time, for offline analysis.
_comptime = None


def _load_comptime():
    """comptime, or None for a torch without it (outputs then keep graph order)."""
    global _comptime
    if _comptime is None:
        try:
            from torch._dynamo.comptime import comptime
        except ImportError:
            return None
        _comptime = comptime
    return _comptime

# node.meta key: [(id(module), tensor_leaves index, key path, tensors returned)] for each wrapped
# module call that returned the node's value.
_RETURNED = "dynaprobe_returned"


def _tag_outputs(ctx) -> None:
    """Runs inside Dynamo as it traces a wrapped module's forward hook (``comptime``): tags the
    graph nodes the call returns with their ``tensor_leaves`` index and key path. Adds nothing to
    the graph. A returned value Dynamo does not hold as proxies (a dataclass) is not tagged: its
    outputs keep graph order. Must be a module-level function (comptime takes no closures)."""
    try:
        module = ctx.get_local("module")._i_will_not_complain_if_bc_breaks_VariableTracker().value
        returned = ctx.get_local("output").as_proxy()
    except Exception:
        return
    leaves = []

    def walk(item, label: str) -> None:  # as _capture._map_nested walks a returned value
        if isinstance(item, fx.Proxy):
            if isinstance(item.node.meta.get("example_value"), torch.Tensor):
                leaves.append((label, item.node))
        elif isinstance(item, dict):
            for key, sub in item.items():
                walk(sub, f"{label}[{key!r}]")
        elif isinstance(item, (list, tuple)):
            for i, sub in enumerate(item):
                walk(sub, f"{label}[{i}]")

    walk(returned, "")
    for index, (label, node) in enumerate(leaves):
        node.meta.setdefault(_RETURNED, []).append((id(module), index, label, len(leaves)))


def _mark_outputs(module: nn.Module, args, output) -> None:
    """Forward hook of each wrapped module: nothing when it runs (outside Dynamo), ``_tag_outputs``
    while Dynamo traces it."""
    _comptime(_tag_outputs)


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


_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]|\.([A-Za-z_]\w*)")


def _relative_name(source: str) -> Optional[str]:
    """``L['self']._modules['fc']._parameters['weight']`` -> ``fc.weight``; None for a source
    that is not an attribute path below a local."""
    match = re.match(r"L\['[^']*'\]", source)
    if not match:
        return None
    rest, parts, position = source[match.end():], [], 0
    for part in _SOURCE_PART.finditer(rest):
        if part.start() != position:
            return None
        parts.append(part.group(1) or part.group(2))
        position = part.end()
    return ".".join(parts) if position == len(rest) and parts else None


def _is_tensor_node(node: fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), torch.Tensor)


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.imatmul}


def _mutated(node: fx.Node) -> Optional[fx.Node]:
    """The value ``node`` changes in place (``x += y``, ``x.add_(y)``, ``torch.relu_(x)``,
    ``inplace=True``), if any."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return node.args[0]
        name = getattr(node.target, "__name__", "")
    else:
        return None
    inplace = name.endswith("_") and not name.startswith("_") or node.kwargs.get("inplace") is True
    return node.args[0] if inplace else None


class _Call:
    """One call of a wrapped module inside a captured graph: where its boundary values come from
    at run time (``("arg", i)``: the graph's i-th input; ``("out", i)``: its i-th output), its
    eager graph, and its taps."""

    def __init__(self, target: Target, partial: bool):
        self.target = target
        self.partial = partial  # in a frame Dynamo started at or inside it: a graph break
        self.tapped_inputs = 0
        self.function = ""  # Dynamo's __compiled_fn_<n> holding it
        self.root: Optional[Tuple[int, str]] = None  # partial: (graph input, its name) telling
        self.inputs: List[Tuple[str, int]] = []
        self.input_labels: List[str] = []
        self.outputs: List[Tuple[str, int]] = []
        self.output_labels: List[str] = []  # the outputs' graph nodes
        # Per output: its index and label in the rows, as the other modes give them.
        self.output_indices: List[int] = []
        self.output_paths: List[str] = []
        self.params: List[int] = []  # graph inputs holding its parameters and buffers
        self.buffers: List[bool] = []  # per params entry: a buffer (cloned for the eager run)
        self.eager: Optional[fx.GraphModule] = None
        self.widened: Dict[torch.dtype, fx.GraphModule] = {}  # the eager graph per reference dtype
        self.unchecked = ""  # why this call cannot be compared, if it cannot
        # This step's calls waiting for gradients, each with the grad_input indices received.
        self.pending: List[Tuple[PendingBackward, set]] = []


def install(compiled, model_plan: Plan, session, compiler, **options) -> "WholeModel":
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
    captured hold of each target. ``session`` (a ``_session.StepSession``) gives the step being
    checked (``current``) and the step begun, if any (``step``)."""

    def __init__(self, optimized, targets: List[Target], model_name: str, graphs: GraphRecorder,
                 session, capture_input: bool,
                 reference: ReferencePolicy = ReferencePolicy(None),
                 tolerances: Judging = Judging()):
        self.optimized = optimized
        self.reference = reference  # which calls get a reference, in which dtype
        self.tolerances = tolerances  # what "failing" means
        self.model: nn.Module = optimized._orig_mod
        self.targets = targets
        self.model_name = model_name
        self.graphs = graphs
        self.session = session
        self.capture_input = capture_input
        self.by_id = {str(id(t.module)): t for t in targets}
        self.paths = {id(m): n for n, m in self.model.named_modules(remove_duplicate=False)}
        self.tensor_names = {id(t): n for n, t in itertools.chain(
            self.model.named_parameters(remove_duplicate=False),
            self.model.named_buffers(remove_duplicate=False))}
        self.calls: List[_Call] = []
        self.functions: Dict[str, List[str]] = {}  # target -> compiled functions holding it
        # This step: target -> the graphs that ran a frame started at it (a graph break).
        self.pieces: Dict[str, set] = {}
        self.errors: List[str] = []  # graphs that could not be analysed (compiled as they are)
        self.tap_keys: List[int] = []
        self.restore: List[Callable[[], None]] = []
        self._hook_parameters()
        if _load_comptime() is not None:
            for target in targets:
                self.restore.append(target.module.register_forward_hook(_mark_outputs).remove)
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
            calls = self._find_calls(gm)
            for call, nodes in calls:
                self._boundary(gm, call, nodes, placeholders, flat)
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

    def _tensor_names(self) -> Dict[int, str]:
        """Model path of every parameter and buffer, looked up now: FSDP2 registers the unsharded
        parameters on the modules while they run."""
        return {id(t): n for n, t in itertools.chain(
            self.model.named_parameters(remove_duplicate=False),
            self.model.named_buffers(remove_duplicate=False))}

    def _target_at(self, path: str) -> Optional[Target]:
        """The target that is the module at ``path`` or holds it."""
        for target in self.targets:
            own = self.paths.get(id(target.module))
            if own is not None and (own == path or own == "" or path.startswith(own + ".")):
                return target
        return None

    def _frame_root(self, gm: fx.GraphModule):
        """The module whose forward this frame runs, as ``(model path, graph input index,
        relative name)`` of a parameter or buffer that tells; None when none tells."""
        names = self._tensor_names()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for position, node in enumerate(placeholders):
            grapharg = node.meta.get("grapharg")
            example = getattr(grapharg, "example", None) if grapharg is not None else None
            full = names.get(id(example)) if example is not None else None
            relative = _relative_name(grapharg.source.name) if full else None
            if relative is not None and (full == relative or full.endswith("." + relative)):
                return full[:len(full) - len(relative)].rstrip("."), position, relative
        return None

    def _find_calls(self, gm: fx.GraphModule):
        """The targets' calls in this graph, in graph order, each with its node set. In a frame
        Dynamo started at a target or inside one (a graph break), the nodes of no other target
        are that target's."""
        root = self._frame_root(gm)
        root_target = self._target_at(root[0]) if root is not None else None
        found: Dict[str, Tuple[_Call, set]] = {}
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            key = next((k for k in (node.meta.get("nn_module_stack") or {})
                        if k.split("@")[0] in self.by_id), None)
            if key is None and root_target is not None:
                key = f"{id(root_target.module)}@root"
            if key is None:
                continue
            if key not in found:
                target = self.by_id[key.split("@")[0]]
                partial = key.endswith("@root") and target.module is not self.model
                found[key] = (_Call(target, partial), set())
                if key.endswith("@root"):
                    found[key][0].root = root[1:]
            found[key][1].add(node)
        return list(found.values())

    def _found_in(self, target: Target, function: str) -> None:
        names = self.functions.setdefault(target.name, [])
        if function not in names:
            names.append(function)

    def _root_target(self, call: _Call, args: tuple) -> Optional[Target]:
        """The target a frame Dynamo started at a module runs for this time: Dynamo reuses a
        frame's graph for every module of the same class (their parameters are graph inputs), so
        the module is found from the parameter the graph received."""
        position, relative = call.root
        full = self._tensor_names().get(id(args[position]))
        if full is None or not (full == relative or full.endswith("." + relative)):
            return None
        return self._target_at(full[:len(full) - len(relative)].rstrip("."))

    def _boundary(self, gm: fx.GraphModule, call: _Call, nodes: set, placeholders: list,
                  flat: list) -> None:
        """Fills the call's boundary and eager graph; adds its boundary values to ``flat``, the
        graph's outputs."""
        inputs, params = [], []
        for node in gm.graph.nodes:
            if node not in nodes:
                continue
            for source in node.all_input_nodes:
                if source in nodes or source in inputs or source in params:
                    continue
                grapharg = source.meta.get("grapharg") if source.op == "placeholder" else None
                name = grapharg.source.name if grapharg is not None else ""
                if source.op == "get_attr" or "._parameters[" in name or "._buffers[" in name:
                    params.append(source)
                else:
                    inputs.append(source)
        outputs = [n for n in gm.graph.nodes if n in nodes
                   and any(user not in nodes for user in n.users)]
        # The values the module returned first, at their index in what it returned, then the
        # others in graph order.
        returned = {}
        for node in outputs:
            tag = next((t for t in node.meta.get(_RETURNED, ())
                        if t[0] == id(call.target.module)), None)
            if tag is not None and all(t[1] != tag[1] for t in returned.values()):
                returned[node] = tag
        tagged = sorted((n for n in outputs if n in returned), key=lambda n: returned[n][1])
        others = [n for n in outputs if n not in returned]
        outputs = tagged + others
        count = max((t[3] for t in returned.values()), default=0)
        strange = [n.name for n in inputs + outputs if not _is_tensor_node(n)]
        changed = sorted({_mutated(n).name for n in gm.graph.nodes
                          if _mutated(n) in inputs or _mutated(n) in outputs})
        if changed:
            # The value the graph returns is the one after the change: not what the call saw
            # or gave.
            call.unchecked = (f"the graph changes values crossing its boundary in place "
                              f"({', '.join(changed)})")
            return
        if strange:
            call.unchecked = (f"values crossing its boundary are not tensors "
                              f"({', '.join(strange)})")
            return
        if not outputs:
            call.unchecked = "no value it computes is used outside it in the graph"
            return

        def where(node: fx.Node) -> Tuple[str, int]:
            if node.op == "placeholder":
                return ("arg", placeholders.index(node))
            if node not in flat:
                flat.append(node)
            return ("out", flat.index(node))

        call.inputs = [where(n) for n in inputs]
        call.input_labels = [n.name for n in inputs]
        call.outputs = [where(n) for n in outputs]
        call.output_labels = [n.name for n in outputs]
        call.output_indices = ([returned[n][1] for n in tagged]
                               + [count + i for i in range(len(others))])
        call.output_paths = [returned[n][2] for n in tagged] + [n.name for n in others]
        call.params = [placeholders.index(n) for n in params if n.op == "placeholder"]
        call.buffers = ["._buffers[" in n.meta["grapharg"].source.name
                        for n in params if n.op == "placeholder"]

        graph = fx.Graph()
        env = {}
        for index, node in enumerate(inputs):
            env[node] = graph.placeholder(f"input_{index}")
        for index, node in enumerate(n for n in params if n.op == "placeholder"):
            env[node] = graph.placeholder(f"param_{index}")
        for node in params:
            if node.op == "get_attr":
                env[node] = graph.node_copy(node)
        for node in gm.graph.nodes:
            if node in nodes:
                env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[n] for n in outputs))
        call.eager = fx.GraphModule(gm, graph)

    def _tap_outputs(self, gm: fx.GraphModule, call: _Call, nodes: set) -> None:
        """A gradient tap on each output, between it and its uses outside the call (the graph's
        own outputs among them): grad_output, the gradient arriving from outside."""
        values = {n.name: n for n in gm.graph.nodes}
        for label, index in zip(call.output_labels, call.output_indices):
            node = values[label]
            if node.meta["example_value"].requires_grad:
                with gm.graph.inserting_after(node):
                    tap = self._tap(gm, node, call, GRAD_OUTPUT, index)
                node.replace_all_uses_with(tap, lambda user: user is not tap and user not in nodes)

    def _tap_inputs(self, gm: fx.GraphModule, call: _Call, nodes: set) -> None:
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
                    tap = self._tap(gm, node, call, GRAD_INPUT, index)
                node.replace_all_uses_with(tap, lambda user: user in nodes)

    def _tap(self, gm: fx.GraphModule, node: fx.Node, call: _Call, kind: str,
             index: int) -> fx.Node:
        with _TAP_LOCK:
            key = next(_TAP_KEYS)
            _TAPS[key] = self._receiver(call, kind, index)
        self.tap_keys.append(key)
        tap = gm.graph.call_function(_Tap.apply, (node, key))
        tap.meta.update(node.meta)
        return tap

    # ------------------------------------------------------------------ run time
    def _runner(self, compiled, calls: List[_Call], count: int, as_tuple: bool) -> Callable:

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
                            self._check(step, call, args, out)
                finally:
                    rng_after.restore()
            kept = out[:count]
            return tuple(kept) if as_tuple or isinstance(out, tuple) else list(kept)

        return run

    def _check(self, step: Step, call: _Call, args: tuple, out) -> None:
        """Records one call's boundary, runs its eager graph on the same inputs and prepares its
        eager backward."""
        target = call.target if call.root is None else self._root_target(call, args)
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
                step.record(target.name, index, FWD_INPUT, i, COMPILED, tensor, label)
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
        compiled_out = [value(source) for source in call.outputs]
        reference = self._reference(step, call, target, index, inputs, params, eager_out,
                                    compiled_out, grad_mode)
        for i, (at, label) in enumerate(zip(call.output_indices, call.output_paths)):
            step.record(target.name, index, FWD_OUTPUT, at, COMPILED, compiled_out[i], label)
            step.record(target.name, index, FWD_OUTPUT, at, EAGER, eager_out[i], label)
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

    def _reference(self, step: Step, call: _Call, target: Target, index: int, inputs: list,
                   params: list, eager_out, compiled_out: list,
                   grad_mode: bool) -> Optional[ReferenceRun]:
        """The call's eager graph evaluated in the reference dtype, autocast off, on the
        compiled side's inputs and the real parameters, upcast; records its outputs and returns
        what its backward needs. None without a reference (a failure is a NO_REFERENCE row)."""
        tensors = [t for t in inputs + params if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors}
        low = call_precision(step, target.name, tensors, None, None, devices)
        dtype = self.reference.dtype(low)
        if dtype is None and outputs_differ(list(eager_out), compiled_out,
                                            lambda out: [("", t) for t in out], target.name,
                                            self.tolerances):
            dtype = self.reference.dtype_if_failing(low)
        if dtype is None:
            return None
        try:
            leaves, wide_inputs = [], []
            for i, tensor in enumerate(inputs):
                wide = upcast(tensor.detach(), dtype).clone()
                if grad_mode and tensor.requires_grad and (wide.is_floating_point()
                                                           or wide.is_complex()):
                    wide.requires_grad_(True)
                    leaves.append((i, wide))
                wide_inputs.append(wide)
            wide_params, pairs = [], []
            for param in params:
                wide = upcast(param.detach(), dtype).clone()
                if grad_mode and isinstance(param, nn.Parameter) and param.requires_grad:
                    wide.requires_grad_(True)
                    pairs.append((param, wide))
                wide_params.append(wide)
            if dtype not in call.widened:
                call.widened[dtype] = _widened(call.eager, dtype)
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
            step.record(target.name, index, FWD_OUTPUT, at, REFERENCE, out[i], label)
        if not grad_mode:
            return None
        own = {id(p) for _, p in target.params}
        return ReferenceRun([(at, t) for at, t in zip(call.output_indices, out) if t.requires_grad],
                            leaves,
                            [(param, wide) for param, wide in pairs if id(param) in own])

    def _receiver(self, call: _Call, kind: str, index: int) -> Callable[[torch.Tensor], None]:
        """What a tap does with the gradient: records it for the latest call of this graph that
        has not received it yet (calls run backward in the reverse order of their forward)."""

        def receive(grad: torch.Tensor) -> None:
            step = self.session.step
            if step is None or _in_eager_backward():
                return
            for pending, inputs_seen in reversed(call.pending):
                if pending.step is not step:
                    continue
                if kind == GRAD_OUTPUT and index not in pending.grads:
                    pending.on_output_grad(index, grad.clone())
                    step.record(pending.target.name, pending.call, kind, index, COMPILED, grad)
                    return
                if kind == GRAD_INPUT and index not in inputs_seen:
                    inputs_seen.add(index)
                    step.record(pending.target.name, pending.call, kind, index, COMPILED, grad)
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


def _widened(eager: fx.GraphModule, dtype: torch.dtype) -> fx.GraphModule:
    """A copy of a call's eager graph computing in ``dtype``: Dynamo bakes the dtypes the model
    read (``x.to(hidden_states.dtype)``) into the graph as constants, which would narrow the
    reference back to bf16/fp16."""
    def widen(value):
        return dtype if isinstance(value, torch.dtype) and value in LOW_PRECISION else value

    graph = copy.deepcopy(eager.graph)
    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, widen)
        node.kwargs = fx.node.map_aggregate(node.kwargs, widen)
    return fx.GraphModule(eager, graph)
