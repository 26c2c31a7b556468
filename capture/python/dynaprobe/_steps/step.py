"""One checked step: the compile targets, what is recorded for them until collect(), and the
eager backwards waiting for their grad_output (single-pass)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from dynaprobe._C import vocabulary
from dynaprobe._C.vocabulary import (
    KIND_GRAD_INPUT,
    KIND_GRAD_OUTPUT,
    KIND_PARAM_GRAD,
    SIDE_COMPILED,
    SIDE_EAGER,
    SIDE_REFERENCE,
)
from dynaprobe._mechanics.capture import Shard, _eager_backward, _in_eager_backward, local_tensor

if TYPE_CHECKING:  # session.py builds on this module
    from dynaprobe._steps.session import StepSession

LOSS_MODULE = vocabulary.LOSS_MODULE  # formats::kLossModule


class Target:
    """A wrapped module that is a compile target, and how it is run on this side."""

    def __init__(self, name: str, module: nn.Module, run: Callable, eager: Optional[Callable]):
        self.name = name
        self.module = module
        self.run = run  # what the model executes: compiled (or eager on a two-pass eager copy)
        self.eager = eager  # single-pass: the original forward, re-run eagerly
        # Single-pass: the parameters of the latest call (under FSDP2 the full parameters the
        # forward used, registered in place of the DTensor shards while it runs).
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # FSDP2/DTensor-sharded parameters by name: this rank's shard, to cut gradients to.
        self.shards = {n: s for n, s in ((n, Shard.of(p)) for n, p in self.params) if s}
        self.calls = 0
        # Single-pass: its parameters' gradient sums are judged once its backward is done
        # (Step.judge_ahead), until a step adds to them after that (gradient accumulation).
        self.judge_ahead = True


class Step:
    """Everything captured during one step, until it is finished (collect(), compare(),
    capture()). Records go straight to the recorder; a recorder error (disk full) is kept and
    raised when the step is finished, so that training goes on meanwhile."""

    def __init__(self, recorder, index: int):
        self.recorder = recorder
        self.index = index
        self.pending: List[PendingBackward] = []
        # Summed per side, keyed by id(parameter); "reference" (the reference's gradients) is
        # keyed by the real parameter in single-pass, by the reference copy's in two-pass.
        self.param_grads: Dict[str, Dict[int, torch.Tensor]] = {
            SIDE_EAGER: {}, SIDE_COMPILED: {}, SIDE_REFERENCE: {}}
        # Single-pass, by id(parameter): whether the compiled side's sum is the parameter's
        # share of each checked call (CallShares found every call's), not all the training
        # backward gave it, which includes its uses outside the calls.
        self.by_call: Dict[int, bool] = {}
        # Single-pass, by module: [eager backwards run, reference backwards run]. A parameter's
        # reference sum stands for the module only when every call's backward had a reference.
        self.backwards: Dict[str, List[int]] = {}
        # Single-pass, by id(parameter): the (eager, compiled) sums judged ahead (judge_ahead).
        self.judged_ahead: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.shards: Dict[int, Shard] = {}  # id(full parameter) -> this rank's shard (FSDP2)
        self.notes: Dict[str, Tuple[str, str]] = {}
        self.attributes: Dict[str, Dict[str, str]] = {}  # per module, for /modules
        # (module, call) -> its replay data, held until decided (SinglePass.decide_replays)
        self.replay_candidates: Dict[Tuple[str, int], object] = {}
        self.decision_queued = False  # a decision waits for the end of the backward pass
        # Single-pass, float32: calls whose late reference is decided at the end of the backward
        # pass, with the pairs of gradients to decide it from (PendingBackward.run)
        self.late_decisions: List[Tuple[PendingBackward, Callable, list]] = []
        # Single-pass, float32: (module, call) -> the decision of its reference, for the calls
        # whose pairs the recorder holds until it is taken (hold_for_reference)
        self.held_references: Dict[Tuple[str, int], Callable[[list], object]] = {}
        self.error: Optional[BaseException] = None
        # Backward hooks may run on autograd's device threads; the recorder takes one call at a
        # time.
        self.lock = threading.Lock()

    def record(self, module: str, call: int, kind: str, index: int, side: str,
               tensor: torch.Tensor, label: str = "", handed_over: bool = False) -> None:
        """``handed_over``: ``tensor`` is the step's own copy, which nothing changes afterwards:
        the recorder keeps it without copying it again."""
        if self.error is not None:
            return
        try:
            with self.lock:
                self.recorder.record(module, call, kind, index, side,
                                     local_tensor(tensor.detach()), label, handed_over)
        except ValueError as error:  # this tensor cannot be recorded (meta, fake, ...): the step
            # goes on without it, and the module's HOOK_ERROR row says why
            self.note(module, vocabulary.NOTE_HOOK_ERROR,
                      f"{kind}[{index}] of the {side} side not recorded: {error}")
        except Exception as error:  # the step is lost: reported by collect(), training goes on
            self.error = error

    def record_loss(self, side: str, loss) -> None:
        """The step's loss (a tensor or a number), as the LOSS record of ``side``."""
        value = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self.record(LOSS_MODULE, 0, vocabulary.KIND_LOSS, 0, side, value.reshape(()))

    def add_param_grad(self, side: str, param: torch.Tensor, grad: torch.Tensor,
                       owned: bool = False) -> None:
        """Adds ``grad`` to ``side``'s sum for ``param``. ``owned``: ``grad`` is the checker's
        own result, which nothing else holds or changes (see PendingBackward.run), kept as it is;
        any other gradient is copied, since training may change it in place (accumulation into
        ``.grad``, gradient clipping)."""
        sums = self.param_grads[side]
        key = id(param)
        shard = self.shards.get(key)
        grad = shard.cut(grad.detach()) if shard is not None else grad.detach()
        if key in sums:
            sums[key] = sums[key] + grad
        else:
            sums[key] = grad if owned and shard is None else self.recorder.copy(grad)

    def awaits_backward(self, target: Target) -> bool:
        """Whether a call of ``target`` still waits for its eager backward: its parameters'
        gradient sums are not final."""
        return any(p.target is target and not p.done for p in self.pending)

    def judge_ahead(self, target: Target) -> None:
        """Single-pass: once every call of ``target`` so far has run its eager backward, the
        recorder judges its parameters' gradient sums in the background while training goes on
        (Recorder.judge_later), each side against the reference too where every call had one,
        instead of at collect(). collect() records the same sums unless a later call added to
        them, and the recorder then takes those metrics. A target whose sums grow after being
        judged (several backwards a step: gradient accumulation) is judged at collect() from
        then on (here, and record_shared_param_grads)."""
        if not target.judge_ahead or self.error is not None or self.awaits_backward(target):
            return
        if any(id(param) in self.judged_ahead for _, param in target.params):
            target.judge_ahead = False
            return
        counts = self.backwards.get(target.name, [0, 0])
        try:
            with self.lock:
                for _, param in target.params:
                    key = id(param)
                    eager = self.param_grads[SIDE_EAGER].get(key)
                    compiled = self.param_grads[SIDE_COMPILED].get(key)
                    if eager is None or compiled is None or not self.by_call.get(key, False):
                        continue  # by_call: its compiled sum is final only after the backward
                    reference = self.param_grads[SIDE_REFERENCE].get(key) \
                        if counts[1] == counts[0] else None
                    self.recorder.judge_later(target.name, eager, compiled, reference)
                    self.judged_ahead[key] = (eager, compiled)
        except Exception as error:  # the step is lost: reported by collect(), training goes on
            self.error = error

    def record_param_grads(self, pairs) -> None:
        """The summed parameter gradients of each target. ``pairs``: (target name,
        [(param name, eager param, compiled param, reference param)]), a side's param None when
        it has none (single-pass and whole-model mode key every side by the real parameter)."""
        for name, params in pairs:
            for index, (param_name, *by_side) in enumerate(params):
                compiled_param = by_side[1]
                shard = self.shards.get(id(compiled_param))
                label = param_name if shard is None else (
                    f"{param_name} ({shard.describe()}, this rank's batch, before "
                    f"reduce-scatter)")
                counts = self.backwards.get(name)
                partial = counts is not None and counts[1] != counts[0]
                for side, param in zip((SIDE_EAGER, SIDE_COMPILED, SIDE_REFERENCE), by_side):
                    if side == SIDE_REFERENCE and partial:
                        continue
                    grad = None if param is None else self.param_grads[side].get(id(param))
                    if grad is not None:  # the step's own sum (add_param_grad)
                        self.record(name, 0, KIND_PARAM_GRAD, index, side, grad, label,
                                    handed_over=True)

    def defer_late_reference(self, pending: PendingBackward, late: Callable[[list], object],
                             pairs: list) -> None:
        """Decides ``pending``'s late reference from ``pairs`` when this backward pass ends (now
        outside one). Meanwhile the recorder judges the parameters' gradient sums on its
        background thread (judge_ahead), so that the decision takes those verdicts
        (Recorder.judge_pair) instead of judging them on the training thread, call by call.
        Decided now while another call of its module waits for its backward: its sums are not
        final, so none are judged ahead, and the pairs would hold them."""
        if self.awaits_backward(pending.target):
            pending.decide_late_reference(late, pairs)
            return
        self.late_decisions.append((pending, late, pairs))
        if len(self.late_decisions) > 1:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.decide_late_references)
        except RuntimeError:  # not inside a backward pass
            self.decide_late_references()

    def decide_late_references(self) -> None:
        """Decides the late references deferred so far (defer_late_reference), in call order."""
        decisions, self.late_decisions = self.late_decisions, []
        for pending, late, pairs in decisions:
            pending.decide_late_reference(late, pairs)

    def hold_for_reference(self, module: str, call: int, late: Callable[[list], object]) -> None:
        """Before a call's records: the recorder holds its pairs (parameter gradients aside)
        until ``late``, the decision of its reference, is taken (settle_reference), judging each
        meanwhile, so that ``late`` decides from their verdicts. Nothing is held once the step is
        lost (its late reference then looks at its gradients only)."""
        if self._tell_recorder(self.recorder.hold_for_reference, module, call):
            self.held_references[(module, call)] = late

    def settle_reference(self, module: str, call: int) -> None:
        """A held call's reference is decided and, if any, recorded: the recorder judges the
        pairs still waiting for it without one."""
        if self.held_references.pop((module, call), None) is not None:
            self._tell_recorder(self.recorder.settle_reference, module, call)

    def _tell_recorder(self, method: Callable, *args) -> bool:
        """``method(*args)`` of the recorder, unless the step is lost; an error loses the step
        (reported by collect(); training goes on). Whether it was told."""
        if self.error is not None:
            return False
        try:
            with self.lock:
                method(*args)
        except Exception as error:
            self.error = error
            return False
        return True

    def note(self, module: str, note: str, reason: str) -> None:
        self.notes.setdefault(module, (note, reason))

    def note_random_draws(self, module: str, generators: List[str]) -> None:
        """A call of ``module`` drew random numbers from ``generators`` (``cpu``, ``cuda:0``)
        under a backend that draws its own (``draws_its_own_random``): the module attribute
        ``random_draws``, which the report's next line names."""
        if generators:
            self.attributes.setdefault(module, {})[vocabulary.ATTRIBUTE_RANDOM_DRAWS] = (
                ", ".join(generators))

    def reference_missing(self, module: str, reason: str) -> None:
        """A call of ``module`` got no (or only part of its) reference: counted, with the first
        reason, in /modules; the report gives the module a NO_REFERENCE row."""
        attributes = self.attributes.setdefault(module, {})
        count = int(attributes.get(vocabulary.ATTRIBUTE_REFERENCE_MISSING, "0")) + 1
        attributes[vocabulary.ATTRIBUTE_REFERENCE_MISSING] = str(count)
        attributes.setdefault(vocabulary.ATTRIBUTE_REFERENCE_ERROR, reason)


