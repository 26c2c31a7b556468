"""The step session: the lifecycle of the checked steps of one dump folder. It keeps the index of
the next step and whether it is checked (``Schedule``), opens the recorder that writes them, begins
a step and finishes it (its graphs and modules, the background commit with one step in flight, the
disk budget, the first step's estimate) into what the user gets back. The modes receive it and ask
it for the step being checked; nothing calls back into the checker."""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import weakref
from typing import Dict, List, Optional, Protocol, Tuple, runtime_checkable

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._C.vocabulary import SIDE_COMPILED, SIDE_EAGER
from dynaprobe._mechanics import storage as _storage
from dynaprobe._mechanics.distributed import rank_and_world, rank_dir_name, resolve_dump_dir
from dynaprobe._mechanics.graphs import GraphRecorder, write_graph_files
from dynaprobe._mechanics.reference import WeightCopies, user_autocast
from dynaprobe._results.result import CompareResult
from dynaprobe._steps.step import Step, Target

# Sessions with a step whose file may still be being committed (collect() in a run).
_committing_sessions: "weakref.WeakSet[StepSession]" = weakref.WeakSet()


@atexit.register
def _commit_before_exit() -> None:
    """The steps collect() reported are on disk when the interpreter exits."""
    for session in list(_committing_sessions):
        try:
            session.wait_committed()
        except Exception as error:  # the step is lost: say so, and let the exit go on
            print(f"dynaprobe: {error}", file=sys.stderr)


CAPTURE_MODES = {SIDE_EAGER: vocabulary.MODE_EAGER_ONLY, SIDE_COMPILED: vocabulary.MODE_COMPILED_ONLY}


@dataclasses.dataclass
class Setup:
    """What a verb (install(), compare(), capture()) sets its session up with before the steps
    it runs. The recorder is opened with ``provenance``, ``judging`` (the tolerances its pairs
    are judged with, which it writes into the provenance) and ``store`` (what a step stores:
    ``dump=``, "full" for capture()) if none is open when a step begins, the provenance naming
    the torch.autocast the user entered around the first checked call on ``autocast_devices``
    (the model's devices; install() without cast_dtype). Each step finished records the
    ``/modules`` entries ``modules`` (``_planning.plan``) and the graphs ``graphs`` compiled,
    written to ``graph_dir`` too when given (``dump_graphs``)."""

    provenance: Dict[str, str]
    judging: _C.Judging
    store: str
    modules: List[Tuple[str, Dict[str, str]]]
    graphs: GraphRecorder
    graph_dir: Optional[str] = None
    autocast_devices: Optional[set] = None


@runtime_checkable
class Installation(Protocol):
    """A mode installed on a model (single-pass's ``SinglePass``, whole-model's ``WholeModel``):
    what ``PrecisionChecker`` and ``StepSession.collect`` ask of it. Two-pass and capture() are
    one verb each (``two_pass.run_step``) and install nothing."""

    targets: List[Target]  # the wrapped modules it checks; their calls count from 0 per step
    session: "StepSession"  # the checked steps it records into

    def finish(self, step: Step) -> None:
        """collect(), before the loss is recorded: the eager backwards still pending run."""

    def conclude(self, step: Step) -> None:
        """collect(), once the step has run: what it learned of each target, the parameter
        gradients summed, the replay data decided."""

    def remove(self) -> None:
        """uninstall(): the model's forwards as they were, every hook removed."""


