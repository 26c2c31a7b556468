"""Replaying a module call from the graphs Dynamo captured of it, with torch alone.

This file imports nothing but torch: ``dynaprobe repro`` copies it into a repro folder as
``graph_runner.py``, where it runs without dynaprobe, and dynaprobe's own replays (bisect, the
Python API) run the same code.

A call is the graphs Dynamo ran for it, in order (more than one when the module has graph
breaks). Each graph call (``GraphCall``) holds the tensors and numbers its placeholders took,
which of them required grad, the gradient that reached each of its outputs in training, and the
RNG state before it. Replaying runs each graph, eagerly (by Python) or compiled, on fresh copies
of those, then its backward seeded with those gradients; parameters are named by the module's
own names, so a parameter several graphs read gets the sum of their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch


@dataclass
class GraphCall:
    """One run of one captured graph within the call.

    ``args`` are the placeholders' values in order: a tensor, or a plain number (a SymInt's value);
    ``names`` the placeholders' names; ``params`` maps an argument position to the module's
    parameter name when it is one; ``requires_grad`` the positions that required grad;
    ``outputs`` the output names; ``grads`` the gradient each output received (by position);
    ``rng`` the CPU RNG state before it and ``cuda_rng`` the accelerators' (by device index).
    """

    function: str
    args: list
    names: List[str]
    requires_grad: List[int]
    outputs: List[str]
    params: Dict[int, str] = field(default_factory=dict)
    grads: Dict[int, torch.Tensor] = field(default_factory=dict)
    rng: Optional[torch.Tensor] = None
    cuda_rng: Dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class Replayed:
    """What a replay produced: (label, tensor) per output and per gradient of a graph input
    that is not a parameter, and the parameters' gradients by name."""

    outputs: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    grad_inputs: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    param_grads: Dict[str, torch.Tensor] = field(default_factory=dict)


def replay_graphs(calls: List[GraphCall], graphs: Dict[str, Callable], grad_mode: bool,
                  cast_dtype: Optional[torch.dtype] = None, device: str = "cpu") -> Replayed:
    """Runs each graph call with ``graphs[function]`` (a captured graph, or a compiled one) and
    its backward; see the module docstring."""
    replayed = Replayed()
    for call in calls:
        args = [_fresh(value, grad_mode and position in call.requires_grad)
                for position, value in enumerate(call.args)]
        if call.rng is not None:
            torch.set_rng_state(call.rng)
        for index, state in call.cuda_rng.items():
            torch.cuda.set_rng_state(state, index)
        autocast = torch.autocast(device_type=torch.device(device).type, dtype=cast_dtype,
                                  enabled=cast_dtype is not None)
        given = [own_tensor(arg) if isinstance(arg, torch.Tensor) and arg.requires_grad else arg
                 for arg in args]  # a graph may write its inputs in place
        with torch.set_grad_enabled(grad_mode), autocast:
            out = graphs[call.function](*given)
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        for position, value in enumerate(out):
            if isinstance(value, torch.Tensor):
                replayed.outputs.append((_output_label(call, position), value.detach()))
        if not grad_mode:
            continue
        seeded = [(value, call.grads.get(position)) for position, value in enumerate(out)
                  if isinstance(value, torch.Tensor) and value.requires_grad]
        leaves = [(position, arg) for position, arg in enumerate(args)
                  if isinstance(arg, torch.Tensor) and arg.requires_grad]
        if not seeded or not leaves:
            continue
        found = torch.autograd.grad(
            [value for value, _ in seeded],
            [arg for _, arg in leaves],
            [torch.zeros_like(value) if grad is None or grad.shape != value.shape
             else grad.to(value.device) for value, grad in seeded], allow_unused=True)
        for (position, _), grad in zip(leaves, found):
            if grad is None:
                continue
            if position in call.params:
                name = call.params[position]
                total = replayed.param_grads.get(name)
                replayed.param_grads[name] = grad if total is None else total + grad
            else:
                replayed.grad_inputs.append((f"{call.function} {call.names[position]}", grad))
    return replayed


