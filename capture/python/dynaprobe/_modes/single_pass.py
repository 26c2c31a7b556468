"""Single-pass: the wrapped modules compiled in place; every call runs compiled (the training
path) and again eagerly on copies of its arguments (isolation.py), and the eager re-run's backward
runs inside the real backward, seeded with the grad_output its compiled twin received, through
``torch.autograd.grad``, which never touches ``.grad``."""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import torch

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._C.vocabulary import (
    KIND_FWD_INPUT,
    KIND_FWD_OUTPUT,
    KIND_GRAD_INPUT,
    KIND_GRAD_OUTPUT,
    SIDE_COMPILED,
    SIDE_EAGER,
)
from dynaprobe._mechanics import replay_store
from dynaprobe._mechanics.capture import (
    ProbedInputs,
    RngState,
    autocast_context,
    draws_its_own_random,
    input_leaves,
    map_tensors,
    patch_forward,
    probe_outputs,
    tensor_leaves,
)
from dynaprobe._mechanics.isolation import (
    InputWrites,
    LeftInArguments,
    ModuleGlobals,
    ModuleState,
    copy_arguments,
    rerun_input,
)
from dynaprobe._mechanics.reference import (
    ReferencePolicy,
    accelerator_draws,
    copy_reference_arguments,
    outputs_differ,
)
from dynaprobe._modes.call_references import CallReferences
from dynaprobe._modes.checked_call import CheckedCall
from dynaprobe._modes.once import IN_CALL, OnceWarnings
from dynaprobe._modes.replays import ReplayKeeping
from dynaprobe._steps.compiling import Compiler
from dynaprobe._steps.planning import Plan, warn_nested_fully_shard
from dynaprobe._steps.session import StepSession
from dynaprobe._steps.shares import CallShares
from dynaprobe._steps.step import (
    PendingBackward,
    Step,
    Target,
    compiled_param_grad_hook,
    record_shared_param_grads,
    run_pending,
)


def install(model: torch.nn.Module, plan: Plan, session: StepSession, compiler: Compiler,
            **options) -> "SinglePass":
    """install() per module: each target of ``plan`` compiled in place through ``compiler`` and
    re-run eagerly through its own forward; ``options``: SinglePass's."""
    modules = dict(model.named_modules())
    targets = []
    for display, name in plan.targets:
        module = modules[name]
        original = module.forward
        targets.append(Target(display, module, compiler.compile(display, original), original))
        # said to the caller of PrecisionChecker.install()
        warn_nested_fully_shard(plan.modules, display, module, stacklevel=4)
    return SinglePass(targets, session, compiler, **options)