class PendingBackward:
    """Single-pass: the eager re-run of one call, waiting for the real backward to deliver the
    grad_output its compiled twin received."""

    def __init__(self, step: Step, target: Target, call: int, eager_outputs: list,
                 leaves: list, params: list, reference=None, eager_left: list = ()):
        self.step = step
        self.reference = reference  # _reference.ReferenceRun of this call, if any
        self.target = target
        self.call = call
        self.params = params  # the parameters this call's eager forward used
        self.eager_outputs = eager_outputs  # (index, tensor) pairs that require grad
        # (index, tensor) the eager re-run left in its arguments (_isolation.LeftInArguments),
        # indexed after the outputs; seeded only where their compiled twins got a gradient
        self.eager_left = list(eager_left)
        self.hooks: list = []  # on the compiled twins of eager_left, removed once run
        self.leaves = leaves  # (input index, eager input leaf)
        self.grads: Dict[int, torch.Tensor] = {}
        # The compiled call's gradients of its inputs that have arrived, by input index
        self.compiled_grad_inputs: Dict[int, torch.Tensor] = {}
        # A call without a reference: given the pairs of gradients known when its eager backward
        # has run ((kind, eager, compiled)), its reference if they fail (SinglePass)
        self.late_reference: Optional[Callable[[list], object]] = None
        self.done = False

    def on_output_grad(self, index: int, grad: torch.Tensor) -> None:
        self.grads[index] = grad.detach()

    def grad_hook(self, index: int) -> Callable:
        """A tensor hook keeping the gradient of output ``index``, changing nothing."""
        def hook(grad: Optional[torch.Tensor]) -> None:
            if grad is not None:
                self.on_output_grad(index, grad)

        return hook

    def run(self) -> None:
        """Runs the eager backward with the grad_output the compiled module received."""
        if self.done or not self.grads:
            return
        self.done = True
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        outputs, grad_outputs = seeds(self.eager_outputs, self.eager_left, self.grads)
        params = [p for _, p in self.params]
        inputs = [leaf for _, leaf in self.leaves] + params
        if inputs:
            try:
                with _eager_backward(), torch.enable_grad():
                    grads = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
            except Exception as error:  # never break the training backward because of the checker
                self.step.note(self.target.name, vocabulary.NOTE_HOOK_ERROR,
                               f"eager backward failed: {type(error).__name__}: {error}")
                grads = ()
            for (index, leaf), grad in zip(self.leaves, grads):
                if grad is not None:
                    self.step.record(self.target.name, self.call, KIND_GRAD_INPUT, index, SIDE_EAGER, grad)
            for param, grad in zip(params, grads[len(self.leaves):]):
                if grad is not None:
                    self.step.add_param_grad(SIDE_EAGER, param, grad,
                                             owned=not shares_storage(grad, grad_outputs))
            if self.reference is None and self.late_reference is not None:
                self.step.defer_late_reference(self, self.late_reference,
                                               self._gradient_pairs(grads, params))
        self.late_reference = None
        counts = self.step.backwards.setdefault(self.target.name, [0, 0])
        counts[0] += 1
        if self.reference is not None and self._run_reference():
            counts[1] += 1
        self.eager_outputs = self.eager_left = self.leaves = self.params = []
        self.reference = None
        self.step.judge_ahead(self.target)

    def decide_late_reference(self, late: Callable[[list], object], pairs: list) -> None:
        """A call without a reference whose eager backward has run: its reference, run now with
        its backward, if any of ``pairs`` fails (``late``: CallReferences.late)."""
        self.reference = late(pairs)
        if self.reference is not None and self._run_reference():
            self.step.backwards.setdefault(self.target.name, [0, 0])[1] += 1
        self.reference = None
        self.step.settle_reference(self.target.name, self.call)

    def _gradient_pairs(self, grads, params: list) -> list:
        """(kind, eager, compiled) of this call's gradients known now: its grad_outputs (both
        sides' own), the inputs' gradients the compiled call has delivered, and the parameters'
        sums of the calls whose backward has run (the backward reaches calls last to first),
        where both sides are this call's own."""
        pairs = [(KIND_GRAD_OUTPUT, grad, grad) for grad in self.grads.values()]  # the magnitude
        pairs += [(KIND_GRAD_INPUT, grad, self.compiled_grad_inputs[index])
                  for (index, _), grad in zip(self.leaves, grads)
                  if grad is not None and index in self.compiled_grad_inputs]
        sums = self.step.param_grads
        for param in params:
            key = id(param)
            if self.step.by_call.get(key) and key in sums[SIDE_EAGER] and key in sums[SIDE_COMPILED]:
                pairs.append((KIND_PARAM_GRAD, sums[SIDE_EAGER][key], sums[SIDE_COMPILED][key]))
        return pairs

    def _run_reference(self) -> bool:
        """The reference's backward, seeded with the same grad_output (upcast); whether it ran."""
        reference = self.reference
        outputs, grad_outputs = seeds(reference.outputs, reference.left, self.grads)
        inputs = [leaf for _, leaf in reference.leaves] + [p for _, p in reference.params]
        if not outputs or not inputs:
            return False
        try:
            with _eager_backward(), torch.enable_grad():
                grads = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
        except Exception as error:  # never break the training backward because of the checker
            self.step.reference_missing(self.target.name,
                                        f"backward: {type(error).__name__}: {error}")
            return False
        for (index, _), grad in zip(reference.leaves, grads):
            if grad is not None:
                self.step.record(self.target.name, self.call, KIND_GRAD_INPUT, index, SIDE_REFERENCE,
                                 grad)
        for (param, _), grad in zip(reference.params, grads[len(reference.leaves):]):
            if grad is not None:
                self.step.add_param_grad(SIDE_REFERENCE, param, grad,
                                         owned=not shares_storage(grad, grad_outputs))
        return True

    def params_freed(self) -> bool:
        """FSDP2 frees the full parameters' storage when it reshards after the backward: the
        eager graph, which saved them, cannot run any more."""
        return any(p.untyped_storage().size() == 0 and p.numel() > 0 for _, p in self.params)