class StepSession:
    """The checked steps of one dump folder, from the first begun to the last committed.

    A step is begun (``begin``; single-pass: ``current``, by the first wrapped call), recorded by
    the mode running it, and finished (``finish``) into its result, as the verb running them
    set it up (``prepare``). The recorder is opened when a step begins and none is open; the
    mode it was opened with is the session's ``mode``.

    Args:
        dump_dir: the folder the steps go to.
        schedule: which steps a run checks (install()/collect()).
        memory_budget_bytes, disk_budget_bytes, strict_io, dump: the checker's options.
    """

    def __init__(self, dump_dir: str, schedule: _storage.Schedule, *, memory_budget_bytes: int,
                 disk_budget_bytes: Optional[int], strict_io: bool, dump: str):
        self.dump_dir = dump_dir
        self.schedule = schedule
        self.memory_budget_bytes = memory_budget_bytes
        self.disk_budget_bytes = disk_budget_bytes
        self.strict_io = strict_io
        self.dump = dump
        self.writes = _storage.Writes(strict_io)
        self.index = 0  # the next step: collect()/compare()/capture() calls, from 0
        self.step: Optional[Step] = None  # the step begun, until it is finished
        # The memory of the references' weights, lent to a step's calls until it is over.
        self.weight_copies = WeightCopies()
        self.recorder = None
        self.mode: Optional[str] = None  # the provenance mode the recorder was opened with
        # install() until uninstall(), outside compare(): a run of steps, whose files are
        # committed while training goes on and whose first step gets an estimate of the run.
        self.in_run = False
        # The first stored step says where the dump is: a run with an estimate of its disk use,
        # compare() with the command that reads it again (capture() returns its file).
        self.estimated = False
        self._committing: Optional[_storage.Commit] = None  # the last step, while committed
        self.setup: Optional[Setup] = None

    # ------------------------------------------------------------------ begin
    def prepare(self, setup: Setup) -> None:
        """Sets up the steps a verb runs (see Setup)."""
        self.setup = setup

    def current(self, targets: List[Target]) -> Optional[Step]:
        """Single-pass: the step being checked, begun by the first wrapped call after install()
        or collect(); None in a step that is not checked (check_every, check_steps)."""
        if self.step is None and not self.schedule.checks(self.index):
            return None
        return self.step if self.step is not None else self.begin(targets)

    def begin(self, targets: List[Target]) -> Step:
        """Begins step ``index``: its calls of ``targets`` count from 0."""
        if self.recorder is None:
            self._open_recorder()
        self.recorder.begin_step(self.index)
        for target in targets:
            target.calls = 0
        self.step = Step(self.recorder, self.index)
        return self.step

    def _open_recorder(self) -> None:
        setup = self.setup
        provenance = dict(setup.provenance)
        # The first checked call runs inside the user's torch.autocast, if any.
        autocast = user_autocast(setup.autocast_devices) \
            if setup.autocast_devices is not None else None
        if autocast is not None:
            provenance[vocabulary.PROVENANCE_AUTOCAST] = str(autocast)
        self.recorder = _C.Recorder(self.dump_dir, provenance, judging=setup.judging,
                                    memory_budget_bytes=self.memory_budget_bytes,
                                    store=setup.store, strict_io=self.strict_io)
        self.mode = provenance.get(vocabulary.PROVENANCE_MODE)

    def skip(self) -> None:
        """collect() of a step that is not checked: the next one comes."""
        self.index += 1

    def abandon(self) -> None:
        """Forgets the step begun, finished or not (a two-pass or captured step that raised)."""
        self.step = None
        self.weight_copies.reclaim()

    def discard(self) -> None:
        """uninstall(): a step begun but never collected is discarded, with its recorder."""
        if self.step is not None:
            self.step = None
            self.recorder = None
            self.mode = None
        self.weight_copies = WeightCopies()  # their memory goes back

    # ------------------------------------------------------------------ finish
    def collect(self, installation: Installation, loss) -> Optional[CompareResult]:
        """collect(): finishes the step ``installation`` checked, ``loss`` (if not None) its
        compiled loss; None for a step not checked."""
        step = self.current(installation.targets)
        if step is None:
            self.skip()
            return None
        installation.finish(step)
        if loss is not None:
            step.record_loss(SIDE_COMPILED, loss)
        installation.conclude(step)
        return self.finish()

    def finish(self, compare: bool = True):
        """Finishes the step begun: records the graphs compiled and the ``/modules`` entries
        (with the step's notes), ends it, and commits its file in the background. Returns its
        CompareResult, or with ``compare`` False (capture()) its file; None for a step lost
        while training goes on (strict_io=False)."""
        step = self.step
        self._record_graphs(self.setup.graphs.take(), self.setup.graph_dir)
        self._record_modules(step, self.setup.modules)
        # Ends the step once it is judged; its file is committed in the background while
        # training goes on (raises a background error: disk full, ... with strict_io).
        pending = self.recorder.finish_step()
        self.step = None
        self.weight_copies.reclaim()  # every reference backward of the step has run
        self.index += 1
        commit = self._commit(pending, compare)
        self._keep_budget_and_estimate(step, pending, commit, compare)
        if step.error is not None:
            if self.strict_io:
                raise step.error
            print(f"dynaprobe: step {step.index} was lost ({step.error}); training goes on",
                  file=sys.stderr)
            return None
        if not compare:
            return pending.file
        # The report comes from the step as judged in memory, the same as `dynaprobe compare`
        # of its file; pairs not judged in memory wait for the file.
        comparison = _C.compare_pending(pending)
        return CompareResult.from_report(comparison.steps[0], self.dump_dir, pending.file,
                                         comparison, commit)

    def _record_graphs(self, graphs: list, graph_dir: Optional[str]) -> None:
        for graph in graphs:
            self.recorder.record_graph(graph.name, graph.kind, graph.text,
                                       {"function": graph.function, "module": graph.module})
        if graph_dir is not None and graphs:
            write_graph_files(graphs, graph_dir)

    def _record_modules(self, step: Step, modules: List[Tuple[str, Dict[str, str]]]) -> None:
        for name, attributes in modules:
            attributes = dict(attributes, **step.attributes.get(name, {}))
            if name in step.notes and vocabulary.ATTRIBUTE_NOTE not in attributes:
                note, reason = step.notes[name]
                attributes[vocabulary.ATTRIBUTE_NOTE] = note
                attributes[vocabulary.ATTRIBUTE_REASON] = reason
            self.recorder.record_module(name, attributes)

    def _commit(self, pending, compare: bool) -> _storage.Commit:
        """The step's commit, with one step in flight: the one before is waited for, and this
        one too when its size is needed now (the disk budget, the first estimate), outside a run
        and while writes fail (the report then says at once whether it was stored)."""
        # capture() exists for its file: losing it raises, whatever strict_io says.
        writes = self.writes if compare else _storage.Writes(strict=True)
        commit = _storage.Commit(pending, writes, self.dump_dir)
        previous, self._committing = self._committing, commit
        _committing_sessions.add(self)
        if previous is not None:
            previous.wait()
        if (not self.in_run or self.disk_budget_bytes is not None or not self.estimated
                or self.writes.failing):
            self.wait_committed()
        return commit

    def _keep_budget_and_estimate(self, step: Step, pending, commit: _storage.Commit,
                                  compare: bool) -> None:
        """Once the step is stored: the oldest steps removed to fit the disk budget, and after
        the first one a line on where the dump is (with an estimate of the run's disk use)."""
        stored = commit.done and commit.error is None
        try:
            if self.disk_budget_bytes is not None and stored:
                _storage.enforce_budget(self.dump_dir, self.disk_budget_bytes, pending.file)
            if not self.estimated and self.in_run and stored:
                self.estimated = True
                # Its warnings name the caller of PrecisionChecker.collect(), 6 frames up.
                _storage.report_first_step(self.dump_dir, pending.file, self.dump,
                                           self.schedule, step.index, self.disk_budget_bytes,
                                           stacklevel=6)
            elif not self.estimated and not self.in_run and stored and compare:  # compare()
                self.estimated = True
                print(f"dynaprobe: step {step.index} written to {self.dump_dir} "
                      f"(dynaprobe compare {self.dump_dir})", file=sys.stderr)
        except OSError as error:  # the folder went away meanwhile: the dump's loss, not training's
            if self.strict_io:
                raise
            self.writes.failed(self.dump_dir, step.index, error)

    def wait_committed(self) -> None:
        """Waits until the last finished step's file is committed (see
        PrecisionChecker.wait_committed)."""
        committing, self._committing = self._committing, None
        if committing is not None:
            committing.wait()


