"""Two-pass (and one-sided capture): ``fn`` runs once per side, on that side's model, from the
same RNG state; each side's wrapped modules record their own inputs, outputs and gradients."""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from dynaprobe._C.vocabulary import (
    KIND_FWD_INPUT,
    KIND_FWD_OUTPUT,
    KIND_GRAD_INPUT,
    KIND_GRAD_OUTPUT,
    SIDE_COMPILED,
    SIDE_EAGER,
    SIDE_REFERENCE,
)
from dynaprobe._mechanics.capture import (
    ProbedInputs,
    RngState,
    autocast_context,
    devices_of,
    draws_its_own_random,
    input_leaves,
    map_tensors,
    patch_forward,
    probe_outputs,
    tensor_leaves,
)
from dynaprobe._mechanics.reference import ReferencePolicy, call_precision, no_autocast, upcast
from dynaprobe._steps.compiling import Compiler
from dynaprobe._steps.session import StepSession
from dynaprobe._steps.step import Step, Target

SIDES = (SIDE_EAGER, SIDE_COMPILED, SIDE_REFERENCE)


def run_step(session: StepSession, fn: Callable, model: nn.Module,
             sides: List[Tuple[str, nn.Module]], targets: List[Tuple[str, str]],
             compiler: Compiler, capture_input: bool, cast_dtype,
             reference: ReferencePolicy = ReferencePolicy(None), compare: bool = True):
    """A two-pass (or captured) step of ``session``: begun, run by ``run_sides`` with the
    targets compiled by ``compiler``, what it learned of the compiled side's targets, and
    finished (``StepSession.finish``: its result, or its file)."""
    step = session.begin([])
    try:
        by_side = run_sides(step, fn, model, sides, targets, compiler.compile, capture_input,
                            cast_dtype, reference, compiler.graphs.backend)
        if SIDE_COMPILED in by_side:
            compiler.summarize(step, by_side[SIDE_COMPILED])
        return session.finish(compare=compare)
    finally:
        session.abandon()


def run_sides(step: Step, fn: Callable, model: nn.Module, sides: List[Tuple[str, nn.Module]],
              targets: List[Tuple[str, str]], compile_forward: Callable,
              capture_input: bool, cast_dtype,
              reference: ReferencePolicy = ReferencePolicy(None),
              backend=None) -> Dict[str, List[Target]]:
    """Runs ``fn(side_model)`` for each (side, side_model) in turn, from ``model``'s RNG state,
    recording into ``step`` the wrapped modules of each (``targets``: (display name, path)), the
    losses ``fn`` returns and the parameter gradients. Then, when ``reference`` asks for one
    (every call, or "auto" with a call of the eager side in bf16/fp16), a third side: a copy of
    ``model`` upcast to the reference dtype, its wrapped modules run with autocast off. Returns
    each side's targets. The side models are restored afterwards, whatever happens."""
    restore = []
    by_side: Dict[str, List[Target]] = {}
    seen_low: List[torch.dtype] = []  # the reduced dtypes the eager side's calls computed in
    watch_draws = draws_its_own_random(backend)

    def patch(side: str, side_model: nn.Module, run_of: Callable, forward_of: Callable) -> None:
        modules = dict(side_model.named_modules())
        by_side[side] = []
        for display, name in targets:
            module = modules[name]
            target = Target(display, module, run_of(display, module.forward), None)
            by_side[side].append(target)
            restore.append(patch_forward(module, forward_of(target)))
            for _, param in target.params:
                restore.append(param.register_hook(_param_hook(step, side, param)).remove)

    try:
        for side, side_model in sides:
            patch(side, side_model,
                  (lambda _, forward: forward) if side == SIDE_EAGER else compile_forward,
                  lambda target, side=side: _one_side_forward(
                      step, target, side, capture_input, cast_dtype,
                      seen_low if side == SIDE_EAGER else None,
                      watch_draws and side == SIDE_EAGER))
        rng = RngState(devices_of([], model))
        for i, (side, side_model) in enumerate(sides):
            if i:
                rng.restore()
            loss = fn(side_model)
            if loss is not None:
                step.record_loss(side, loss)
        dtype = reference.dtype(seen_low[0] if seen_low else None)
        if dtype is not None and SIDE_COMPILED in by_side:
            _run_reference_side(step, fn, model, rng, dtype, patch,
                                [display for display, _ in targets], capture_input)
        first = next(iter(by_side.values()))
        step.record_param_grads([
            (target.name, [(param_name,
                            *(by_side[s][i].params[j][1] if s in by_side else None
                              for s in SIDES))
                           for j, (param_name, _) in enumerate(target.params)])
            for i, target in enumerate(first)])
        return by_side
    finally:
        for undo in reversed(restore):
            undo()