def raised(calls: List[GraphCall], dtype: torch.dtype = torch.float64) -> List[GraphCall]:
    """``calls`` with every floating tensor they hold (arguments, gradients) in ``dtype``: a
    replay in float64, the reference of an accuracy check."""
    def up(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and \
            value.is_floating_point() else value

    return [replace(call, args=[up(a) for a in call.args],
                    grads={k: up(g) for k, g in call.grads.items()}) for call in calls]


class _OwnTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()  # the same storage and version counter, not a differentiable view

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def own_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The identity of a tensor in a graph, returning a tensor of its own on the same storage:
    not a view, and not a leaf. Code may write it in place (``ReLU(inplace=True)``): autograd
    refuses writes to a leaf that requires grad or to a view of one, and a written view passes
    its gradient to its base, around the view's own history. The gradient reaching ``tensor`` is
    that of the value on entry."""
    return _OwnTensor.apply(tensor)


def _fresh(value, requires_grad: bool):
    if not isinstance(value, torch.Tensor):
        return value
    copy = value.detach().clone()
    if requires_grad and (copy.is_floating_point() or copy.is_complex()):
        copy.requires_grad_(True)
    return copy


def _output_label(call: GraphCall, position: int) -> str:
    name = call.outputs[position] if position < len(call.outputs) else str(position)
    return f"{call.function} {name}"


def metrics(eager: torch.Tensor, other: torch.Tensor) -> Tuple[float, float, float]:
    """max_abs, mean_abs and max_rel of two tensors, as the report defines them: float32
    differences |other - eager|, relative to |eager| + 1e-8, NaNs left out of the maxima."""
    a = eager.detach().reshape(-1).to(torch.float32)
    b = other.detach().reshape(-1).to(torch.float32)
    if a.numel() == 0:
        return 0.0, 0.0, 0.0
    diff = (a - b).abs()
    rel = diff / (a.abs() + 1e-8)
    return (float(diff.masked_fill(diff.isnan(), 0).max()), float(diff.double().mean()),
            float(rel.masked_fill(rel.isnan(), 0).max()))


def compiler_bisect(test_fn: Callable[[object], bool], backend) -> int:
    """torch._inductor.compiler_bisector on ``test_fn(backend) -> bool`` (True when the call
    compiled with that backend matches; ``backend``: the repro's own, tried first): the backend,
    then the subsystem and the application of it that makes the compiled call differ, and the
    line that replays it. Returns 1 when one was found, 0 when none makes it differ."""
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415
    import logging  # noqa: PLC0415

    from torch._inductor.compiler_bisector import CompilerBisector  # noqa: PLC0415

    logging.getLogger("torch._dynamo.utils").disabled = True  # same()'s line per failing try
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        found = CompilerBisector.do_bisect(lambda: test_fn(CompilerBisector.get_backend() or
                                                           backend))
    print("CompilerBisector (torch._inductor.compiler_bisector) on test_fn(), what it tried:")
    for line in log.getvalue().splitlines():
        print(f"  {line}")
    if found is None:
        print("no backend or subsystem makes it differ: test_fn() passes under each")
        return 0
    print(f"first to differ: backend {found.backend}, subsystem {found.subsystem or '-'}, "
          f"application {found.bisect_number if found.bisect_number is not None else '-'}")
    if found.debug_info:
        print(f"  {found.debug_info}")
    replay_line = " ".join(f"TORCH_BISECT_{key}={value}" for key, value in (
        ("BACKEND", found.backend), ("SUBSYSTEM", found.subsystem),
        ("MAX", found.bisect_number)) if value is not None)
    print(f"replay: {replay_line} python repro.py" + (
        f"   (differs; with TORCH_BISECT_MAX={found.bisect_number - 1} it matches)"
        if found.bisect_number else ""))
    return 1
