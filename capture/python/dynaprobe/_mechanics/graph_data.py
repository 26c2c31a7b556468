"""Dynamo's captured graph as data: stored in a dump as JSON, rebuilt as an ``fx.GraphModule``
without running anything the dump carries, and written as Python source a person can read.

A dump is untrusted input. A graph is stored as its nodes (op, target, arguments, the source line
Dynamo recorded), never as code; its tensor constants are records. Rebuilding resolves every
function a node calls by name against an allowlist of what captured graphs call (torch's own
operators, ``torch.nn.functional``, ``operator``, ``math``, a few builtins) and calls tensor
methods by name only; a graph naming anything else is refused with the name it gave
(``UntrustedGraph``). The Python source written for a repro is generated here from the rebuilt
graph, by FX's code generator, not copied from the dump.
"""

from __future__ import annotations

import builtins
import math
import operator
import types
from typing import Any, Dict, List, Tuple

import torch
from torch import fx
from torch.fx.node import _get_qualified_name

FORMAT = 1


class UntrustedGraph(ValueError):
    """A stored graph names a function a replay from data does not call, or is malformed."""


class UnstorableGraph(ValueError):
    """A captured graph holds something that cannot be stored as data."""


# ---------------------------------------------------------------------- what a graph may call
_OPERATOR_DENIED = {"attrgetter", "methodcaller", "call"}
_BUILTINS = {"getattr", "len", "int", "float", "bool", "min", "max", "abs", "round", "range",
             "slice", "tuple", "list", "sum", "all", "any", "divmod", "pow"}
# Modules whose Python functions compute on tensors and nothing else.
_TORCH_PYTHON_MODULES = {"torch.nn.functional", "torch.functional", "torch._tensor",
                         "torch.amp.autocast_mode", "torch._refs", "torch._decomp.decompositions",
                         "torch.fft", "torch.linalg", "torch.special"}
# Python functions of the ``torch`` package itself that captured graphs call.
_TORCH_FUNCTIONS = {"sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite",
                    "sym_sum", "sym_sqrt", "_sym_sqrt", "_assert", "_check", "_check_is_size",
                    "_check_index", "_check_value", "_check_type", "typename", "is_tensor",
                    "is_storage", "broadcast_shapes"}
# Namespaces of torch's C++ bindings (ATen operators, grad mode and autocast switches).
_TORCH_C_NAMESPACES = {"torch._C._VariableFunctions", "torch._C._nn", "torch._C._fft",
                       "torch._C._linalg", "torch._C._special", "torch._C._nested"}
_TORCH_C_FUNCTIONS = {"_set_grad_enabled", "_get_tracing_state", "is_grad_enabled",
                      "_is_torch_function_enabled", "set_autocast_enabled",
                      "is_autocast_enabled", "_enter_autocast", "_exit_autocast",
                      "_functorch"}
_METHOD_DUNDERS = {"__getitem__", "__setitem__", "__add__", "__radd__", "__iadd__", "__sub__",
                   "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__", "__truediv__",
                   "__rtruediv__", "__itruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
                   "__rmod__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__neg__",
                   "__pos__", "__abs__", "__invert__", "__and__", "__rand__", "__or__",
                   "__ror__", "__xor__", "__rxor__", "__lshift__", "__rshift__", "__eq__",
                   "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__len__", "__bool__",
                   "__float__", "__int__", "__index__"}


