"""Whole-model mode at compile time: the wrapped modules' calls inside a graph Dynamo captured
(``CallFinder``), each call's boundary and its eager graph (``fill_boundary``), as the module
docstring of ``whole_model.py`` describes."""

from __future__ import annotations

import copy
import itertools
import operator
import re
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from dynaprobe._mechanics.reference import LOW_PRECISION
from dynaprobe._steps.step import PendingBackward, Target

# torch._dynamo's comptime, imported by the first whole-model install (load_comptime):
# `import dynaprobe` imports no Dynamo, which doubles its import time, for offline analysis.
_comptime = None


def load_comptime():
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


def mark_outputs(module: nn.Module, args, output) -> None:
    """Forward hook of each wrapped module: nothing when it runs (outside Dynamo), ``_tag_outputs``
    while Dynamo traces it."""
    _comptime(_tag_outputs)


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


def _storage(node: fx.Node):
    """The storage of the value ``node`` computes, from Dynamo's example value; None if unknown."""
    value = node.meta.get("example_value")
    try:
        return StorageWeakRef(value.untyped_storage())
    except Exception:  # not a tensor, or a tensor without storage
        return None


def _sharing(gm: fx.GraphModule) -> Dict[StorageWeakRef, List[fx.Node]]:
    """The graph's values by the storage they compute into (views share their base's)."""
    sharing: Dict[StorageWeakRef, List[fx.Node]] = {}
    for node in gm.graph.nodes:
        storage = _storage(node)
        if storage is not None:
            sharing.setdefault(storage, []).append(node)
    return sharing


def copy_crossing_writes(gm: fx.GraphModule, calls: list) -> None:
    """A value written in place across a call's boundary (an input the module writes:
    ``ReLU(inplace=True)``, ``x.mul_(s)``, ``x += skip``; an output the code after the module
    writes) is written on a copy instead, made by the writer, and every later use of the value
    reads the copy. The graph computes the same values with one copy more; the values crossing
    the boundary stay as the call saw or gave them, their gradient taps stay views, and a call
    that writes its input writes a copy of its own in its eager graph too (not the leaf of its
    re-run). ``calls``: ``CallFinder.find_calls``'s, the copies added to the writer's node set.
    Not for a graph input (its caller sees the write) or a value others alias (they would not
    see it): ``fill_boundary`` leaves those calls unchecked."""
    region = {node: index for index, (_, nodes) in enumerate(calls) for node in nodes}
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    sharing = _sharing(gm)

    def aliased(written: fx.Node) -> bool:  # by values other than the results of its writes
        storage = _storage(written)
        return storage is None or any(other is not written and _mutated(other) is not written
                                      for other in sharing.get(storage, ()))

    for node in list(gm.graph.nodes):
        written = _mutated(node)
        if (written is None or region.get(written) == region.get(node)
                or written.op == "placeholder" or aliased(written)):
            continue
        try:
            example = written.meta["example_value"].clone()
        except Exception:  # no example value to give the copy: left as it is
            continue
        with gm.graph.inserting_before(node):
            copied = gm.graph.call_function(torch.clone, (written,))
        copied.meta.update(node.meta)  # its nn_module_stack: the writer's
        copied.meta["example_value"] = example
        if node in region:
            region[copied] = region[node]
            calls[region[node]][1].add(copied)
        for user in list(written.users):
            if user is not copied and order.get(user, -1) >= order[node]:
                user.replace_input_with(written, copied)
                if _mutated(user) is copied:  # a write's result is the value it wrote
                    user.meta["example_value"] = example


class CallInGraph:
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




class CallFinder:
    """Finds the calls of ``targets`` (modules of ``model``) in the graphs Dynamo captures."""

    def __init__(self, model: nn.Module, targets: List[Target]):
        self.model = model
        self.targets = targets
        self.by_id = {str(id(t.module)): t for t in targets}
        self.paths = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}

    def tensor_names(self) -> Dict[int, str]:
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
        names = self.tensor_names()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for position, node in enumerate(placeholders):
            grapharg = node.meta.get("grapharg")
            example = getattr(grapharg, "example", None) if grapharg is not None else None
            full = names.get(id(example)) if example is not None else None
            relative = _relative_name(grapharg.source.name) if full else None
            if relative is not None and (full == relative or full.endswith("." + relative)):
                return full[:len(full) - len(relative)].rstrip("."), position, relative
        return None

    def find_calls(self, gm: fx.GraphModule):
        """The targets' calls in this graph, in graph order, each with its node set. In a frame
        Dynamo started at a target or inside one (a graph break), the nodes of no other target
        are that target's."""
        root = self._frame_root(gm)
        root_target = self._target_at(root[0]) if root is not None else None
        found: Dict[str, Tuple[CallInGraph, set]] = {}
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
                found[key] = (CallInGraph(target, partial), set())
                if key.endswith("@root"):
                    found[key][0].root = root[1:]
            found[key][1].add(node)
        return list(found.values())

    def root_target(self, call: CallInGraph, args: tuple) -> Optional[Target]:
        """The target a frame Dynamo started at a module runs for this time: Dynamo reuses a
        frame's graph for every module of the same class (their parameters are graph inputs), so
        the module is found from the parameter the graph received."""
        position, relative = call.root
        full = self.tensor_names().get(id(args[position]))
        if full is None or not (full == relative or full.endswith("." + relative)):
            return None
        return self._target_at(full[:len(full) - len(relative)].rstrip("."))


def _written_across(gm: fx.GraphModule, nodes: set, inputs: list, outputs: list) -> List[str]:
    """The call's boundary values that copy_crossing_writes left written across its boundary,
    directly or through a view of theirs: an input once the call has begun, an output outside
    the call (an input its producer wrote before the call, and an output the call wrote before
    returning it, are the values the call saw and gave)."""
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    begins = min(order[node] for node in nodes)
    boundary = [(value, _storage(value), value in inputs) for value in inputs + outputs]
    changed = set()
    for node in gm.graph.nodes:
        written = _mutated(node)
        if written is None:
            continue
        storage = _storage(written)
        for value, own, is_input in boundary:
            same = written is value or storage is not None and own is not None and storage == own
            if same and (order[node] >= begins if is_input else node not in nodes):
                changed.add(value.name)
    return sorted(changed)


def fill_boundary(gm: fx.GraphModule, call: CallInGraph, nodes: set, placeholders: list,
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
    changed = _written_across(gm, nodes, inputs, outputs)
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



def widened(eager: fx.GraphModule, dtype: torch.dtype) -> fx.GraphModule:
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
