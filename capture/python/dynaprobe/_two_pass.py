"""Two-pass (and one-sided capture): ``fn`` runs once per side, on that side's model, from the
same RNG state; each side's wrapped modules record their own inputs, outputs and gradients."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from dynaprobe._capture import (
    RngState,
    autocast_context,
    devices_of,
    input_leaves,
    patch_forward,
    probe_inputs,
    probe_outputs,
    tensor_leaves,
)
from dynaprobe._step import Step, Target


def run_sides(step: Step, fn: Callable, model: nn.Module, sides: List[Tuple[str, nn.Module]],
              targets: List[Tuple[str, str]], compile_forward: Callable,
              capture_input: bool, cast_dtype) -> Dict[str, List[Target]]:
    """Runs ``fn(side_model)`` for each (side, side_model) in turn, from ``model``'s RNG state,
    recording into ``step`` the wrapped modules of each (``targets``: (display name, path)), the
    losses ``fn`` returns and the parameter gradients. Returns each side's targets. The side
    models are restored afterwards, whatever happens."""
    restore = []
    by_side: Dict[str, List[Target]] = {}
    try:
        for side, side_model in sides:
            modules = dict(side_model.named_modules())
            by_side[side] = []
            for display, name in targets:
                module = modules[name]
                original = module.forward
                run = original if side == "eager" else compile_forward(display, original)
                target = Target(display, module, run, None)
                by_side[side].append(target)
                restore.append(patch_forward(module, _one_side_forward(
                    step, target, side, capture_input, cast_dtype)))
                for _, param in target.params:
                    restore.append(param.register_hook(
                        _param_hook(step, side, param)).remove)
        rng = RngState(devices_of([], model))
        for i, (side, side_model) in enumerate(sides):
            if i:
                rng.restore()
            loss = fn(side_model)
            if loss is not None:
                step.record_loss(side, loss)
        first = next(iter(by_side.values()))
        step.record_param_grads([
            (target.name, [(param_name,
                            *(by_side[s][i].params[j][1] if s in by_side else None
                              for s in ("eager", "compiled")))
                           for j, (param_name, _) in enumerate(target.params)])
            for i, target in enumerate(first)])
        return by_side
    finally:
        for undo in reversed(restore):
            undo()


def _one_side_forward(step: Step, target: Target, side: str, capture_input: bool,
                      cast_dtype) -> Callable:
    def forward(*args, **kwargs):
        call = target.calls
        target.calls += 1
        inputs = input_leaves(args, kwargs)
        if capture_input:
            for index, (label, tensor) in enumerate(inputs):
                step.record(target.name, call, "fwd_input", index, side, tensor, label)
        grad_mode = torch.is_grad_enabled()
        if grad_mode:
            args, kwargs = probe_inputs(args, kwargs, lambda index: _grad_hook(
                step, target, call, "grad_input", index, side))
        devices = devices_of([t for _, t in inputs], target.module)
        with autocast_context(cast_dtype, devices):
            out = target.run(*args, **kwargs)
        for index, (label, tensor) in enumerate(tensor_leaves(out)):
            step.record(target.name, call, "fwd_output", index, side, tensor, label)
        if not grad_mode:
            return out
        return probe_outputs(out, lambda index: _grad_hook(
            step, target, call, "grad_output", index, side))

    return forward


def _grad_hook(step: Step, target: Target, call: int, kind: str, index: int, side: str):
    def hook(grad: Optional[torch.Tensor]) -> None:
        # An output the loss does not depend on (e.g. attention weights) gets no gradient:
        # autograd calls its hook with None.
        if grad is not None:
            step.record(target.name, call, kind, index, side, grad)

    return hook


def _param_hook(step: Step, side: str, param: torch.Tensor):
    def hook(grad: torch.Tensor) -> None:
        step.add_param_grad(side, param, grad)

    return hook