def seeds(outputs: list, left: list, grads: Dict[int, torch.Tensor]):
    """The (outputs, grad_outputs) of an eager or reference backward: every output that requires
    grad, seeded with the gradient its compiled twin received (zeros if none, or of another shape),
    and the tensors the call left in its arguments that received one, in the output's dtype."""
    tensors, seeded = [], []
    for index, tensor in outputs:
        grad = grads.get(index)
        tensors.append(tensor)
        seeded.append(grad.to(tensor.dtype) if grad is not None and grad.shape == tensor.shape
                      else torch.zeros_like(tensor))
    for index, tensor in left:
        grad = grads.get(index)
        if grad is not None and grad.shape == tensor.shape:
            tensors.append(tensor)
            seeded.append(grad.to(tensor.dtype))
    return tensors, seeded


def shares_storage(grad: torch.Tensor, grad_outputs: List[torch.Tensor]) -> bool:
    """Whether an ``autograd.grad`` result is (a view of) one of the grad_outputs it was seeded
    with, which belong to the training backward: a parameter used as ``x + p`` gets its
    grad_output itself as its gradient. Any other result is a fresh tensor of the checker's."""
    storage = grad.untyped_storage().data_ptr()
    return any(g.untyped_storage().data_ptr() == storage for g in grad_outputs)