def _allowed(target) -> bool:
    """Whether a graph rebuilt from data may call ``target``."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                           torch._ops.HigherOrderOperator)):
        return True
    if target in (operator.getitem, operator.setitem):
        return True
    module = getattr(target, "__module__", None)
    name = getattr(target, "__name__", "")
    if module in ("operator", "_operator"):
        return name not in _OPERATOR_DENIED
    if module == "math":
        return callable(target)
    if module == "builtins" and isinstance(target, types.BuiltinFunctionType) and getattr(
            target, "__self__", None) is builtins:
        return name in _BUILTINS
    if isinstance(target, types.BuiltinFunctionType):  # a C++ binding: torch.cat, linear
        if getattr(torch._C._VariableFunctions, name, None) is target:
            return True
        owner = getattr(target, "__self__", None)
        if owner is torch._C:
            return name in _TORCH_C_FUNCTIONS
        return isinstance(owner, types.ModuleType) and owner.__name__ in _TORCH_C_NAMESPACES
    if isinstance(target, (types.MethodDescriptorType, types.WrapperDescriptorType)):
        return getattr(target, "__objclass__", None) in (torch._C.TensorBase, torch.Tensor)
    if isinstance(target, types.FunctionType):
        if module in _TORCH_PYTHON_MODULES:
            return True
        return module == "torch" and name in _TORCH_FUNCTIONS
    return False


def _method_allowed(name: str) -> bool:
    """Whether a call_method node may call ``name`` (on a tensor, a shape, a number)."""
    if name.startswith("__"):
        return name in _METHOD_DUNDERS
    return not name.startswith("_") and hasattr(torch.Tensor, name) and name not in (
        "register_hook", "register_post_accumulate_grad_hook", "apply_", "map_", "map2_",
        "backward", "storage", "untyped_storage", "share_memory_", "pin_memory", "numpy",
        "tolist", "data_ptr")


def _target_name(target) -> str:
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"torch.ops.higher_order.{target._name}"
    return _get_qualified_name(target)


def _resolve(name: str):
    """The object a stored target name denotes, found without importing anything: walked from
    ``torch``, ``operator``, ``math`` or ``builtins``; UntrustedGraph unless ``_allowed``."""
    parts = name.split(".")
    roots = {"torch": torch, "operator": operator, "_operator": operator, "math": math,
             "builtins": builtins}
    if parts[0] in roots:
        value, rest = roots[parts[0]], parts[1:]
    else:
        value, rest = builtins, parts
    try:
        for part in rest:
            if part.startswith("__") or not part:
                raise AttributeError(part)
            value = getattr(value, part)
    except AttributeError:
        raise UntrustedGraph(f"the graph calls {name}, which this torch does not have") from None
    if not _allowed(value):
        raise UntrustedGraph(f"the graph calls {name}, which a replay from the dump's data does "
                             "not run (only torch operators, torch.nn.functional, operator, math "
                             "and a few builtins)")
    return value


# ---------------------------------------------------------------------- arguments
def _encode(value, constants: Dict[str, torch.Tensor]):
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.Size):
        return {"size": [_encode(v, constants) for v in value]}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, constants) for v in value]}
    if isinstance(value, list):
        return {"list": [_encode(v, constants) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, constants), _encode(v, constants)]
                         for k, v in value.items()]}
    if isinstance(value, slice):
        return {"slice": [_encode(v, constants) for v in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"ellipsis": True}
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).replace("torch.", "")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).replace("torch.", "")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).replace("torch.", "")}
    if isinstance(value, torch.Tensor):  # a tensor literal in an argument
        label = f"constant_{len(constants)}"
        constants[label] = value.detach()
        return {"tensor": label}
    raise UnstorableGraph(f"an argument of type {type(value).__qualname__}")


def _decode(value, nodes: Dict[str, fx.Node], constants: Dict[str, torch.Tensor]):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (tag, item), = value.items()
        if tag == "node":
            if item not in nodes:
                raise UntrustedGraph(f"an argument names node {item!r}, defined nowhere before")
            return nodes[item]
        if tag in ("tuple", "list", "size"):
            items = [_decode(v, nodes, constants) for v in item]
            return {"tuple": tuple, "list": list, "size": torch.Size}[tag](items)
        if tag == "dict":
            return {_decode(k, nodes, constants): _decode(v, nodes, constants) for k, v in item}
        if tag == "slice":
            return slice(*(_decode(v, nodes, constants) for v in item))
        if tag == "ellipsis":
            return Ellipsis
        if tag == "float" and item in ("inf", "-inf", "nan"):
            return float(item)
        if tag == "complex":
            return complex(*item)
        if tag in ("dtype", "memory_format", "layout"):
            found = getattr(torch, str(item), None)
            if not isinstance(found, (torch.dtype, torch.memory_format, torch.layout)):
                raise UntrustedGraph(f"{item!r} is not a torch {tag}")
            return found
        if tag == "device":
            return torch.device(str(item))
        if tag == "tensor":
            if item not in constants:
                raise UntrustedGraph(f"the graph's constant {item!r} is not stored")
            return constants[item]
    raise UntrustedGraph(f"an argument is not one a stored graph holds: {str(value)[:80]}")


# ---------------------------------------------------------------------- storing
def graph_to_data(gm: fx.GraphModule) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """The graph as JSON-able data and its tensors (constants, parameters and buffers it reads
    by attribute), by label. UnstorableGraph names what cannot be stored."""
    tensors: Dict[str, torch.Tensor] = {}
    return _graph_data(gm, "", tensors), tensors


def _graph_data(gm: fx.GraphModule, prefix: str, tensors: Dict[str, torch.Tensor]) -> dict:
    nodes, submodules, attributes = [], {}, {}
    for node in gm.graph.nodes:
        entry: Dict[str, Any] = {"op": node.op, "name": node.name}
        if node.op == "call_function":
            if not _allowed(node.target):
                raise UnstorableGraph(f"node {node.name} calls {node.target!r}, which a replay "
                                      "from data does not run")
            entry["target"] = _target_name(node.target)
        elif node.op in ("call_method", "placeholder"):
            entry["target"] = node.target
        elif node.op == "get_attr":
            entry["target"] = node.target
            value = _attribute(gm, node.target)
            if isinstance(value, fx.GraphModule):
                submodules[node.target] = _graph_data(value, f"{prefix}{node.target}.", tensors)
            elif isinstance(value, torch.Tensor):
                attributes[node.target] = f"{prefix}{node.target}"
                tensors[f"{prefix}{node.target}"] = value.detach()
            else:
                raise UnstorableGraph(f"node {node.name} reads {node.target}, a "
                                      f"{type(value).__qualname__}")
        elif node.op != "output":
            raise UnstorableGraph(f"node {node.name} is a {node.op} of {node.target}")
        constants: Dict[str, torch.Tensor] = {}
        entry["args"] = _encode(tuple(node.args), constants)
        entry["kwargs"] = _encode(dict(node.kwargs), constants)
        for label, tensor in constants.items():  # tensor literals in arguments
            tensors[f"{prefix}{node.name}.{label}"] = tensor
        if constants:
            entry["constants"] = {label: f"{prefix}{node.name}.{label}" for label in constants}
        trace = node.meta.get("stack_trace")
        if trace:
            entry["source"] = _last_frame(trace)
        nodes.append(entry)
    return {"format": FORMAT, "nodes": nodes, "submodules": submodules, "attributes": attributes}


def _attribute(gm: torch.nn.Module, path: str):
    value = gm
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _last_frame(trace: str) -> str:
    """The innermost frame of a stack trace Dynamo recorded: ``File "...", line N, in f`` and
    the code line."""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not frames:
        return lines[-1] if lines else ""
    return "\n".join(lines[frames[-1]:frames[-1] + 2])


# ---------------------------------------------------------------------- rebuilding
def graph_from_data(data: dict, tensors: Dict[str, torch.Tensor]) -> fx.GraphModule:
    """The GraphModule of stored graph data; UntrustedGraph for anything outside the allowlist
    or malformed. Nothing the data names is imported or executed beyond allowed calls."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UntrustedGraph(f"stored graph data of format {data.get('format') if isinstance(data, dict) else '?'}; this dynaprobe reads format {FORMAT}")
    root = torch.nn.Module()
    for path, sub in (data.get("submodules") or {}).items():
        _set_attribute(root, path, graph_from_data(sub, tensors))
    for path, label in (data.get("attributes") or {}).items():
        if label not in tensors:
            raise UntrustedGraph(f"the graph's attribute {path} is not stored")
        _set_attribute(root, path, tensors[label])
    graph = fx.Graph()
    nodes: Dict[str, fx.Node] = {}
    for entry in data.get("nodes") or []:
        op, name = entry.get("op"), entry.get("name")
        if not isinstance(name, str) or not name.isidentifier() or name in nodes:
            raise UntrustedGraph(f"a node is named {name!r}")
        constants = {label: tensors[stored] for label, stored in
                     (entry.get("constants") or {}).items() if stored in tensors}
        args = _decode(entry.get("args", {"tuple": []}), nodes, constants)
        kwargs = _decode(entry.get("kwargs", {"dict": []}), nodes, constants)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise UntrustedGraph(f"node {name}'s arguments are not a tuple and a dict")
        target = entry.get("target")
        if op == "placeholder":
            if not isinstance(target, str) or not target.isidentifier():
                raise UntrustedGraph(f"placeholder {name} is named {target!r}")
            node = graph.placeholder(target, default_value=args[0] if args else
                                     torch.fx.node.inspect.Signature.empty)
        elif op == "call_function":
            node = graph.call_function(_resolve(str(target)), args, kwargs)
        elif op == "call_method":
            if not isinstance(target, str) or not _method_allowed(target):
                raise UntrustedGraph(f"node {name} calls the method {target!r}, which a replay "
                                     "from the dump's data does not call")
            node = graph.call_method(target, args, kwargs)
        elif op == "get_attr":
            if not isinstance(target, str) or not all(
                    p.isidentifier() and not p.startswith("__") for p in target.split(".")):
                raise UntrustedGraph(f"node {name} reads attribute {target!r}")
            node = graph.get_attr(target)
        elif op == "output":
            node = graph.output(args[0] if args else None)
        else:
            raise UntrustedGraph(f"node {name} is of kind {op!r}")
        node.name = name
        if entry.get("source"):  # shown as a comment in the Python source: one printable line each
            node.meta["stack_trace"] = "\n".join(
                "".join(c for c in line if c.isprintable())
                for line in str(entry["source"]).split("\n")[:2])
        nodes[name] = node
    try:
        graph.lint()
        return fx.GraphModule(root, graph)
    except Exception as error:
        raise UntrustedGraph(f"the stored graph does not form a valid graph: {error}") from error


