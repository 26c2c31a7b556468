"""Single-pass mode's record of one checked call (``CheckedCall``), which the phases of
``SinglePass._checked_call`` fill in turn."""

from __future__ import annotations

import copy
from typing import Optional, Tuple

import torch

from dynaprobe._C import vocabulary
from dynaprobe._mechanics.capture import RngState, devices_of, input_leaves
from dynaprobe._mechanics.isolation import InputWrites, LeftInArguments, ModuleState, counterparts
from dynaprobe._mechanics.reference import CallReference, ReferenceRun
from dynaprobe._steps.step import CallShares, Step, Target


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
        self.candidate = None  # its replay data, until decided
        self.reference: Optional[ReferenceRun] = None
        self.shares: Optional[CallShares] = None  # grad mode: its parameters' gradient shares

    @property
    def wanted(self) -> Optional[torch.dtype]:
        """The dtype of its reference, up front or if failing; None: it gets none."""
        return self.decision.wanted

    def left_in_arguments(self) -> Tuple[list, list]:
        """What the compiled call left in its arguments (LeftInArguments) that requires grad, and
        its twins left by the eager re-run (and the reference) in their copies: ``(compiled,
        eager)`` lists of (index, tensor), indexed after the call's returned tensors. A later call
        reading them sends gradient back into this call: it seeds the eager backward too."""
        if self.left_watch is None:
            return [], []
        found = self.left_watch.find(self.args, self.kwargs,
                                     [t for _, t in self.compiled_leaves],
                                     [t for _, t in input_leaves(self.args, self.kwargs)])
        if not found:
            return [], []
        first = len(self.compiled_leaves)
        eager = [(first + position, twin)
                 for position, twin in counterparts(found, self.eager_args, self.eager_kwargs)]
        if self.reference is not None:
            args, kwargs, _ = self.reference_args
            self.reference.left = [(first + position, twin)
                                   for position, twin in counterparts(found, args, kwargs)]
        paired = {index for index, _ in eager}
        return [(first + p, t) for p, (_, t) in enumerate(found) if first + p in paired], eager

    def note_random_draws(self, rng_after: RngState, backend) -> None:
        """A training call that drew random numbers (dropout, torch.rand) under inductor, which
        draws its own unless ``fallback_random`` is set: its eager re-run drew other ones, and
        the report's next line says so."""
        if backend != "inductor":
            return
        import torch._inductor.config as inductor_config

        drawn = self.rng_before.drawn_until(rng_after)
        if drawn and not inductor_config.fallback_random:
            self.step.attributes.setdefault(self.name, {})[
                vocabulary.ATTRIBUTE_RANDOM_DRAWS] = ", ".join(drawn)

    def for_reference(self) -> "CheckedCall":
        """What running its reference later (SinglePass._late_reference) needs of this call:
        without the training call's arguments and outputs, the eager re-run's copies and replay
        data, which it does not."""
        kept = copy.copy(self)
        kept.args, kept.kwargs, kept.eager_args, kept.eager_kwargs = (), {}, (), {}
        kept.compiled_leaves, kept.eager_leaves, kept.leaves, kept.params = [], [], [], []
        kept.graph_calls = []
        kept.candidate = kept.left_watch = kept.watched = kept.shares = kept.writes = None
        return kept
