"""Single-pass: the wrapped modules compiled in place; every call runs compiled (the training
path) and again eagerly on copies of its arguments (_isolation.py), and the eager re-run's backward
runs inside the real backward, seeded with the grad_output its compiled twin received, through
``torch.autograd.grad``, which never touches ``.grad``."""

from __future__ import annotations

import contextlib

import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

from dynaprobe._C import vocabulary
from dynaprobe._capture import (
    RngState,
    autocast_context,
    devices_of,
    input_leaves,
    map_tensors,
    patch_forward,
    probe_inputs,
    probe_outputs,
    tensor_leaves,
)
from dynaprobe._isolation import (
    LeftInArguments,
    ModuleGlobals,
    ModuleState,
    copy_arguments,
    counterparts,
)
from dynaprobe import _replay_store
from dynaprobe._reference import (
    ReferencePolicy,
    ReferenceRun,
    call_precision,
    copy_reference_arguments,
    outputs_differ,
    run_reference,
    shapes_differ,
)
from dynaprobe._step import (
    PendingBackward,
    Step,
    Target,
    compiled_param_grad_hook,
    run_pending,
)


class SinglePass:
    """The installation on one model: its targets, their patched forwards and hooks.

    ``current_step()`` gives the step being checked (begun by the first wrapped call), None in a
    step that is not checked (the compiled modules then run alone);
    ``active_step()`` the step if one is begun, else None (hooks firing outside a step do
    nothing).
    """

    def __init__(self, targets: List[Target], current_step: Callable[[], Step],
                 active_step: Callable[[], object], capture_input: bool, cast_dtype,
                 reference: ReferencePolicy = ReferencePolicy(None),
                 tolerances: Tuple[float, float] = (1e-4, 1e-3),
                 replay: str = "none", backend=None, graphs=None):
        self.targets = targets
        self.current_step = current_step
        self.active_step = active_step
        self.capture_input = capture_input
        self.cast_dtype = cast_dtype
        self.reference = reference  # which calls get a reference, in which dtype
        self.tolerances = tolerances  # (atol, rtol): what "failing" means
        self.replay = replay  # "none", "failing" or "all": calls whose replay data is kept
        self.backend = backend
        self.graphs = graphs  # the GraphRecorder: the runs of compiled graphs, for replays
        self._backend_spec = None  # how a replay finds the backend, worked out once
        self.restore: List[Callable[[], None]] = []
        self.hooked: Dict[object, torch.Tensor] = {}  # parameters given hooks
        self.warned: set = set()  # (module, topic): warnings said once
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

    def _forward(self, target: Target) -> Callable:
        def forward(*args, **kwargs):
            step = self.current_step()
            if step is None:  # a step that is not checked: the compiled module only
                return target.run(*args, **kwargs)
            return self._checked_call(step, target, args, kwargs)

        return forward

    def _checked_call(self, step: Step, target: Target, args: tuple, kwargs: dict):
        call = target.calls
        target.calls += 1
        name = target.name
        inputs = input_leaves(args, kwargs)
        devices = devices_of([t for _, t in inputs], target.module)
        grad_mode = torch.is_grad_enabled()
        try:
            if self.capture_input:
                # Single-pass feeds both sides the same inputs: recorded once, for both.
                for index, (label, tensor) in enumerate(inputs):
                    step.record(name, call, "fwd_input", index, "compiled", tensor, label)
            # Copies taken before the training call, which may change its inputs (a cache it
            # appends to, a tensor modified in place) and its module's state.
            eager_args, eager_kwargs, shared = copy_arguments(
                args, kwargs, lambda i, t: t.detach().clone())
            if shared:
                self._warn_shared_arguments(step, name, shared)
            low = call_precision(step, name, [t for _, t in inputs], target.module,
                                 self.cast_dtype, devices)
            self.reference.warn_unavailable(name, low)
            reference_dtype = self.reference.dtype(low)
            failing_dtype = self.reference.dtype_if_failing(low)
            wanted = reference_dtype or failing_dtype
            reference_args = copy_reference_arguments(args, kwargs, wanted) if wanted else None
            state_before = ModuleState(target.module, clone_buffers=True)
            rng_before = RngState(devices)
            # Replay data is held by reference until the call is judged (decide_replays).
            watched = (_replay_store.watch_parameters(target.module),
                       _replay_store.watch_buffers(target.module)) if self.replay != "none" \
                else None
            params = self._call_params(step, target)
        except Exception as error:  # never break training because of the checker
            step.note(name, vocabulary.NOTE_HOOK_ERROR, f"{type(error).__name__}: {error}")
            return target.run(*args, **kwargs)

        left_watch = None
        if grad_mode:
            args, kwargs = probe_inputs(
                args, kwargs, lambda index: self._compiled_grad_input_hook(step, target, call, index))
            try:
                left_watch = LeftInArguments(args, kwargs)
            except Exception as error:
                self._warn_once(name, "left", f"dynaprobe: {name}: the tensors its calls leave in "
                                f"their arguments are not followed ({type(error).__name__}: "
                                f"{error})")
        listening = self.graphs.listen(name) if watched is not None and self.graphs is not None \
            else contextlib.nullcontext([])
        with autocast_context(self.cast_dtype, devices), listening as graph_calls:
            compiled_out = target.run(*args, **kwargs)

        leaves = []
        state_after = ModuleState(target.module)
        rng_after = RngState(devices)
        names_after = ModuleGlobals(target.module)
        candidate = None
        try:
            if watched is not None:
                candidate = _replay_store.Candidate(
                    target.module, eager_args, eager_kwargs,
                    [t.requires_grad for _, t in inputs], watched[0],
                    _replay_store.buffers_before(watched[1],
                                                 state_before.saved_buffers(target.module)),
                    rng_before, grad_mode, bool(target.shards), graph_calls)
            state_before.apply()
            rng_before.restore()

            def eager_input(index: int, tensor: torch.Tensor) -> torch.Tensor:
                original = inputs[index][1]
                if grad_mode and original.requires_grad and (tensor.is_floating_point()
                                                             or tensor.is_complex()):
                    tensor.requires_grad_(True)
                    if all(leaf is not tensor for _, leaf in leaves):  # see probe_inputs
                        leaves.append((index, tensor))
                return tensor

            eager_args, eager_kwargs = map_tensors(eager_args, eager_kwargs, eager_input)
            with torch.set_grad_enabled(grad_mode), autocast_context(self.cast_dtype, devices):
                eager_out = target.eager(*eager_args, **eager_kwargs)
            if candidate is not None:
                step.replay_candidates[(name, call)] = candidate
            reference = None
            if reference_args is not None and (reference_dtype is not None or outputs_differ(
                    eager_out, compiled_out, tensor_leaves, *self.tolerances)):
                rng_before.restore()
                reference = self._reference_call(step, target, call, reference_args, wanted,
                                                 devices, grad_mode, inputs, eager_out)
        except Exception as error:
            step.note(name, vocabulary.NOTE_HOOK_ERROR,
                      f"eager re-run failed: {type(error).__name__}: {error}")
            return compiled_out
        finally:
            state_after.apply()
            rng_after.restore()
            rebound = names_after.restore()
            if rebound:
                self._warn_once(
                    name, "globals", f"dynaprobe: {name}: its forward rebinds module-level names "
                    f"({', '.join(rebound)}): a global side effect. dynaprobe put back what the "
                    "eager re-run changed; other global effects (files, in-place changes to "
                    "module-level objects) it cannot undo.")

        compiled_leaves = tensor_leaves(compiled_out)
        eager_leaves = tensor_leaves(eager_out)
        left, eager_left = self._left_in_arguments(
            name, left_watch, args, kwargs, eager_args, eager_kwargs, compiled_leaves, reference,
            reference_args)
        for index, (label, tensor) in enumerate(compiled_leaves):
            step.record(name, call, "fwd_output", index, "compiled", tensor, label)
        for index, (label, tensor) in enumerate(eager_leaves):
            step.record(name, call, "fwd_output", index, "eager", tensor, label)

        if not grad_mode:
            return compiled_out
        eager_outputs = [(i, t) for i, (_, t) in enumerate(eager_leaves) if t.requires_grad]
        pending = PendingBackward(step, target, call, eager_outputs, leaves, params, reference,
                                  eager_left)
        for index, tensor in left:
            pending.hooks.append(tensor.register_hook(pending.grad_hook(index)))
        if eager_outputs or eager_left:
            step.pending.append(pending)
            if candidate is not None:
                candidate.pending = pending
        probed = probe_outputs(compiled_out,
                               lambda index: self._grad_output_hook(step, pending, index))
        self._hook_outputs_themselves(step, pending, compiled_leaves, args, kwargs, inputs)
        return probed

    def _left_in_arguments(self, name: str, watch: Optional[LeftInArguments], args, kwargs,
                           eager_args, eager_kwargs, compiled_leaves, reference,
                           reference_args) -> Tuple[list, list]:
        """What the compiled call left in its arguments (LeftInArguments) that requires grad, and
        its twins left by the eager re-run (and the reference) in their copies: ``(compiled,
        eager)`` lists of (index, tensor), indexed after the call's returned tensors. A later call
        reading them sends gradient back into this call: it seeds the eager backward too."""
        if watch is None:
            return [], []
        try:
            found = watch.find(args, kwargs, [t for _, t in compiled_leaves],
                               [t for _, t in input_leaves(args, kwargs)])
            if not found:
                return [], []
            first = len(compiled_leaves)
            eager = [(first + position, twin)
                     for position, twin in counterparts(found, eager_args, eager_kwargs)]
            if reference is not None:
                reference.left = [(first + position, twin) for position, twin in
                                  counterparts(found, reference_args[0], reference_args[1])]
            paired = {index for index, _ in eager}
            return [(first + p, t) for p, (_, t) in enumerate(found) if first + p in paired], eager
        except Exception as error:  # never break training because of the checker
            self._warn_once(name, "left", f"dynaprobe: {name}: the tensors its calls leave in "
                            f"their arguments are not followed ({type(error).__name__}: {error})")
            return [], []

    def _reference_call(self, step: Step, target: Target, call: int, arguments,
                        dtype: torch.dtype, devices: set, grad_mode: bool,
                        inputs: list, eager_out) -> Optional[ReferenceRun]:
        """Runs and records the reference of this call in ``dtype``; what its backward needs. A
        reference that cannot run (an op without a kernel for the dtype, ...) is a NO_REFERENCE
        row of the report and a warning."""
        try:
            out, run = run_reference(target.module, target.eager, arguments, dtype, devices,
                                     grad_mode, lambda index: inputs[index][1].requires_grad,
                                     tensor_leaves, map_tensors)
        except Exception as error:
            what = f"{type(error).__name__}: {error}"
            step.reference_missing(target.name, what)
            self._warn_once(target.name, "reference",
                            f"dynaprobe: {target.name}: the {dtype} reference could not run "
                            f"({what}); its rows are judged by the tolerances alone")
            return None
        leaves = tensor_leaves(out)
        differ = shapes_differ([t for _, t in leaves], [t for _, t in tensor_leaves(eager_out)])
        if differ:
            step.reference_missing(target.name, differ)
            return None
        for index, (label, tensor) in enumerate(leaves):
            step.record(target.name, call, "fwd_output", index, "reference", tensor, label)
        return run

    def decide_replays(self, step: Step, final: bool = False) -> None:
        """Keeps the replay data of the calls ready to be decided (their backward done, or
        ``final``: at collect()) that ``replay`` asks for: every call, or the calls with a row
        that fails, as the report judges it (the recorder's verdicts, judged in memory on its
        background thread: ``Recorder.failing_calls``). A passing call whose backward shows only
        in parameter gradients (no input needs a gradient) waits for collect(), which judges
        them. A call that cannot be kept is said in a warning and checks nothing less."""
        ready = [(key, candidate) for key, candidate in step.replay_candidates.items()
                 if final or candidate.ready()]
        if not ready:
            return
        try:
            failing = None if self.replay == "all" else {
                tuple(key) for key in step.recorder.failing_calls()}
        except Exception as error:  # the step is lost: collect() says why
            for candidate in step.replay_candidates.values():
                candidate.release()
            step.replay_candidates.clear()
            if step.error is None:
                step.error = error
            return
        for key, candidate in ready:
            keep = failing is None or key in failing
            if not keep and not final and candidate.backward_checks_parameters_only():
                continue
            del step.replay_candidates[key]
            if keep:
                self._replay_call(step, key, candidate)
            candidate.release()

    def _replay_call(self, step: Step, key: Tuple[str, int], candidate) -> None:
        name, call = key
        changed = [] if candidate.sharded else candidate.changed()
        if changed:
            self._warn_once(name, "replay", f"dynaprobe: {name}: the replay data of call {call} "
                            f"was not kept: {', '.join(changed[:3])} changed before its rows "
                            "were judged (an optimizer step before collect()?). Call collect() "
                            "before optimizer.step() to keep it")
            return
        try:
            if self._backend_spec is None:
                self._backend_spec = _replay_store.backend_spec(self.backend)
            _replay_store.record_call(step, name, call, candidate, self.cast_dtype,
                                      self._backend_spec,
                                      self.graphs.captured if self.graphs else None)
        except Exception as error:
            self._warn_once(name, "replay", f"dynaprobe: {name}: its replay data could not be "
                            f"kept ({type(error).__name__}: {error})")

    def _after_backward(self, step: Step) -> None:
        """A call's eager backward has run: decide its replay data when this backward pass ends
        (one wait for the recorder's verdicts per pass), or now outside a backward."""
        if not step.replay_candidates or step.decision_queued:
            return

        def decide() -> None:
            step.decision_queued = False
            try:
                self.decide_replays(step)
            except Exception as error:  # never break the training backward
                self._warn_once("", "replay", f"dynaprobe: replay data not kept "
                                f"({type(error).__name__}: {error})")

        step.decision_queued = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(decide)
        except RuntimeError:  # not inside a backward pass
            decide()

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
                "isolate it.")

    def _warn_once(self, module: str, topic: str, message: str) -> None:
        if (module, topic) not in self.warned:
            self.warned.add((module, topic))
            warnings.warn(message, stacklevel=5)

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
                    compiled_param_grad_hook(self.active_step, param)).remove)
            if (id(target), id(param)) not in self.hooked:
                self.hooked[(id(target), id(param))] = param
                self.restore.append(param.register_post_accumulate_grad_hook(
                    self._accumulated_hook(target)).remove)
        return params

    def _accumulated_hook(self, target: Target):
        def hook(_: torch.Tensor) -> None:
            # The training backward has passed this module: grad_output is known.
            step = self.active_step()
            if step is not None:
                for pending in step.pending:
                    if pending.target is target:
                        pending.run()
                self._after_backward(step)

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
                            f"outputs changed in place are not followed ({error})")

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
            step.record(pending.target.name, pending.call, "grad_output", index, "compiled", grad)

        return hook

    def _compiled_grad_input_hook(self, step: Step, target: Target, call: int, index: int):
        def hook(grad: Optional[torch.Tensor]) -> None:
            if grad is not None:
                step.record(target.name, call, "grad_input", index, "compiled", grad)
            # The compiled backward of this call is done: every grad_output has arrived.
            for pending in step.pending:
                if pending.target is target and pending.call == call:
                    pending.run()
            self._after_backward(step)

        return hook
