"""What the dump keeps of a call so that it can be replayed (``PrecisionChecker(replay=...)``):
the call's inputs with their argument structure, the grad_output it received, the module's
parameters and buffers, the RNG state before the call, its class and, when it pickles, its
structure without weights. Tensors are records of kind ``replay`` (stored whole, never compared);
the rest is the module attribute ``replay`` (JSON). The layout is in docs/dump-format.md
(Replay records); ``_replay.py`` reads it back.
"""

from __future__ import annotations

import copy
import io
import json
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from dynaprobe._C import vocabulary

REPLAY_MODES = ("failing", "all", "none")
KIND = "replay"  # Keep in sync with formats::kind_name(Kind::kReplay).
# Labels of replay records: "<role>:<name>". Keep in sync with _replay.py.
INPUT, GRAD_OUTPUT, PARAM, BUFFER, RNG, STRUCTURE = (
    "input", "grad_output", "param", "buffer", "rng", "structure")
_JSON_LEAVES = (type(None), bool, int, float, str)


def expect_replay(value, single_pass: bool, dump: str) -> str:
    """The replay policy: ``"failing"`` (calls whose forward output fails the tolerances),
    ``"all"`` or ``"none"``; None picks ``"failing"``, except under dump="stats" (metrics only)
    and in two-pass (its sides run on inputs of their own), which keep nothing."""
    if value is None:
        return "failing" if single_pass and dump != "stats" else "none"
    if value not in REPLAY_MODES:
        raise ValueError(f"replay must be None or one of {', '.join(map(repr, REPLAY_MODES))}, "
                         f"but received {value!r}")
    if value != "none" and not single_pass:
        raise ValueError(f"replay={value!r} needs single_pass=True: a replay runs one call's "
                         "inputs through both sides, which only single-pass shares")
    return value


def class_path(obj) -> str:
    """``package.module.QualName`` of an object's class."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def backend_spec(backend) -> Dict[str, str]:
    """How a replay finds the backend again: ``{"name": ...}`` for a registered backend name,
    ``{"import": "module:attribute"}`` for a callable that a module holds under a global name,
    ``{"unknown": repr}`` otherwise (the repro script then asks for it)."""
    if isinstance(backend, str):
        return {"name": backend}
    module, name = getattr(backend, "__module__", None), getattr(backend, "__qualname__", None)
    if module and name and "<" not in name:
        owner = sys.modules.get(module)
        target = owner
        for part in name.split("."):
            target = getattr(target, part, None)
        if target is backend:
            return {"import": f"{module}:{name}"}
    # Objects without a qualified name (aot_autograd(...) backends): a module-level name for it.
    for module_name, owner in list(sys.modules.items()):
        space = getattr(owner, "__dict__", None)
        if not isinstance(space, dict) or module_name.startswith(("torch", "dynaprobe")):
            continue
        for attribute, value in list(space.items()):
            if value is backend and not attribute.startswith("_"):
                return {"import": f"{module_name}:{attribute}"}
    return {"unknown": repr(backend)[:200]}


def _structure_pickle(module: nn.Module) -> Optional[bytes]:
    """The module pickled with every parameter and buffer on the meta device (its structure and
    constructor-free state, no weights); None when it does not pickle (hooks holding closures,
    handles, ...). The instance ``forward`` dynaprobe installs is left out."""
    memo: dict = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else empty)
    try:
        twin = copy.deepcopy(module, memo)
        twin.__dict__.pop("forward", None)
        buffer = io.BytesIO()
        torch.save(twin, buffer)
        return buffer.getvalue()
    except Exception:  # not picklable: the replay rebuilds the class (docs/user-guide.md)
        return None


class CallRecord:
    """The replay records of one call: numbers the records it writes."""

    def __init__(self, step, module: str, call: int):
        self.step, self.module, self.call = step, module, call
        self.next_index = 0

    def add(self, label: str, tensor: torch.Tensor) -> None:
        self.step.record(self.module, self.call, KIND, self.next_index, "compiled", tensor, label)
        self.next_index += 1


def _describe_arguments(args: tuple, kwargs: dict, record: CallRecord,
                        requires_grad: List[bool]) -> dict:
    """The argument structure as JSON (a pytree spec and its leaves), its tensors recorded."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    described, tensor_index = [], 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            record.add(f"{INPUT}:{tensor_index}", leaf.detach())
            grad = requires_grad[tensor_index] if tensor_index < len(requires_grad) else False
            described.append({"tensor": tensor_index, "requires_grad": grad})
            tensor_index += 1
        elif isinstance(leaf, _JSON_LEAVES) and not (isinstance(leaf, float) and leaf != leaf):
            described.append({"value": leaf})
        elif isinstance(leaf, (torch.dtype, torch.device)):
            described.append({type(leaf).__name__: str(leaf)})
        else:
            described.append({"unsupported": class_path(leaf)})
    try:
        tree = pytree.treespec_dumps(spec)
    except Exception as error:  # a container pytree cannot serialise
        tree = None
        described.append({"unsupported": f"argument structure ({type(error).__name__}: {error})"})
    return {"tree": tree, "leaves": described}


def record_call(step, name: str, module: nn.Module, call: int, args: tuple, kwargs: dict,
                requires_grad: List[bool], buffers: Dict[str, torch.Tensor], rng_state,
                grad_mode: bool, cast_dtype, backend: Dict[str, str]) -> CallRecord:
    """Records what replaying call ``call`` of ``module`` needs; returns the call's records, to
    which the grad_output is added in the backward (``add_grad_output``).

    ``args``/``kwargs`` hold the call's inputs as they were before it, ``buffers`` the module's
    buffers before it (a forward may update them: batch norm statistics) and ``rng_state`` the
    RNG state before it (``_capture.RngState``). The parameters are the module's own (a forward
    does not change them).
    """
    record = CallRecord(step, name, call)
    description = _describe_arguments(args, kwargs, record, requires_grad)
    description.update({"grad_mode": grad_mode,
                        "cast_dtype": None if cast_dtype is None else str(cast_dtype)})
    for param_name, param in module.named_parameters():
        record.add(f"{PARAM}:{param_name}", param.detach())
    for buffer_name, buffer in buffers.items():
        record.add(f"{BUFFER}:{buffer_name}", buffer.detach())
    record.add(f"{RNG}:cpu", rng_state.cpu)
    for index, state in rng_state.cuda.items():
        record.add(f"{RNG}:cuda:{index}", state)
    attributes = step.attributes.setdefault(name, {})
    replay = json.loads(attributes.get(vocabulary.ATTRIBUTE_REPLAY) or "{}")
    if not replay:  # the module's first replayed call in this step: its class and structure
        structure = _structure_pickle(module)
        replay = {"class": class_path(module), "backend": backend, "calls": {},
                  "structure_call": None if structure is None else call}
        if structure is not None:
            record.add(f"{STRUCTURE}:pickle",
                       torch.frombuffer(bytearray(structure), dtype=torch.uint8))
    replay["calls"][str(call)] = description
    attributes[vocabulary.ATTRIBUTE_REPLAY] = json.dumps(replay, sort_keys=True)
    return record


def add_grad_output(record: CallRecord, index: int, grad: torch.Tensor) -> None:
    """The gradient the call's output ``index`` received (seeds a backward replay)."""
    record.add(f"{GRAD_OUTPUT}:{index}", grad.detach())


def split_label(label: str) -> Tuple[str, str]:
    role, _, name = label.partition(":")
    return role, name