def _run_reference_side(step: Step, fn: Callable, model: nn.Module, rng: RngState,
                        dtype: torch.dtype, patch: Callable, names: List[str],
                        capture_input: bool) -> None:
    """The reference side: ``fn`` once more on a copy of ``model`` in ``dtype``. A step it
    cannot run (an op without a kernel for the dtype, ...) gives every wrapped module (``names``)
    a NO_REFERENCE row saying why."""
    try:
        reference_model = copy.deepcopy(model).to(dtype)
        patch(SIDE_REFERENCE, reference_model, lambda _, forward: forward,
              lambda target: _reference_forward(step, target, dtype, capture_input))
        rng.restore()
        fn(reference_model)
    except Exception as error:  # never fail the comparison because of the reference
        for name in names:
            step.reference_missing(name, f"the {dtype} copy of the step failed: "
                                   f"{type(error).__name__}: {error}")


def _reference_forward(step: Step, target: Target, dtype: torch.dtype,
                       capture_input: bool) -> Callable:
    """A wrapped module of the reference copy: its inputs upcast, autocast off; records its
    outputs and gradients as the reference side."""
    def forward(*args, **kwargs):
        args, kwargs = map_tensors(args, kwargs, lambda _, t: upcast(t, dtype))
        inputs = input_leaves(args, kwargs)
        devices = devices_of([t for _, t in inputs], target.module)
        with no_autocast(devices):
            return _recorded_call(step, target, SIDE_REFERENCE, args, kwargs, capture_input,
                                  target.run)

    return forward


def _one_side_forward(step: Step, target: Target, side: str, capture_input: bool,
                      cast_dtype, seen_low: Optional[list], watch_draws: bool) -> Callable:
    """A wrapped module of one side; ``watch_draws``: note whether each call draws random
    numbers."""
    def forward(*args, **kwargs):
        inputs = input_leaves(args, kwargs)
        devices = devices_of([t for _, t in inputs], target.module)
        if seen_low is not None:
            low = call_precision(step, target.name, [t for _, t in inputs], target.module,
                                 cast_dtype, devices)
            if low is not None and not seen_low:
                seen_low.append(low)
        before = RngState(devices) if watch_draws else None
        with autocast_context(cast_dtype, devices):
            out = _recorded_call(step, target, side, args, kwargs, capture_input, target.run)
        if before is not None:
            step.note_random_draws(target.name, before.drawn_until(RngState(devices)))
        return out

    return forward


def _recorded_call(step: Step, target: Target, side: str, args: tuple, kwargs: dict,
                   capture_input: bool, run: Callable):
    """One call of a wrapped module on one side: its inputs (if captured), outputs and
    gradients recorded as ``side``'s."""
    call = target.calls
    target.calls += 1
    inputs = input_leaves(args, kwargs)
    if capture_input:
        for index, (label, tensor) in enumerate(inputs):
            step.record(target.name, call, KIND_FWD_INPUT, index, side, tensor, label)
    grad_mode = torch.is_grad_enabled()
    if grad_mode:
        # Writable probes: the module, or the code after it, may write them in place
        # (ReLU(inplace=True), x += skip), on either side.
        probed = ProbedInputs(args, kwargs, lambda index: _grad_hook(
            step, target, call, KIND_GRAD_INPUT, index, side), writable=True)
        args, kwargs = probed.args, probed.kwargs
    out = run(*args, **kwargs)
    if grad_mode:
        probed.write_back()
    for index, (label, tensor) in enumerate(tensor_leaves(out)):
        step.record(target.name, call, KIND_FWD_OUTPUT, index, side, tensor, label)
    if not grad_mode:
        return out
    return probe_outputs(out, lambda index: _grad_hook(
        step, target, call, KIND_GRAD_OUTPUT, index, side), writable=True)


def _grad_hook(step: Step, target: Target, call: int, kind: str, index: int, side: str):
    def hook(grad: Optional[torch.Tensor]) -> None:
        # An output the loss does not depend on (e.g. attention weights) gets no gradient:
        # autograd calls its hook with None.
        if grad is not None:
            step.record(target.name, call, kind, index, side, grad)

    return hook


def _param_hook(step: Step, side: str, param: torch.Tensor):
    def hook(grad: Optional[torch.Tensor]) -> None:
        if grad is not None:  # None: a gradient autograd left undefined (zero)
            step.add_param_grad(side, param, grad)

    return hook
