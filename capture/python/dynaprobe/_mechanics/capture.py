"""Capture mechanics shared by every mode: intercepting a wrapped module's calls (its ``forward``
replaced by an instance attribute; names, state_dict, parameters and other tools' hooks untouched),
the tensors in nested arguments and outputs, probing gradients at the module boundary, RNG state,
autocast and FSDP2 shards. The modes themselves live in single_pass.py and two_pass.py.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from typing import Any, Callable, List, Optional

import torch
from torch.utils import _pytree as pytree

from dynaprobe._mechanics.graph_runner import own_tensor

# Set while dynaprobe runs the eager backward, so that the parameter hooks which sum the training
# (compiled) gradients ignore the eager ones.
_local = threading.local()


@contextlib.contextmanager
def _eager_backward():
    previous = getattr(_local, "eager_backward", False)
    _local.eager_backward = True
    try:
        yield
    finally:
        _local.eager_backward = previous


def _in_eager_backward() -> bool:
    return getattr(_local, "eager_backward", False)


def tensor_leaves(value: Any) -> list:
    """(label, tensor) for every tensor in a nested value: tuples, lists, dicts, namedtuples,
    dataclasses (e.g. model outputs), in a stable order. Labels are pytree key paths."""
    out = []

    def collect(label: str, tensor: torch.Tensor) -> torch.Tensor:
        out.append((label, tensor))
        return tensor

    _map_nested(value, "", collect)
    return out


def map_output_tensors(value: Any, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn(index, tensor)`` in place of each tensor, indexed as tensor_leaves
    indexes them. Containers holding a replaced tensor are copies (tuples and lists rebuilt,
    dicts and dataclasses such as ``ModelOutput`` shallow-copied); the others are ``value``'s own.
    """
    counter = iter(range(1 << 62))
    return _map_nested(value, "", lambda _, tensor: fn(next(counter), tensor))


