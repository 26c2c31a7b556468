"""The fp64 reference of a module call (``PrecisionChecker(reference=...)``): the wrapped module
re-run eagerly in float64, on a copy of the module and of the call's arguments, as
``torch._dynamo.utils.same(..., fp64_ref=...)`` does for whole graphs. The analyzer measures
each side's error against it: a compiled error within a small factor of eager's own is the noise
any reordering of float arithmetic makes; beyond it, a divergence (docs/user-guide.md).
"""

from __future__ import annotations

import copy
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn

from dynaprobe._isolation import copy_arguments


def upcast(tensor: torch.Tensor) -> torch.Tensor:
    """float64 for floating tensors, complex128 for complex ones; others as they are."""
    if tensor.is_complex():
        return tensor.to(torch.complex128)
    return tensor.to(torch.float64) if tensor.is_floating_point() else tensor


def copy_reference_arguments(args: tuple, kwargs: dict):
    """The call's arguments for the reference, upcast (taken before the training call, which may
    change them)."""
    return copy_arguments(args, kwargs, lambda _, t: upcast(t.detach()).clone(), convert=upcast)


def outputs_differ(eager_out, compiled_out, leaves: Callable, atol: float, rtol: float) -> bool:
    """Whether any output tensor fails the report's allclose check, compared in float32 as the
    analyzer compares (decided in the process, for reference="failing")."""
    eager, compiled = leaves(eager_out), leaves(compiled_out)
    if len(eager) != len(compiled):
        return True
    for (_, a), (_, b) in zip(eager, compiled):
        if a.shape != b.shape:
            return True
        if a.is_floating_point() or a.is_complex():
            a, b = (t.detach() if t.is_complex() else t.detach().float() for t in (a, b))
            if not torch.allclose(a, b, atol=atol, rtol=rtol):
                return True
    return False


class ReferenceRun:
    """One call's reference: outputs, the input leaves and the parameters its backward needs."""

    def __init__(self, outputs: list, leaves: List[Tuple[int, torch.Tensor]],
                 params: List[Tuple[torch.Tensor, torch.Tensor]]):
        self.outputs = outputs  # (index, tensor) of the output leaves that require grad
        self.leaves = leaves  # (input index, float64 input leaf)
        self.params = params  # (real parameter, its float64 copy)


def run_reference(module: nn.Module, forward: Callable, arguments, grad_mode: bool,
                  requires_grad: Callable[[int], bool], leaves_of: Callable,
                  map_inputs: Callable) -> Tuple[object, Optional[ReferenceRun]]:
    """Runs ``forward`` (the module's original, uncompiled forward, a bound method) on a float64
    deep copy of ``module`` with the upcast ``arguments``; returns the output and, in grad mode,
    what the reference backward needs."""
    twin = copy.deepcopy(module).to(torch.float64)
    real = dict(module.named_parameters())
    bound = forward.__func__.__get__(twin)
    args, kwargs, _ = arguments
    leaves = []

    def as_leaf(index: int, tensor: torch.Tensor) -> torch.Tensor:
        if grad_mode and requires_grad(index) and (tensor.is_floating_point()
                                                   or tensor.is_complex()):
            tensor.requires_grad_(True)
            leaves.append((index, tensor))
        return tensor

    args, kwargs = map_inputs(args, kwargs, as_leaf)
    with torch.set_grad_enabled(grad_mode):
        out = bound(*args, **kwargs)
    if not grad_mode:
        return out, None
    outputs = [(i, t) for i, (_, t) in enumerate(leaves_of(out)) if t.requires_grad]
    params = [(real[name], p) for name, p in twin.named_parameters()
              if name in real and real[name].requires_grad]
    return out, ReferenceRun(outputs, leaves, params)
