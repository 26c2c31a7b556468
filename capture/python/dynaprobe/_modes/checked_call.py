"""Single-pass mode's record of one checked call (``CheckedCall``), which the phases of
``SinglePass._checked_call`` fill in turn."""

from __future__ import annotations

import copy
from typing import Optional, Tuple

import torch

from dynaprobe._C.vocabulary import KIND_FWD_OUTPUT, SIDE_COMPILED, SIDE_EAGER, SIDE_REFERENCE
from dynaprobe._mechanics.capture import RngState, devices_of, input_leaves
from dynaprobe._mechanics.isolation import InputWrites, LeftInArguments, ModuleState, counterparts
from dynaprobe._mechanics.reference import CallReference, ReferenceRun
from dynaprobe._steps.shares import CallShares
from dynaprobe._steps.step import Step, Target


class CheckedCall:
    """One checked call of a target, handed from phase to phase of ``SinglePass._checked_call``:
    the training call's arguments (probed once grad mode is on), the eager re-run's copies of
    them, and what each phase found."""

    def __init__(self, step: Step, target: Target, args: tuple, kwargs: dict):
        self.step = step
        self.target = target
        self.name = target.name
        self.index = target.calls
        target.calls += 1
        self.args, self.kwargs = args, kwargs
        self.inputs = input_leaves(args, kwargs)
        self.devices = devices_of([t for _, t in self.inputs], target.module)
        self.grad_mode = torch.is_grad_enabled()
        self.eager_args, self.eager_kwargs = (), {}
        self.decision = CallReference(None, None)  # its reference: up front, or if failing
        self.reference_args = None
        self.writes: Optional[InputWrites] = None  # the inputs the training call writes
        self.written: frozenset = frozenset()
        self.state_before: Optional[ModuleState] = None
        self.rng_before: Optional[RngState] = None
        self.watched = None  # replay: the module's parameters and buffers watched
        self.params: list = []
        self.left_watch: Optional[LeftInArguments] = None
        self.graph_calls: list = []
        self.eager_out = None
        self.leaves: list = []  # (input index, eager input leaf)
        self.compiled_leaves: list = []  # (label, tensor) of the outputs, each side's
        self.eager_leaves: list = []
        self.written_out: list = []  # record_written_results: (compiled, eager, reference)
        self.candidate = None  # its replay data, until decided
        self.reference: Optional[ReferenceRun] = None
        # float32, grad mode: its reference is decided once its backward has run, from its
        # verdicts (CallReferences.late), the recorder holding its pairs meanwhile
        # (Step.hold_for_reference)
        self.holds_reference = False
        self.left_found: list = []  # left_in_arguments: (path, tensor) of what it left
        self.shares: Optional[CallShares] = None  # grad mode: its parameters' gradient shares

    @property
    def wanted(self) -> Optional[torch.dtype]:
        """The dtype of its reference, up front or if failing; None: it gets none."""
        return self.decision.wanted

    def record_written_results(self) -> None:
        """The inputs the call wrote in place and does not return (a module that adds its result
        into a tensor it is given) are results of the call as much as what it returns: recorded
        as forward outputs after it, each side's (the caller's tensor after the training call,
        its copy after the eager re-run, after the reference), and kept in ``written_out``."""
        if not self.written:  # the common case: nothing more to look at on the training thread
            return
        returned = {t.untyped_storage().data_ptr()
                    for _, t in self.compiled_leaves + self.eager_leaves}
        eager_inputs = input_leaves(self.eager_args, self.eager_kwargs)
        for index in sorted(self.written):
            label, tensor = self.inputs[index]
            twin = eager_inputs[index][1]
            if (tensor.untyped_storage().data_ptr() in returned
                    or twin.untyped_storage().data_ptr() in returned):
                continue  # ReLU(inplace=True): returned, so an output already
            wide = None if self.reference is None else self.reference.inputs[index]
            at = len(self.compiled_leaves) + len(self.written_out)
            for side, value in ((SIDE_COMPILED, tensor), (SIDE_EAGER, twin),
                                (SIDE_REFERENCE, wide)):
                if value is not None:
                    self.step.record(self.name, self.index, KIND_FWD_OUTPUT, at, side, value,
                                     f"{label} written")
            self.written_out.append((tensor, twin, wide))

    def left_in_arguments(self) -> Tuple[list, list]:
        """The inputs the training call wrote and does not return (``written_out``), then what it
        left in its arguments (LeftInArguments), that require grad, and their twins in the eager
        re-run's copies (and the reference's, left_in_reference): ``(compiled, eager)`` lists of
        (index, tensor), indexed after the call's returned tensors. A later use of them sends
        gradient back into this call: it seeds the eager backward too."""
        first = len(self.compiled_leaves)
        compiled, eager = [], []
        for at, (tensor, twin, _) in enumerate(self.written_out, first):
            if tensor.requires_grad and twin.requires_grad:
                compiled.append((at, tensor))
                eager.append((at, twin))
        first += len(self.written_out)
        found = [] if self.left_watch is None else self.left_watch.find(
            self.args, self.kwargs, [t for _, t in self.compiled_leaves],
            [t for _, t in input_leaves(self.args, self.kwargs)])
        self.left_found = found
        if found:
            twins = [(first + position, twin)
                     for position, twin in counterparts(found, self.eager_args, self.eager_kwargs)]
            eager += twins
            paired = {index for index, _ in twins}
            compiled += [(first + p, t) for p, (_, t) in enumerate(found) if first + p in paired]
        if self.reference is not None:
            self.left_in_reference()
        return compiled, eager

    def left_in_reference(self) -> None:
        """The reference's twins of what the call left (left_in_arguments, which found them):
        the inputs it wrote, as the reference ran on them, and what the reference left in its
        copies of the arguments."""
        first = len(self.compiled_leaves)
        left = [(at, wide) for at, (tensor, twin, wide) in enumerate(self.written_out, first)
                if tensor.requires_grad and twin.requires_grad and wide is not None
                and wide.requires_grad]
        first += len(self.written_out)
        args, kwargs, _ = self.reference_args
        left += [(first + position, twin)
                 for position, twin in counterparts(self.left_found, args, kwargs)]
        self.reference.left = left

    def for_reference(self) -> "CheckedCall":
        """What running its reference later (CallReferences.late) needs of this call:
        without the training call's arguments and outputs, the eager re-run's copies and replay
        data, which it does not."""
        kept = copy.copy(self)
        kept.args, kept.kwargs, kept.eager_args, kept.eager_kwargs = (), {}, (), {}
        kept.compiled_leaves, kept.eager_leaves, kept.leaves, kept.params = [], [], [], []
        kept.graph_calls, kept.left_found = [], []
        kept.candidate = kept.left_watch = kept.watched = kept.shares = kept.writes = None
        return kept