def run_pending(step: Step, unreached: str) -> None:
    """Runs the eager backwards still pending before the step is written. One whose full
    parameters FSDP2 has freed since cannot run: it is noted, with ``unreached``, the gradient
    the step's backward never delivered."""
    for pending in step.pending:
        if not pending.done and pending.grads and pending.params_freed():
            step.note(pending.target.name, vocabulary.NOTE_HOOK_ERROR,
                      f"eager backward not run: {unreached} during the backward, and FSDP2 has "
                      "since freed the full parameters it saved")
            continue
        pending.run()
    step.pending.clear()
    step.decide_late_references()
    for (module, call), late in list(step.held_references.items()):  # their backward never ran
        late([])
        step.settle_reference(module, call)


def record_shared_param_grads(step: Step, targets: List[Target]) -> None:
    """Single-pass and whole-model mode: the summed parameter gradients of ``targets``, every
    side's sum keyed by the real parameter. A target whose sums were judged ahead and added to
    since (several backwards a step) is no longer judged ahead: that judging was wasted."""
    sums = step.param_grads
    for target in targets:
        for _, param in target.params:
            judged = step.judged_ahead.get(id(param))
            if judged is not None and (judged[0] is not sums[SIDE_EAGER].get(id(param))
                                       or judged[1] is not sums[SIDE_COMPILED].get(id(param))):
                target.judge_ahead = False
    step.record_param_grads([(t.name, [(n, p, p, p) for n, p in t.params]) for t in targets])


def compiled_param_grad_hook(session: StepSession, param: torch.Tensor):
    """A hook for ``param.register_hook``: adds the training backward's gradient of ``param`` to
    the compiled-side sum of the step ``session`` has begun, if any
    (the checker's own eager backward is left out)."""
    def hook(grad: Optional[torch.Tensor]) -> None:
        # Autograd hands hooks None for a gradient it left undefined (AXK2): zero, nothing to add.
        step = session.step
        # A parameter split by call (CallShares) gets its compiled sum from its calls' shares.
        if step is not None and grad is not None and not _in_eager_backward() \
                and not step.by_call.get(id(param), False):
            step.add_param_grad(SIDE_COMPILED, param, grad)

    return hook