def _map_nested(item: Any, label: str, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> Any:
    """Depth-first over tensors in tuples, lists, dicts and dataclasses: fn(label, tensor) for
    each; returns ``item`` when fn replaced nothing inside it, else a copy holding the results."""
    if isinstance(item, torch.Tensor):
        return fn(label, item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        changed = {}
        for f in dataclasses.fields(item):
            sub = getattr(item, f.name)
            mapped = _map_nested(sub, f"{label}.{f.name}", fn)
            if mapped is not sub:
                changed[f.name] = mapped
        if not changed:
            return item
        result = copy.copy(item)
        for name, mapped in changed.items():
            try:
                setattr(result, name, mapped)  # ModelOutput keeps its dict view in step
            except dataclasses.FrozenInstanceError:
                object.__setattr__(result, name, mapped)
        return result
    if isinstance(item, dict):
        changed = {}
        for key, sub in item.items():
            mapped = _map_nested(sub, f"{label}[{key!r}]", fn)
            if mapped is not sub:
                changed[key] = mapped
        if not changed:
            return item
        result = copy.copy(item)
        result.update(changed)
        return result
    if isinstance(item, (list, tuple)):
        mapped = [_map_nested(sub, f"{label}[{i}]", fn) for i, sub in enumerate(item)]
        if all(m is s for m, s in zip(mapped, item)):
            return item
        if isinstance(item, tuple) and hasattr(item, "_fields"):  # namedtuple
            return type(item)(*mapped)
        return type(item)(mapped)
    return item


def map_tensors(args: tuple, kwargs: dict, fn: Callable[[int, torch.Tensor], torch.Tensor]):
    """(args, kwargs) with fn(index, tensor) in place of each tensor the call gets directly or
    inside tuples (namedtuples too), indexed as input_leaves indexes a call's tensors.

    Lists, dicts and other objects are passed on as they are, tensors inside them untouched: the
    callee may change them (append to a list, set a key), and the caller must see that.
    """
    index = 0

    def visit(item: Any) -> Any:
        nonlocal index
        if isinstance(item, torch.Tensor):
            index += 1
            return fn(index - 1, item)
        namedtuple = isinstance(item, tuple) and hasattr(item, "_fields")
        if type(item) is tuple or namedtuple:
            mapped = [visit(sub) for sub in item]
            if all(m is s for m, s in zip(mapped, item)):
                return item
            return type(item)(*mapped) if namedtuple else tuple(mapped)
        index += sum(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(item))
        return item

    mapped_args = tuple(visit(arg) for arg in args)
    return mapped_args, {key: visit(value) for key, value in kwargs.items()}


def probe(tensor: torch.Tensor, hook: Callable, writable: bool = False) -> torch.Tensor:
    """An identity of ``tensor`` that calls ``hook(grad)`` in the backward.

    Probing a module's inputs and outputs through identities of their own gives the gradients at
    the module boundary, as ``register_full_backward_hook`` means them: the probe of an output gets
    only the gradient arriving from outside the module (a hook on the output itself would also
    see the paths through the module's other outputs computed from it), and the probe of an input
    the gradient leaving the module through that argument.

    The probe is a view (``view_as``), unless ``writable``: then a tensor of its own on the same
    storage. Code that writes a view in place (``ReLU(inplace=True)``, ``x += skip``) rebases
    the history of the view's base, and autograd takes the gradient around the view, whose hook
    never fires; a written tensor of its own keeps its hook on the path. The caller's tensor then
    holds the written data with its old history: ``ProbedInputs.write_back`` gives it the
    probe's.
    """
    if not tensor.requires_grad:
        return tensor
    identity = own_tensor(tensor) if writable else tensor.view_as(tensor)
    carry_dynamo_marks(tensor, identity)
    identity.register_hook(hook)
    return identity


def carry_dynamo_marks(source: torch.Tensor, view: torch.Tensor) -> None:
    """Gives ``view`` the dimension markings Dynamo keeps on ``source`` as Python attributes: the
    user's (``torch._dynamo.mark_dynamic``) and those AOTAutograd stamps on a compiled graph's
    outputs whose sizes are symbolic (``_dynamo_propagated_dynamic_indices``), from which the next
    compiled module learns that those sizes vary. A view of the checker's without them would make
    that module compile with static sizes where, without the checker, its sizes are symbolic: a
    diffusers UNet's attention blocks, fed by resnet blocks at two resolutions, were another
    program under the checker."""
    for name, value in vars(source).items():
        if name.startswith(("_dynamo", "_has_dynamo")):
            setattr(view, name, value.copy() if hasattr(value, "copy") else value)


class ProbedInputs:
    """A call's arguments with each input tensor that requires grad probed by ``hook_for(index)``
    (grad_input), indexed as input_leaves: ``args`` and ``kwargs``.

    A tensor passed as several arguments (Funnel's query, key and value; NeoMME's hidden and
    initial states) is probed once, at its first position, and that one probe goes to every
    position: Dynamo sees one input, as without the checker (probing each position would make it
    several inputs, and the compiled backward would sum their gradients in another order). Its
    grad_input is the gradient through all of them, at its first index.

    ``writable`` probes (see ``probe``) need ``write_back()`` after the call.
    """

    def __init__(self, args: tuple, kwargs: dict, hook_for: Callable[[int], Callable],
                 writable: bool = False):
        self._writable = writable
        self._probed: dict = {}  # id(tensor) -> (tensor, probe, the probe's version)

        def probe_once(index: int, tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in self._probed:
                probed = probe(tensor, hook_for(index), writable)
                self._probed[id(tensor)] = (tensor, probed, probed._version)
            return self._probed[id(tensor)][1]

        self.args, self.kwargs = map_tensors(args, kwargs, probe_once)

    def write_back(self) -> None:
        """Gives each caller's tensor the call wrote through its writable probe the probe's
        history, as the write would have without the checker: a copy onto itself (the same
        memory: no data moves), the version counter left as the write left it. The gradient of
        the caller's later uses then flows through the write and the probe."""
        if not self._writable:
            return
        for tensor, probed, version in self._probed.values():
            if probed is not tensor and probed._version != version:
                with torch.autograd.grad_mode._unsafe_preserve_version_counter(tensor):
                    tensor.copy_(probed)


def probe_outputs(value: Any, hook_for: Callable[[int], Callable],
                  writable: bool = False) -> Any:
    """A module's output with each tensor that requires grad probed by ``hook_for(index)``
    (grad_output), indexed as tensor_leaves; ``writable``: see ``probe``."""
    return map_output_tensors(value, lambda index, tensor: probe(tensor, hook_for(index),
                                                                writable))


def patch_forward(module: torch.nn.Module, forward: Callable) -> Callable[[], None]:
    """Makes ``forward`` the module's forward (an instance attribute); returns the undo.

    Dynamo must not trace dynaprobe's own code when a caller compiles around it; the compiled
    function inside still compiles (recursive=False).
    """
    had_own = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = torch._dynamo.disable(forward, recursive=False)

    def undo() -> None:
        if had_own:
            module.forward = previous
        else:
            del module.forward

    return undo


def input_leaves(args: tuple, kwargs: dict) -> list:
    """(label, tensor) of a call's tensor arguments, in map_tensors order."""
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    return [(pytree.keystr(path), leaf) for path, leaf in leaves if isinstance(leaf, torch.Tensor)]


class RngState:
    """The RNG state of the CPU and of the accelerators the given tensors live on."""

    def __init__(self, devices: set):
        self.devices = devices
        self.cpu = torch.get_rng_state()
        self.cuda = {}
        for device in devices:
            if device.type == "cuda" and torch.cuda.is_initialized():
                index = device.index if device.index is not None else torch.cuda.current_device()
                self.cuda[index] = torch.cuda.get_rng_state(index)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for index, state in self.cuda.items():
            torch.cuda.set_rng_state(state, index)

    def drawn_until(self, later: "RngState") -> List[str]:
        """The generators (``cpu``, ``cuda:0``, ...) that drew random numbers between this state
        and ``later``, taken on the same devices."""
        drawn = [] if torch.equal(self.cpu, later.cpu) else ["cpu"]
        return drawn + [f"cuda:{index}" for index, state in self.cuda.items()
                        if index in later.cuda and not torch.equal(state, later.cuda[index])]

    def accelerator_drawn(self) -> bool:
        """Whether random numbers were drawn on an accelerator since this state was taken."""
        return any(not torch.equal(torch.cuda.get_rng_state(index), state)
                   for index, state in self.cuda.items())


def draws_its_own_random(backend) -> bool:
    """Whether a random op (dropout, torch.rand) that ``backend`` compiles draws other numbers
    than eager PyTorch: inductor generates them in its own kernels unless ``fallback_random`` is
    set, so a call's eager re-run cannot agree with it."""
    if backend != "inductor" and not isinstance(backend, torch._TorchCompileInductorWrapper):
        return False
    import torch._inductor.config as inductor_config

    return not inductor_config.fallback_random


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2/tensor-parallel shards); other tensors as they are.
    The recorder takes plain tensors only."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor)


class Shard:
    """Where this rank's shard of a DTensor parameter lies in the full parameter: FSDP2 shards
    parameters (dim 0 by default) and, in the forward, registers the full (unsharded) parameter
    on the module in their place. Gradients w.r.t. the full parameter are cut to this shard."""

    def __init__(self, param: torch.Tensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self.full_shape = tuple(param.shape)
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                              param.placements)
        self.index = tuple(slice(o, o + n) for o, n in zip(offset, shape))

    @staticmethod
    def of(param: torch.Tensor) -> "Optional[Shard]":
        return Shard(param) if _is_dtensor(param) else None

    def cut(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a gradient w.r.t. the full parameter; of a DTensor gradient (the
        parameter was not unsharded), its local part."""
        if _is_dtensor(grad):
            return grad.to_local()
        return grad[self.index] if tuple(grad.shape) == self.full_shape else grad

    def describe(self) -> str:
        """E.g. ``shard [0:32] of (64, 16)``: the sliced dimensions, trailing full ones left out."""
        parts = [f"{s.start}:{s.stop}" if (s.start, s.stop) != (0, n) else ":"
                 for s, n in zip(self.index, self.full_shape)]
        while parts and parts[-1] == ":":
            parts.pop()
        return f"shard [{', '.join(parts) or ':'}] of {self.full_shape}"


def devices_of(tensors: list, module: torch.nn.Module) -> set:
    devices = {t.device for t in tensors}
    for p in module.parameters():
        devices.add(p.device)
        break
    return devices


def autocast_context(cast_dtype: Optional[torch.dtype], devices: set):
    """torch.autocast on the module's own device type (cpu, cuda, ...), or nothing."""
    if cast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=autocast_device_type(devices), dtype=cast_dtype)


def autocast_device_type(devices: set) -> str:
    """The device type autocast applies to: the accelerator's, else cpu."""
    return next((d.type for d in devices if d.type != "cpu"), "cpu")