class SinglePass:
    """The installation on one model: its targets, their patched forwards and hooks.

    ``session`` gives the step being checked (``current``, begun by the first wrapped call),
    None in a step that is not checked (the compiled modules then run alone), and the step begun
    if any (``step``: hooks firing outside a step do nothing). ``compiler`` compiled the targets
    (its graphs, for replays, and what a step learned of them)."""

    def __init__(self, targets: List[Target], session: StepSession, compiler: Compiler,
                 capture_input: bool, cast_dtype, reference: ReferencePolicy,
                 tolerances: _C.Judging, replay: str = "none", backend=None):
        self.targets = targets
        self.session = session
        self.compiler = compiler
        self.capture_input = capture_input
        self.cast_dtype = cast_dtype
        self.reference = reference  # which calls get a reference, in which dtype
        self.tolerances = tolerances  # what "failing" means
        self.backend = backend
        self.graphs = compiler.graphs  # the GraphRecorder: the runs of compiled graphs
        self.restore: List[Callable[[], None]] = []
        self.hooked: Dict[object, torch.Tensor] = {}  # parameters given hooks
        self._warn_once = OnceWarnings()
        self.references = CallReferences(tolerances, session, self._warn_once)
        self.replays = ReplayKeeping(replay, backend, cast_dtype, self.graphs, self._warn_once)
        for target in targets:
            self.restore.append(patch_forward(target.module, self._forward(target)))

    def remove(self) -> None:
        """Restores the original forwards and removes every hook."""
        for undo in reversed(self.restore):
            undo()
        self.restore.clear()
        self.hooked.clear()

    def finish(self, step: Step) -> None:
        """Runs the eager backwards still pending (the step's backward did not reach their
        inputs or parameters) before the step is written."""
        run_pending(step, "no gradient reached the module's inputs or parameters")

    def conclude(self, step: Step) -> None:
        """collect(), once the step has run: what it learned of each target, the summed
        parameter gradients, and the replay data of the calls not yet decided."""
        self.compiler.summarize(step, self.targets)
        record_shared_param_grads(step, self.targets)
        self.replays.decide(step, final=True)

    def _forward(self, target: Target) -> Callable:
        def forward(*args, **kwargs):
            step = self.session.current(self.targets)
            if step is None:  # a step that is not checked: the compiled module only
                return target.run(*args, **kwargs)
            return self._checked_call(step, target, args, kwargs)

        return forward

    # ------------------------------------------------------------------ the checked call
    def _checked_call(self, step: Step, target: Target, args: tuple, kwargs: dict):
        """A call of a target in a checked step: the training call runs compiled, then the
        eager re-run on copies of its arguments, and both are recorded; their backwards meet
        in the training backward (PendingBackward)."""
        call = CheckedCall(step, target, args, kwargs)
        try:
            self._prepare_rerun(call)
        except Exception as error:  # never break training because of the checker
            step.note(call.name, vocabulary.NOTE_HOOK_ERROR, f"{type(error).__name__}: {error}")
            return target.run(*args, **kwargs)
        if call.grad_mode:
            self._probe_inputs(call)
        compiled_out = self._run_compiled(call)
        if not self._rerun_eagerly(call, compiled_out):
            return compiled_out
        left, eager_left = self._record_outputs(call, compiled_out)
        if not call.grad_mode:
            return compiled_out
        return self._await_backward(call, compiled_out, left, eager_left)

    def _prepare_rerun(self, call: CheckedCall) -> None:
        """Before the training call: its inputs recorded, copies of its arguments for the eager
        re-run (and the reference, in the dtype it needs), the module's state and RNG state,
        what replay watches, and the parameters the call uses."""
        step, name, module = call.step, call.name, call.target.module
        if self.capture_input:
            # Single-pass feeds both sides the same inputs: recorded once, for both.
            for index, (label, tensor) in enumerate(call.inputs):
                step.record(name, call.index, KIND_FWD_INPUT, index, SIDE_COMPILED, tensor, label)
        # Copies taken before the training call, which may change its inputs (a cache it
        # appends to, a tensor modified in place) and its module's state.
        call.eager_args, call.eager_kwargs, shared = copy_arguments(
            call.args, call.kwargs, lambda i, t: t.detach().clone())
        if shared:
            self._warn_shared_arguments(step, name, shared)
        call.decision = self.reference.for_call(step, name, [t for _, t in call.inputs], module,
                                                self.cast_dtype, call.devices)
        call.reference_args = copy_reference_arguments(call.args, call.kwargs, call.wanted) \
            if call.wanted else None
        call.state_before = ModuleState(module, clone_buffers=True)
        call.rng_before = RngState(call.devices)
        # Replay data is held by reference until the call is judged (ReplayKeeping.decide).
        call.watched = self.replays.watch(module)
        call.params = self._call_params(step, call.target)
        call.writes = InputWrites([t for _, t in call.inputs])

    def _probe_inputs(self, call: CheckedCall) -> None:
        """Grad mode: the training call's inputs probed for their gradients, and the tensors it
        leaves in its arguments followed (LeftInArguments)."""
        step, target, index = call.step, call.target, call.index
        probed = ProbedInputs(call.args, call.kwargs,
                              lambda i: self._compiled_grad_input_hook(step, target, index, i))
        call.args, call.kwargs = probed.args, probed.kwargs
        try:
            call.left_watch = LeftInArguments(call.args, call.kwargs)
        except Exception as error:
            self._warn_once(call.name, "left", f"dynaprobe: {call.name}: the tensors its calls "
                            f"leave in their arguments are not followed ({type(error).__name__}: "
                            f"{error})", stacklevel=IN_CALL)

    def _run_compiled(self, call: CheckedCall):
        """The training call: compiled, under cast_dtype's autocast; with replay, the runs of
        its compiled graphs are kept."""
        listening = self.graphs.listen(call.name) \
            if call.watched is not None and self.graphs is not None \
            else contextlib.nullcontext([])
        shares = call.shares = CallShares() if call.grad_mode else None
        with autocast_context(self.cast_dtype, call.devices), listening as graph_calls:
            compiled_out = call.target.run(*call.args, **call.kwargs)
        if shares is not None:
            shares.close()
        call.graph_calls = graph_calls
        return compiled_out

    def _rerun_eagerly(self, call: CheckedCall, compiled_out) -> bool:
        """The eager re-run on the copies, from the module's state and RNG state before the
        training call, then the reference if the call gets one; what the training call left is
        put back afterwards. False when it failed (the module's HOOK_ERROR row says why)."""
        target, inputs, grad_mode = call.target, call.inputs, call.grad_mode
        state_after = ModuleState(target.module)
        rng_after = RngState(call.devices)
        names_after = ModuleGlobals(target.module)
        try:
            if call.watched is not None:
                call.candidate = replay_store.Candidate(
                    target.module, call.eager_args, call.eager_kwargs,
                    [t.requires_grad for _, t in inputs], call.watched[0],
                    replay_store.buffers_before(
                        call.watched[1], call.state_before.saved_buffers(target.module)),
                    call.rng_before, grad_mode, bool(target.shards), call.graph_calls,
                    [t for _, t in input_leaves(call.args, call.kwargs)])
            call.state_before.apply()
            call.rng_before.restore()
            call.written = call.writes.written([t for _, t in inputs])
            call.eager_args, call.eager_kwargs = map_tensors(
                call.eager_args, call.eager_kwargs,
                rerun_input(grad_mode, lambda index: inputs[index][1].requires_grad,
                            call.written, call.leaves))
            with torch.set_grad_enabled(grad_mode), autocast_context(self.cast_dtype,
                                                                     call.devices):
                call.eager_out = target.eager(*call.eager_args, **call.eager_kwargs)
            if call.candidate is not None:
                call.step.replay_candidates[(call.name, call.index)] = call.candidate
            if draws_its_own_random(self.backend):
                call.step.note_random_draws(call.name, call.rng_before.drawn_until(rng_after))
            if call.reference_args is not None and call.rng_before.accelerator_drawn():
                call.step.reference_missing(call.name, accelerator_draws(call.wanted))
                call.reference_args = None
            # A float32 training call's reference is decided once its backward has run, from the
            # verdicts of its outputs and gradients (_record_outputs holds it): not here, where
            # judging its outputs would wait for a device.
            call.holds_reference = (call.reference_args is not None and call.grad_mode
                                    and not call.target.shards and not call.written
                                    and call.decision.up_front is None)
            referred = (call.reference_args is not None and not call.holds_reference
                        and call.decision.dtype(lambda: outputs_differ(
                            call.eager_out, compiled_out, tensor_leaves, call.name,
                            self.tolerances)) is not None)
            if referred:
                call.rng_before.restore()
                call.reference = self.references.run(call)
            # No reference for this call: its upcast copies go, unless its gradients may ask for one
            # later (CallReferences.late; not with FSDP2's full parameters, freed after the backward)
            if call.reference is None and (referred or not call.grad_mode or call.target.shards):
                call.reference_args = None
        except Exception as error:
            call.step.note(call.name, vocabulary.NOTE_HOOK_ERROR,
                           f"eager re-run failed: {type(error).__name__}: {error}")
            return False
        finally:
            state_after.apply()
            rng_after.restore()
            rebound = names_after.restore()
            if rebound:
                self._warn_once(
                    call.name, "globals", f"dynaprobe: {call.name}: its forward rebinds "
                    f"module-level names ({', '.join(rebound)}): a global side effect. dynaprobe "
                    "put back what the eager re-run changed; other global effects (files, "
                    "in-place changes to module-level objects) it cannot undo.",
                    stacklevel=IN_CALL)
        return True

    def _record_outputs(self, call: CheckedCall, compiled_out) -> Tuple[list, list]:
        """Both sides' outputs recorded, then the inputs the call wrote and does not return
        (CheckedCall.record_written_results); returns what the compiled call and the eager
        re-run left in their arguments (CheckedCall.left_in_arguments)."""
        step, name = call.step, call.name
        if call.holds_reference:  # its pairs wait for the decision (CallReferences.late)
            step.hold_for_reference(name, call.index, self.references.late(call.for_reference()))
        compiled_leaves = call.compiled_leaves = tensor_leaves(compiled_out)
        eager_leaves = call.eager_leaves = tensor_leaves(call.eager_out)
        for index, (label, tensor) in enumerate(compiled_leaves):
            step.record(name, call.index, KIND_FWD_OUTPUT, index, SIDE_COMPILED, tensor, label)
        for index, (label, tensor) in enumerate(eager_leaves):
            step.record(name, call.index, KIND_FWD_OUTPUT, index, SIDE_EAGER, tensor, label)
        try:
            call.record_written_results()
        except Exception as error:  # never break training because of the checker
            self._warn_once(call.name, "written", f"dynaprobe: {call.name}: the inputs its "
                            f"calls write in place are not compared ({type(error).__name__}: "
                            f"{error})", stacklevel=IN_CALL)
        return self._left_in_arguments(call)

    def _await_backward(self, call: CheckedCall, compiled_out, left: list, eager_left: list):
        """Grad mode: the eager backward waits (PendingBackward) for the grad_output the
        compiled outputs receive, through probes on them; returns the probed outputs."""
        step = call.step
        held = step.held_references.get((call.name, call.index))  # its reference's decision
        if held is not None and eager_left:
            # Its reference would need the twins of what it left, found only now: decided at
            # once, from its outputs' verdicts, and run as its forward's reference.
            call.reference = held([])
            step.settle_reference(call.name, call.index)  # later pairs wait for its reference
            if call.reference is not None:
                call.left_in_reference()
        eager_outputs = [(i, t) for i, (_, t) in enumerate(call.eager_leaves) if t.requires_grad]
        pending = PendingBackward(step, call.target, call.index, eager_outputs, call.leaves,
                                  call.params, call.reference, eager_left)
        for index, tensor in left:
            pending.hooks.append(tensor.register_hook(pending.grad_hook(index)))
        if eager_outputs or eager_left:
            step.pending.append(pending)
            if call.candidate is not None:
                call.candidate.pending = pending
        self._split_param_grads(call, left)
        if call.reference is None and call.reference_args is not None:
            if eager_left:  # its reference would need the twins of what it left: none late
                call.reference_args = None
            else:
                pending.late_reference = held if held is not None else \
                    self.references.late(call.for_reference())
        probed = probe_outputs(compiled_out,
                               lambda index: self._grad_output_hook(step, pending, index))
        self._hook_outputs_themselves(step, pending, call.compiled_leaves, call.args,
                                      call.kwargs, call.inputs)
        return probed

    def _split_param_grads(self, call: CheckedCall, left: list) -> None:
        """The compiled side of each parameter's gradient is its share from this call
        (CallShares), the twin of the eager re-run's, where it can be found."""
        params = [p for _, p in call.params]
        try:
            results = [t for _, t in call.compiled_leaves] + [t for _, t in left] + [
                t for _, t in input_leaves(call.args, call.kwargs)]
            call.shares.attach(call.step, results, params)
        except Exception as error:  # never break training: the training backward's sums
            for param in params:
                call.step.by_call[id(param)] = False
            self._warn_once(call.name, "shares", f"dynaprobe: {call.name}: its parameters' "
                            "gradients are compared as the training backward sums them, uses "
                            f"outside the module included ({type(error).__name__}: {error})",
                            stacklevel=IN_CALL)

    def _left_in_arguments(self, call: CheckedCall) -> Tuple[list, list]:
        """CheckedCall.left_in_arguments, or nothing followed when that fails (said once)."""
        try:
            return call.left_in_arguments()
        except Exception as error:  # never break training because of the checker
            self._warn_once(call.name, "left", f"dynaprobe: {call.name}: the tensors its calls "
                            f"leave in their arguments are not followed ({type(error).__name__}: "
                            f"{error})", stacklevel=IN_CALL)
            return [], []

    def _warn_shared_arguments(self, step: Step, name: str, shared: List[str]) -> None:
        """An argument the eager re-run could not get a copy of: what it does to it, training
        sees. Said once per module and kind of argument, and kept in the dump."""
        step.attributes.setdefault(name, {})[vocabulary.ATTRIBUTE_SHARED_ARGUMENTS] = "; ".join(
            shared)
        for what in shared:
            self._warn_once(
                name, what, f"dynaprobe: {name}: an argument of type {what} cannot be "
                "deep-copied, so the eager re-run shares it with the training call: changes the "
                "re-run makes to it are visible to training. Make it copyable (copy.deepcopy) to "
                "isolate it.", stacklevel=IN_CALL)

    def _call_params(self, step: Step, target: Target) -> list:
        """The parameters a call of ``target`` uses, with the hooks that sum their training
        gradients. They are looked up at each call: FSDP2 registers the full (unsharded)
        parameters on the module for the forward, in place of the DTensor shards."""
        params = [(n, p) for n, p in target.module.named_parameters() if p.requires_grad]
        target.params = params
        for param_name, param in params:
            shard = target.shards.get(param_name)
            if shard is not None:
                step.shards[id(param)] = shard
            if id(param) not in self.hooked:  # once per parameter, even if shared by targets
                self.hooked[id(param)] = param
                self.restore.append(param.register_hook(
                    compiled_param_grad_hook(self.session, param)).remove)
            if (id(target), id(param)) not in self.hooked:
                self.hooked[(id(target), id(param))] = param
                self.restore.append(param.register_post_accumulate_grad_hook(
                    self._accumulated_hook(target)).remove)
        return params

    def _accumulated_hook(self, target: Target):
        def hook(_: torch.Tensor) -> None:
            # The training backward has passed this module: grad_output is known.
            step = self.session.step
            if step is not None:
                for pending in step.pending:
                    if pending.target is target:
                        pending.run()
                self.replays.after_backward(step)

        return hook

    def _hook_outputs_themselves(self, step: Step, pending: PendingBackward, compiled_leaves,
                                 args, kwargs, inputs) -> None:
        """The caller may change an output in place (XLM: ``tensor *= mask`` after a layer
        norm). Autograd then takes the gradient around the probe's view, whose hook never fires.
        The compiled output itself gets that gradient (the value before the change was the
        module's output), and otherwise the same one as the view, whose only consumer it is; a
        hook on it stands in when the view's did not fire. Not for an output that is one of the
        call's inputs or is returned twice: other paths reach those."""
        try:
            counts: Dict[int, int] = {}
            for _, tensor in compiled_leaves:
                counts[id(tensor)] = counts.get(id(tensor), 0) + 1
            given = {id(t) for _, t in inputs} | {id(t) for _, t in input_leaves(args, kwargs)}
            for index, (_, tensor) in enumerate(compiled_leaves):
                if tensor.requires_grad and counts[id(tensor)] == 1 and id(tensor) not in given:
                    pending.hooks.append(tensor.register_hook(
                        self._grad_output_hook(step, pending, index, unless_seen=True)))
        except Exception as error:  # never break training because of the checker
            self._warn_once(pending.target.name, "outputs", f"dynaprobe: {pending.target.name}: "
                            f"outputs changed in place are not followed ({error})",
                            stacklevel=IN_CALL)

    @staticmethod
    def _grad_output_hook(step: Step, pending: PendingBackward, index: int,
                          unless_seen: bool = False):
        """Keeps output ``index``'s gradient; ``unless_seen``: only if none was kept for it yet
        (the stand-in of _hook_outputs_themselves)."""
        def hook(grad: torch.Tensor) -> None:
            if grad is None or (unless_seen and index in pending.grads):
                return
            pending.on_output_grad(index, grad)
            # Seeds both sides' backward: recorded once, for both.
            step.record(pending.target.name, pending.call, KIND_GRAD_OUTPUT, index, SIDE_COMPILED, grad)

        return hook

    def _compiled_grad_input_hook(self, step: Step, target: Target, call: int, index: int):
        def hook(grad: Optional[torch.Tensor]) -> None:
            if grad is not None:
                step.record(target.name, call, KIND_GRAD_INPUT, index, SIDE_COMPILED, grad)
            # The compiled backward of this call is done: every grad_output has arrived.
            for pending in step.pending:
                if pending.target is target and pending.call == call:
                    if grad is not None and pending.late_reference is not None:
                        pending.compiled_grad_inputs[index] = grad.detach()
                    pending.run()
            self.replays.after_backward(step)

        return hook
