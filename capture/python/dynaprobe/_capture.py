"""Capture mechanics: intercept a wrapped module's calls and record its tensors.

A wrapped module keeps its place in the model (names, state_dict, parameters and other tools'
hooks are untouched); only its ``forward`` is replaced by an instance attribute that records the
inputs, runs the module (compiled or eager), records the outputs and arranges for the gradients to
be recorded during backward.

Single-pass: the compiled forward is the real training path; the original module is then re-run
eagerly on clones of the same inputs, with the RNG state and changed buffers restored around it, so
training sees exactly what it would see without the checker. Its backward runs inside the real
backward, seeded with the real upstream gradient (grad_output), through ``torch.autograd.grad`` —
which never touches ``.grad``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree

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

    def visit(item: Any, label: str) -> None:
        if isinstance(item, torch.Tensor):
            out.append((label, item))
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            for f in dataclasses.fields(item):
                visit(getattr(item, f.name), f"{label}.{f.name}")
        elif isinstance(item, dict):
            for key, sub in item.items():
                visit(sub, f"{label}[{key!r}]")
        elif isinstance(item, (list, tuple)):
            for i, sub in enumerate(item):
                visit(sub, f"{label}[{i}]")

    visit(value, "")
    return out


def map_tensors(args: tuple, kwargs: dict, fn: Callable[[int, torch.Tensor], torch.Tensor]):
    """Rebuilds (args, kwargs) with fn(index, tensor) in place of each tensor, indexed in the
    order of tensor_leaves((args, kwargs))."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    index = 0
    mapped = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            mapped.append(fn(index, leaf))
            index += 1
        else:
            mapped.append(leaf)
    return pytree.tree_unflatten(mapped, spec)


def input_leaves(args: tuple, kwargs: dict) -> list:
    """(label, tensor) of a call's tensor arguments, in map_tensors order."""
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    return [(pytree.keystr(path), leaf) for path, leaf in leaves if isinstance(leaf, torch.Tensor)]


class RngState:
    """The RNG state of the CPU and of the accelerators the given tensors live on."""

    def __init__(self, devices: set):
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


class BufferGuard:
    """Keeps a module's buffers as the training run left them while the eager re-run (which would
    update BatchNorm statistics a second time) runs in between.

    The re-run gets fresh tensors holding the values from before the training run, swapped into
    the modules for its duration. The training run's own buffer tensors are never written to, so
    graphs that saved them (batch norm's backward takes the running statistics) stay valid.
    """

    def __init__(self, module: torch.nn.Module):
        self.slots = [(owner, name, buffer) for owner in module.modules()
                      for name, buffer in owner._buffers.items() if buffer is not None]
        self.before = [buffer.detach().clone() for _, _, buffer in self.slots]

    def swap_to_before(self) -> None:
        for (owner, name, _), old in zip(self.slots, self.before):
            owner._buffers[name] = old

    def restore_after(self) -> None:
        for owner, name, buffer in self.slots:
            owner._buffers[name] = buffer


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
    device_type = next((d.type for d in devices if d.type != "cpu"), "cpu")
    return torch.autocast(device_type=device_type, dtype=cast_dtype)
