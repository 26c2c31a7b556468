"""Single-pass: the reference of a checked call (reference.py runs it), run in its forward, or
decided later from its verdicts (a float32 call whose outputs or gradients fail)."""

from __future__ import annotations

from typing import Callable, Optional

from dynaprobe import _C
from dynaprobe._C.vocabulary import KIND_FWD_OUTPUT, SIDE_REFERENCE
from dynaprobe._mechanics.capture import RngState, map_tensors, tensor_leaves
from dynaprobe._mechanics.isolation import ModuleState
from dynaprobe._mechanics.reference import ReferenceRun, run_reference, shapes_differ
from dynaprobe._modes.checked_call import CheckedCall
from dynaprobe._modes.once import IN_CALL, OnceWarnings
from dynaprobe._steps.session import StepSession


class CallReferences:
    """The references of one installation's calls: run on the session's weight copies, decided
    with ``tolerances`` (what "failing" means); one that cannot run is said once per module."""

    def __init__(self, tolerances: _C.Judging, session: StepSession, warn_once: OnceWarnings):
        self.tolerances = tolerances
        self.session = session
        self._warn_once = warn_once

    def run(self, call: CheckedCall) -> Optional[ReferenceRun]:
        """Runs and records the reference of this call in the dtype it wants; what its backward
        needs. A reference that cannot run (an op without a kernel for the dtype, ...) is a
        NO_REFERENCE row of the report and a warning."""
        step, target, dtype, inputs = call.step, call.target, call.wanted, call.inputs
        try:
            out, run = run_reference(target.module, target.eager, call.reference_args, dtype,
                                     call.devices, call.grad_mode,
                                     lambda index: inputs[index][1].requires_grad,
                                     call.written, tensor_leaves, map_tensors,
                                     self.session.weight_copies)
        except Exception as error:
            what = f"{type(error).__name__}: {error}"
            step.reference_missing(target.name, what)
            self._warn_once(target.name, "reference",
                            f"dynaprobe: {target.name}: the {dtype} reference could not run "
                            f"({what}); its rows are judged by the tolerances alone",
                            stacklevel=IN_CALL)
            return None
        leaves = tensor_leaves(out)
        differ = shapes_differ([t for _, t in leaves],
                               [t for _, t in tensor_leaves(call.eager_out)])
        if differ:
            step.reference_missing(target.name, differ)
            return None
        for index, (label, tensor) in enumerate(leaves):
            step.record(target.name, call.index, KIND_FWD_OUTPUT, index, SIDE_REFERENCE, tensor,
                        label)
        return run

    def late(self, call: CheckedCall) -> Callable[[list], Optional[ReferenceRun]]:
        """For a call whose forward got no reference but that may want one: given the pairs of
        its gradients known when its eager backward has run, the reference of the call if any
        pair fails (a gradient that sums terms which cancel, as a batch norm's weight gradient)
        or, for a call the recorder holds (Step.hold_for_reference), any of its pairs judged
        there (its outputs, its inputs' gradients). Run from the module's state, RNG state and
        upcast inputs before the training call when the backward pass ends
        (Step.defer_late_reference), or at collect() for a call whose backward never ran; a held
        call is then settled (Step.settle_reference) by the caller, once the reference's backward
        has recorded its gradients. ``call``: CheckedCall.for_reference()."""
        step = call.step

        def late(pairs: list) -> Optional[ReferenceRun]:
            try:
                held = (call.name, call.index) in step.held_references
                if not (held and step.recorder.fails_before_reference(call.name, call.index)) \
                        and _C.rows_pass(call.name, pairs, self.tolerances, step.recorder):
                    return None
                module = call.target.module
                state_now, rng_now = ModuleState(module), RngState(call.devices)
                try:
                    call.state_before.apply()
                    call.rng_before.restore()
                    return self.run(call)
                finally:
                    state_now.apply()
                    rng_now.restore()
            except Exception as error:  # never break the training backward because of the checker
                step.reference_missing(call.name, f"{type(error).__name__}: {error}")
                return None
            finally:
                call.reference_args = None

        return late
