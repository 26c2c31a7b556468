"""The reference of a module call (``PrecisionChecker(reference=...)``): the wrapped module re-run
eagerly in a wider dtype, autocast off, on the module's own weights and a copy of the call's
arguments, both upcast, as ``torch._dynamo.utils.same(..., fp64_ref=...)`` does for whole graphs.
The analyzer measures each side's error against it: a compiled error within a small factor of
eager's own is the noise any reordering of float arithmetic makes; beyond it, a divergence, and
the row FAILs (docs/user-guide.md, "Is it noise?").

Which dtype: float32 is enough to judge a call computing in bfloat16 or float16 (its error is
2^16 times smaller), with half the memory of float64 and at full speed on GPUs without fast
float64; float64 judges float32 calls. ``ReferencePolicy`` decides per call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._mechanics.capture import autocast_device_type, input_leaves
from dynaprobe._mechanics.isolation import copy_arguments, rerun_input

LOW_PRECISION = (torch.bfloat16, torch.float16)

# PrecisionChecker(reference=...): what each value runs a reference for, in which dtype.
#   "auto" (default): the calls computing in bf16/fp16 (weights, inputs or autocast), in float32;
#   in single-pass and whole-model mode also the float32 calls whose forward output fails the
#   tolerances or is beyond fp32 noise, in float64 (as "failing" does for them);
#   "fp64" / "fp32": every call, in that dtype;
#   "failing": the calls whose forward output fails (the tolerances, or the fp32 screen), in
#   float32 for bf16/fp16 calls
#   and float64 for others; None: no reference.
MODES = (None, "auto", "fp64", "fp32", "failing")


def expect_reference(value, single_pass: bool) -> Optional[str]:
    """One of MODES. Two-pass runs its reference as a third copy of the whole step, for every
    call or for none: "failing" needs single-pass."""
    if value not in MODES:
        raise ValueError(f"reference must be one of {', '.join(map(repr, MODES))}, but received "
                         f"{value!r}")
    if value == "failing" and not single_pass:
        raise ValueError("reference='failing' needs single_pass=True: two-pass runs the reference "
                         "as a third copy of the whole step, for every call ('auto', 'fp32', "
                         "'fp64') or for none (None)")
    return value


def user_autocast(devices: set) -> Optional[torch.dtype]:
    """The dtype of a torch.autocast the caller has entered on the call's device type, if it is
    a reduced one (bf16, fp16)."""
    device_type = autocast_device_type(devices)
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if dtype in LOW_PRECISION else None


def low_precision(tensors: List[torch.Tensor], module: Optional[nn.Module],
                  autocast: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The reduced dtype a call computes in: its autocast, else a bf16/fp16 floating input,
    parameter or buffer; None in full precision."""
    if autocast in LOW_PRECISION:
        return autocast
    for tensor in tensors:
        if tensor.dtype in LOW_PRECISION:
            return tensor.dtype
    if module is not None:
        for tensor in _module_tensors(module):
            if tensor.dtype in LOW_PRECISION:
                return tensor.dtype
    return None


def call_precision(step, name: str, tensors: List[torch.Tensor], module: Optional[nn.Module],
                   cast_dtype: Optional[torch.dtype], devices: set) -> Optional[torch.dtype]:
    """The reduced dtype a call of ``name`` computes in (see low_precision), the checker's
    ``cast_dtype`` or else the user's own autocast counting; the latter is recorded as the
    module's ``autocast`` attribute, so that the report can say it."""
    autocast = cast_dtype or user_autocast(devices)
    if autocast is not None and cast_dtype is None:
        step.attributes.setdefault(name, {})[vocabulary.PROVENANCE_AUTOCAST] = str(autocast)
    return low_precision(tensors, module, autocast)


