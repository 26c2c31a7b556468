"""Replay keeping (``PrecisionChecker(replay=...)``): which checked calls keep their replay data
(the module's state, arguments, RNG state and compiled graphs' runs, held by reference until the
call is judged), decided once a call's backward is done or at collect(), and kept in the step's
file (``_mechanics/replay_store.py``) for ``bisect``, ``repro`` and ``bundle``."""

from __future__ import annotations

from typing import Tuple

import torch

from dynaprobe._mechanics import replay_store
from dynaprobe._modes.once import OnceWarnings
from dynaprobe._steps.step import Step


class ReplayKeeping:
    """The calls whose replay data ``replay`` keeps: "none", "failing" (the calls with a row that
    fails) or "all". ``backend`` and ``cast_dtype`` are the checker's, stored with each call;
    ``graphs`` the GraphRecorder of the compiled graphs (None without graph recording)."""

    def __init__(self, replay: str, backend, cast_dtype, graphs, warn: OnceWarnings):
        self.replay = replay
        self.backend = backend
        self.cast_dtype = cast_dtype
        self.graphs = graphs
        self.warn = warn
        self._backend_spec = None  # how a replay finds the backend, worked out once

    @property
    def on(self) -> bool:
        return self.replay != "none"

    def watch(self, module: torch.nn.Module):
        """Before a call: the module's parameters and buffers watched (a change before the call
        is judged makes its data stale), or None when no replay data is kept."""
        if not self.on:
            return None
        return replay_store.watch_parameters(module), replay_store.watch_buffers(module)

    def decide(self, step: Step, final: bool = False) -> None:
        """Keeps the replay data of the calls ready to be decided (their backward done, or
        ``final``: at collect()) that ``replay`` asks for: every call, or the calls with a row
        that fails, as the report judges it (the recorder's verdicts, judged in memory on its
        background thread: ``Recorder.failing_calls``). A passing call whose backward shows only
        in parameter gradients (no input needs a gradient) waits for collect(), which judges
        them. A call that cannot be kept is said in a warning and checks nothing less."""
        step.decide_late_references()  # a late reference can clear a call as noise
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
                self._keep(step, key, candidate)
            candidate.release()

    def _keep(self, step: Step, key: Tuple[str, int], candidate) -> None:
        name, call = key
        changed = [] if candidate.sharded else candidate.changed()
        if changed:
            self.warn(name, "replay", f"dynaprobe: {name}: the replay data of call {call} "
                      f"was not kept: {', '.join(changed[:3])} changed before its rows "
                      "were judged (an optimizer step before collect()?). Call collect() "
                      "before optimizer.step() to keep it")
            return
        try:
            if self._backend_spec is None:
                self._backend_spec = replay_store.backend_spec(self.backend)
            replay_store.record_call(step, name, call, candidate, self.cast_dtype,
                                     self._backend_spec,
                                     self.graphs.captured if self.graphs else None)
        except Exception as error:
            self.warn(name, "replay", f"dynaprobe: {name}: its replay data could not be "
                      f"kept ({type(error).__name__}: {error})")

    def after_backward(self, step: Step) -> None:
        """A call's eager backward has run: decide its replay data when this backward pass ends
        (one wait for the recorder's verdicts per pass), or now outside a backward."""
        if not step.replay_candidates or step.decision_queued:
            return

        def decide() -> None:
            step.decision_queued = False
            try:
                self.decide(step)
            except Exception as error:  # never break the training backward
                self.warn("", "replay", f"dynaprobe: replay data not kept "
                          f"({type(error).__name__}: {error})")

        step.decision_queued = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(decide)
        except RuntimeError:  # not inside a backward pass
            decide()