def _set_attribute(root: torch.nn.Module, path: str, value) -> None:
    parts = path.split(".")
    if not all(p.isidentifier() and not p.startswith("__") for p in parts):
        raise UntrustedGraph(f"the graph's attribute is named {path!r}")
    owner = root
    for part in parts[:-1]:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    if isinstance(value, torch.nn.Module):
        owner.add_module(parts[-1], value)
    else:
        owner.register_buffer(parts[-1], value)


# ---------------------------------------------------------------------- Python source
def python_source(gm: fx.GraphModule, class_name: str) -> str:
    """Readable, runnable Python for a rebuilt graph: a torch.nn.Module class per graph (the
    subgraphs of higher-order operators too), generated by FX from the graph; its tensor
    attributes come in a dict of tensors (``tensors``), by attribute path."""
    from torch.fx.graph_module import _format_import_block  # noqa: PLC0415 - FX's own
    from torch.package import sys_importer  # noqa: PLC0415

    classes: List[str] = []
    imports: Dict[str, Any] = {}

    def emit(module: fx.GraphModule, name: str, prefix: str) -> None:
        init = ["    def __init__(self, tensors=None):", "        super().__init__()"]
        for child_name, child in module.named_children():
            if isinstance(child, fx.GraphModule):
                child_class = f"{name}_{child_name}"
                emit(child, child_class, f"{prefix}{child_name}.")
                # a higher-order operator takes its body as a GraphModule
                init.append(f"        self.{child_name} = torch.fx.symbolic_trace("
                            f"{child_class}(tensors))")
        for leaf, _ in module.named_buffers(recurse=False):
            init.append(f"        self.register_buffer({leaf!r}, tensors[{prefix + leaf!r}])")
        code = module.graph.python_code(root_module="self", verbose=True)
        imports.update(code.globals)
        body = "\n".join("    " + line if line.strip() else ""
                         for line in code.src.strip("\n").split("\n"))
        classes.append(f"class {name}(torch.nn.Module):\n" + "\n".join(init) + "\n\n" + body
                       + "\n")

    emit(gm, class_name, "")
    header = _format_import_block(imports, sys_importer).strip()
    return header + "\n\n\n" + "\n\n".join(classes)