def shapes_differ(reference_leaves: list, eager_leaves: list) -> Optional[str]:
    """Why a reference's output tensors cannot stand for eager's (their shapes differ: a path
    that depends on the dtype), else None."""
    shapes = [tuple(t.shape) for t in reference_leaves]
    expected = [tuple(t.shape) for t in eager_leaves]
    if shapes == expected:
        return None
    return (f"its outputs have shapes {shapes}, eager's {expected} (does the module's path "
            "depend on the dtype?)")


def _module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


@dataclass(frozen=True)
class CallReference:
    """The reference decision of one call (``ReferencePolicy.for_call``): the dtype of a
    reference run up front, and of one run only if the call's output fails."""

    up_front: Optional[torch.dtype]
    if_failing: Optional[torch.dtype]

    @property
    def wanted(self) -> Optional[torch.dtype]:
        """The dtype the call's reference arguments are copied in: it may get one."""
        return self.up_front or self.if_failing

    def dtype(self, failing: Callable[[], bool]) -> Optional[torch.dtype]:
        """The dtype of the reference this call runs, once its outputs are known; ``failing``
        judges them, asked only when that decides."""
        if self.up_front is not None:
            return self.up_front
        return self.if_failing if self.if_failing is not None and failing() else None


class ReferencePolicy:
    """``reference=`` of a checker: which calls get a reference, in which dtype."""

    def __init__(self, mode: Optional[str]):
        self.mode = mode

    def for_call(self, step, name: str, tensors: List[torch.Tensor],
                 module: Optional[nn.Module], cast_dtype: Optional[torch.dtype],
                 devices: set) -> CallReference:
        """The decision for a call of ``name`` in single-pass and whole-model mode, from the
        precision it computes in (``call_precision``, which records the user's autocast)."""
        low = call_precision(step, name, tensors, module, cast_dtype, devices)
        return CallReference(self.dtype(low), self.dtype_if_failing(low))

    def dtype(self, low: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """The reference dtype of a call computing in ``low`` (None: full precision); None when
        the call gets no reference up front ("failing" decides after the call: dtype_if_failing).
        """
        if self.mode == "fp64":
            return torch.float64
        if self.mode == "fp32":
            return torch.float32
        if self.mode == "auto" and low is not None:
            return torch.float32
        return None

    def dtype_if_failing(self, low: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """The dtype of the reference of a call whose output fails: reference="failing" for every
        call, "auto" for float32 calls (float64), whose reduced-precision twins get one up
        front."""
        if self.mode == "auto" and low is None:
            return torch.float64
        if self.mode != "failing":
            return None
        return torch.float32 if low is not None else torch.float64


def accelerator_draws(dtype: torch.dtype) -> str:
    """Why a call that drew random numbers on an accelerator gets no reference: CUDA's random
    kernels (dropout) map their numbers to elements by the dtype's vector width, so a reference
    in another dtype drops other elements than the call, and eager's own error against it would
    pass any mask as noise."""
    return (f"the call draws random numbers on the accelerator (dropout), which a {dtype} "
            "reference draws for other elements: judged by the tolerances")


def upcast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating tensors in ``dtype`` (float32 or float64), complex ones in the complex dtype of
    that precision; others as they are. Never narrows a wider tensor."""
    wide = upcast_dtype(tensor, dtype)
    return tensor if wide in (None, tensor.dtype) else tensor.to(wide)


def upcast_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype ``upcast`` gives ``tensor``; None for one it leaves as it is whatever ``dtype``
    (not floating, or float64 or complex128 already)."""
    if tensor.dtype in (torch.float64, torch.complex128) or not (
            tensor.is_floating_point() or tensor.is_complex()):
        return None
    if tensor.is_complex():
        return torch.complex128 if dtype == torch.float64 else torch.complex64
    return dtype


def upcast_copy(tensor: torch.Tensor, dtype: torch.dtype, leaf: bool = False) -> torch.Tensor:
    """A copy of ``tensor`` for a reference: upcast (``upcast``), detached, in memory of its
    own; with ``leaf``, a floating copy is a leaf requiring grad (the reference's backward)."""
    wide = upcast(tensor.detach(), dtype).clone()
    if leaf and (wide.is_floating_point() or wide.is_complex()):
        wide.requires_grad_(True)
    return wide


def copy_reference_arguments(args: tuple, kwargs: dict, dtype: torch.dtype):
    """The call's arguments for the reference, upcast (taken before the training call, which may
    change them)."""
    return copy_arguments(args, kwargs, lambda _, t: upcast_copy(t, dtype),
                          convert=lambda tensor: upcast(tensor, dtype))


def outputs_differ(eager_out, compiled_out, leaves: Callable, module: str,
                   judging: _C.Judging) -> bool:
    """Whether any output tensor of ``module`` fails as the report's row will (decided in the
    process, for reference="failing"): a different structure or shape, or the engine's verdict
    on the pair with the checker's tolerances (``_C.rows_pass``, analyze/judging.h: Python
    judges no number itself)."""
    eager, compiled = leaves(eager_out), leaves(compiled_out)
    if len(eager) != len(compiled):
        return True
    if any(a.shape != b.shape for (_, a), (_, b) in zip(eager, compiled)):
        return True
    return not _C.rows_pass(module, [(vocabulary.KIND_FWD_OUTPUT, a, b)
                                     for (_, a), (_, b) in zip(eager, compiled)
                                     if a.is_floating_point() or a.is_complex()], judging)


class ReferenceRun:
    """One call's reference: outputs, the input leaves and the parameters its backward needs."""

    def __init__(self, outputs: list, leaves: List[Tuple[int, torch.Tensor]],
                 params: List[Tuple[torch.Tensor, torch.Tensor]],
                 inputs: List[torch.Tensor] = ()):
        self.outputs = outputs  # (index, tensor) of the output leaves that require grad
        self.leaves = leaves  # (input index, upcast input leaf)
        self.params = params  # (real parameter, its upcast copy)
        self.inputs = list(inputs)  # every input as the reference ran on it (and wrote it)
        self.left: List[Tuple[int, torch.Tensor]] = []  # as PendingBackward.eager_left


@contextlib.contextmanager
def no_autocast(devices: set):
    """Autocast off on the call's device type (and on cpu): the reference computes in its own
    dtype, whatever the caller entered."""
    with contextlib.ExitStack() as stack:
        for device_type in {autocast_device_type(devices), "cpu"}:
            stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        yield


class WeightCopies:
    """Memory for the upcast copies of a module's weights that its references run on, reused from
    step to step. A copy is lent to one call (``take``) and comes back when the step that lent it
    is over (``reclaim``: every reference backward of the step has run); the next step's calls
    take the same memory and refresh its values. On the host, memory freed goes back to the
    system and a new copy page-faults it in again, zeroed: a fresh float32 copy of 18.9M bf16
    weights took 18 ms against 6 ms into kept memory (docs/performance.md). Only plain CPU tensors
    are kept: a device's caching allocator already reuses its memory, and a tensor subclass
    (DTensor) is copied as before. The kept copies are the memory a checked step holds at its
    peak anyway (every call's reference weights until the backward).

    A copy refreshed in place bumps its version counter, which it shares with what each call
    got: a graph that still saved an older step's copy fails its backward with autograd's
    in-place error instead of reading the new values."""

    def __init__(self) -> None:
        self.free: Dict[tuple, List[torch.Tensor]] = {}
        self.lent: List[Tuple[tuple, torch.Tensor]] = []

    def take(self, tensor: torch.Tensor, wide: torch.dtype) -> Optional[torch.Tensor]:
        """A copy of ``tensor`` in ``wide``, detached, in kept memory; None for a tensor this
        does not keep (the caller makes its copy as before)."""
        if (type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.device.type != "cpu"
                or tensor.layout != torch.strided):
            return None
        key = (tuple(tensor.shape), tensor.stride(), wide)
        kept = self.free.get(key)
        if kept:
            memory = kept.pop()
        else:
            with torch.inference_mode(False):  # a normal tensor, which any later step can use
                memory = torch.empty_like(tensor, dtype=wide, requires_grad=False)
            if memory.stride() != tensor.stride():  # overlapping or gapped strides
                return None
        memory.copy_(tensor.detach())
        self.lent.append((key, memory))
        return memory.detach()  # its own requires_grad, the same storage and version counter

    def reclaim(self) -> None:
        """The step is over: what it lent is free for the next."""
        for key, memory in self.lent:
            self.free.setdefault(key, []).append(memory)
        self.lent.clear()


@contextlib.contextmanager
def upcast_weights(module: nn.Module, dtype: torch.dtype, grad_mode: bool,
                   kept: Optional[WeightCopies] = None) -> Iterator[Dict[int, torch.Tensor]]:
    """Puts upcast copies of ``module``'s parameters and floating buffers in place of its own
    while the block runs (no deep copy of the module: FSDP2-sharded and other modules that cannot
    be copied get a reference too); yields {id(real parameter): its copy}. The copies of
    parameters that require grad are leaves of the reference's backward. ``kept``: where the
    copies' memory comes from, if anywhere."""
    copies: Dict[int, torch.Tensor] = {}
    swapped = []
    try:
        for owner in module.modules():
            for table in (owner._parameters, owner._buffers):
                for name, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    if id(tensor) not in copies:
                        copies[id(tensor)] = _upcast_weight(tensor, dtype, grad_mode, kept,
                                                            table is owner._parameters)
                    swapped.append((table, name, tensor))
                    table[name] = copies[id(tensor)]
        yield copies
    finally:
        for table, name, tensor in reversed(swapped):
            table[name] = tensor


def _upcast_weight(tensor: torch.Tensor, dtype: torch.dtype, grad_mode: bool,
                   kept: Optional[WeightCopies], is_parameter: bool) -> torch.Tensor:
    """A parameter's or buffer's copy for upcast_weights: a parameter already as wide as
    ``dtype`` is used as it is, a buffer always copied (the reference may update it in place)."""
    wide, copy = upcast_dtype(tensor, dtype), None
    if kept is not None and wide is not None and (wide != tensor.dtype or not is_parameter):
        copy = kept.take(tensor, wide)
    if copy is None:
        copy = upcast(tensor.detach(), dtype)
        if not is_parameter and copy.data_ptr() == tensor.data_ptr():
            copy = copy.clone()
    if grad_mode and tensor.requires_grad and is_parameter:
        copy.requires_grad_(True)
    return copy


def run_reference(module: nn.Module, forward: Callable, arguments, dtype: torch.dtype,
                  devices: set, grad_mode: bool, requires_grad: Callable[[int], bool],
                  written: FrozenSet[int], leaves_of: Callable, map_inputs: Callable,
                  kept: Optional[WeightCopies] = None) -> Tuple[object, Optional[ReferenceRun]]:
    """Runs ``forward`` (the module's original, uncompiled forward, a bound method) with the
    module's weights and the ``arguments`` upcast to ``dtype`` and autocast off; returns the
    output and, in grad mode, what the reference backward needs. ``written``: the inputs the
    training call wrote in place (_isolation.rerun_input); ``kept``: the weights' copies'
    memory (WeightCopies)."""
    args, kwargs, _ = arguments
    leaves: list = []
    args, kwargs = map_inputs(args, kwargs, rerun_input(grad_mode, requires_grad, written, leaves))
    real = {id(p): p for p in module.parameters() if p.requires_grad}
    with upcast_weights(module, dtype, grad_mode, kept) as copies, no_autocast(devices), \
            torch.set_grad_enabled(grad_mode):
        out = forward(*args, **kwargs)
    if not grad_mode:
        return out, None
    outputs = [(i, t) for i, (_, t) in enumerate(leaves_of(out)) if t.requires_grad]
    params = [(param, copies[key]) for key, param in real.items() if key in copies]
    return out, ReferenceRun(outputs, leaves, params, [t for _, t in input_leaves(args, kwargs)])