class Dumps:
    """A checker's dump folders, each with its session: ``dump_dir``, resolved when first
    needed (by every rank together), and for capture() of the side that dump does not hold, that
    side's own dump (``other_side_dump_dir``).

    Args:
        dump_dir: the ``dump_dir`` the checker was given (None: the default).
        schedule, memory_budget_bytes, disk_budget_bytes, strict_io, dump: see StepSession.
    """

    def __init__(self, dump_dir: Optional[str], schedule: _storage.Schedule, **settings):
        self._dump_dir = dump_dir
        self._resolved = False
        self.schedule = schedule
        self.settings = settings
        self.sessions: Dict[str, StepSession] = {}

    @property
    def dump_dir(self) -> str:
        if not self._resolved:
            self._dump_dir = resolve_dump_dir(self._dump_dir)
            self._resolved = True
        return self._dump_dir

    @property
    def run_dir(self) -> str:
        parent, leaf = os.path.split(os.path.normpath(self.dump_dir))
        return parent if leaf == rank_dir_name(rank_and_world()[0]) else self.dump_dir

    def session(self, side: Optional[str] = None, mode: Optional[str] = None) -> StepSession:
        """The session of ``dump_dir``; for a capture of ``side`` (or a step of ``mode``) when
        that dump holds another mode (the other side, a comparison, single-pass steps), the
        session of a dump of its own: ``<run_dir>/<side or mode>``."""
        folder = self.dump_dir
        main = self.sessions.get(folder)
        wanted = CAPTURE_MODES[side] if side is not None else mode
        if wanted is not None and main is not None and main.mode not in (None, wanted):
            folder = other_side_dump_dir(folder, self.run_dir, side or wanted)
        if folder not in self.sessions:
            self.sessions[folder] = StepSession(folder, self.schedule, **self.settings)
        return self.sessions[folder]

    def main(self) -> Optional[StepSession]:
        """The session of ``dump_dir``, if one was made (never resolves ``dump_dir``)."""
        return self.sessions.get(self._dump_dir) if self._resolved else None

    def end_run(self) -> None:
        """uninstall(): the run in ``dump_dir`` ends, a step begun but never collected is
        discarded, and every step's file is committed."""
        session = self.main()
        if session is not None:
            session.in_run = False
            session.discard()
        self.wait_committed()

    def wait_committed(self) -> None:
        for session in list(self.sessions.values()):
            session.wait_committed()

    def written_steps(self) -> List[int]:
        """The steps this checker wrote into ``dump_dir``, in order, once committed: a reused
        folder's earlier steps are not among them."""
        self.wait_committed()
        session = self.main()
        return sorted(session.writes.stored) if session is not None else []


def other_side_dump_dir(dump_dir: str, run_dir: str, side: str) -> str:
    """Where a checker's captures of ``side`` go when its dump holds another mode:
    ``<run_dir>/<side>``, with the rank folder below it when ``dump_dir`` is one, so that
    ``dynaprobe compare RUN_DIR RUN_DIR/<side>`` pairs them rank by rank and step by step."""
    if os.path.normpath(run_dir) == os.path.normpath(dump_dir):
        return os.path.join(dump_dir, side)
    return os.path.join(run_dir, side, os.path.basename(os.path.normpath(dump_dir)))
