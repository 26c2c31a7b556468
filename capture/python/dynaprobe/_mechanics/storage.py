"""What a run keeps on disk: which steps are checked, what each checked step stores
(``dump=``), and the disk budget of a dump, with a one-line estimate after the first step."""

from __future__ import annotations

import numbers
import os
import shutil
import sys
import warnings
from typing import Iterable, List, Optional, Set

from dynaprobe import _C
from dynaprobe._C import format_bytes
from dynaprobe._C.vocabulary import STORE_MODES


def expect_dump_mode(value) -> str:
    if value not in STORE_MODES:
        raise ValueError(f"dump must be one of {', '.join(map(repr, STORE_MODES))}, but received "
                         f"{value!r}")
    return value


def expect_steps(value) -> Optional[frozenset]:
    """None or step indices >= 0 (any iterable of ints)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"check_steps must be None or an iterable of step indices, but received "
                        f"{value!r}")
    steps = list(value)
    for step in steps:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"check_steps must hold step indices >= 0, but holds {step!r}")
    return frozenset(int(step) for step in steps)


class Schedule:
    """Which steps are checked: ``check_steps`` when given, else every ``check_every``-th step
    (steps 0, N, 2N, ...). Steps count the collect() calls from 0, as the dump's step files do."""

    def __init__(self, check_every: int, check_steps: Optional[frozenset]):
        self.check_every = check_every
        self.check_steps = check_steps

    def checks(self, step: int) -> bool:
        if self.check_steps is not None:
            return step in self.check_steps
        return step % self.check_every == 0

    def remaining(self, after: int) -> Optional[int]:
        """How many checked steps follow step ``after``; None when unbounded."""
        if self.check_steps is None:
            return None
        return sum(1 for step in self.check_steps if step > after)


def committed_steps(dump_dir: str) -> List[tuple]:
    """(step, path, bytes) of the committed step files of a dump folder, oldest step first, as
    formats::list_dump lists them; none for a folder not made yet."""
    if not os.path.isdir(dump_dir):
        return []
    committed, _ = _C.list_dump(dump_dir)
    return [(_C.step_of_file_name(path), path, os.path.getsize(path)) for path in committed]


def enforce_budget(dump_dir: str, budget: Optional[int], keep: str) -> List[str]:
    """Removes the oldest committed steps until the dump fits ``budget`` bytes; never ``keep``
    (the step just written). Returns the removed files."""
    if budget is None:
        return []
    steps = committed_steps(dump_dir)
    total = sum(size for _, _, size in steps)
    removed = []
    for _, path, size in steps:
        if total <= budget:
            break
        if os.path.samefile(path, keep):
            continue
        os.remove(path)
        total -= size
        removed.append(path)
    return removed


def report_first_step(dump_dir: str, step_file: str, dump: str, schedule: Schedule, step: int,
                      budget: Optional[int], stacklevel: int = 4) -> None:
    """After the first checked step: one line on stderr with the bytes a checked step takes,
    and a warning when the run will not fit the disk budget or the free space (``stacklevel``:
    the user's frame that finished the step, counted from here)."""
    size = os.path.getsize(step_file)
    free = shutil.disk_usage(dump_dir).free
    remaining = schedule.remaining(step)
    size_text, free_text = format_bytes(size), format_bytes(free)
    plan = (f"{remaining} more checked step(s): about {format_bytes(size * remaining)}"
            if remaining is not None else f"checking every {schedule.check_every} step(s)")
    budget_text = format_bytes(budget) if budget is not None else None
    limit = f"disk budget {budget_text}" if budget is not None else "no disk budget"
    print(f"dynaprobe: step {step} wrote {size_text} to {dump_dir} (dump={dump!r}); {plan}; "
          f"{limit}; {free_text} free", file=sys.stderr)
    if budget is not None and size > budget:
        warnings.warn(f"dynaprobe: one checked step ({size_text}) is larger than the disk budget "
                      f"({budget_text}): only the latest step is kept; raise disk_budget_bytes "
                      "or store less (dump='failing' or 'stats')", stacklevel=stacklevel)
    if budget is not None and budget > free + size:
        warnings.warn(f"dynaprobe: the disk budget ({budget_text}) is larger than the free space "
                      f"of {dump_dir} ({free_text}): the disk may fill before the budget does",
                      stacklevel=stacklevel)
    if budget is None:
        ahead = size * remaining if remaining is not None else size * 10
        if ahead > free:
            what = (f"the {remaining} checked steps still to come" if remaining is not None
                    else "ten more checked steps")
            warnings.warn(f"dynaprobe: {what} would write about {format_bytes(ahead)}, more than "
                          f"the {free_text} free in {dump_dir}; set disk_budget_bytes, check "
                          "fewer steps (check_every, check_steps) or store less (dump='failing' "
                          "or 'stats')", stacklevel=stacklevel)


def brief(error: BaseException) -> str:
    """An error on one line, its middle left out when long (HDF5's stacks end with the OS's
    reason: "... No space left on device"), without the note that the step was discarded."""
    lines = [line.strip() for line in str(error).splitlines()
             if line.strip() and not line.startswith("(dynaprobe discarded step")]
    text = " ".join(lines) or type(error).__name__
    return text if len(text) <= 320 else f"{text[:100]} ... {text[-120:]}"


class Writes:
    """How the checker's dump writes are going (``PrecisionChecker(strict_io=...)``).

    With ``strict_io=False`` (the default) a dump that cannot be written costs the dump, never
    the training: each checked step is still judged in memory and ``collect()`` returns its
    result, marked not stored. stderr says so once, with what to do, and again when a step is
    written again: the recorder tries again at every checked step, so a disk that has room again
    is written again. ``strict_io=True`` raises the error instead, as a failed write always did.
    """

    def __init__(self, strict: bool):
        self.strict = strict
        self.failing = False  # the last step whose outcome is known was not stored
        self.stored: Set[int] = set()  # the steps written (a replay reads only these)

    def failed(self, dump_dir: str, step: int, error: BaseException) -> None:
        if self.failing:
            return
        self.failing = True
        print(f"dynaprobe: step {step} was not stored in {dump_dir}: {brief(error)}. Training "
              "goes on, and "
              "every checked step is still judged in memory: collect() returns its result "
              "(result.stored is False) until a step is written again, which dynaprobe tries at "
              "every checked step and will say. To store the steps: free space, give dump_dir= a "
              "folder of its own on a disk with room, or store less (dump='failing' or 'stats', "
              "disk_budget_bytes=, check_every=). PrecisionChecker(strict_io=True) raises "
              "instead.", file=sys.stderr)

    def wrote(self, dump_dir: str, step: int) -> None:
        self.stored.add(step)
        if self.failing:
            self.failing = False
            print(f"dynaprobe: step {step} was stored in {dump_dir}: writing works again",
                  file=sys.stderr)


class Commit:
    """A checked step's file, committed in the background, as the checker and its result wait
    for it: ``wait()`` returns why it was not stored (None once stored), and raises that error
    with ``strict_io=True``."""

    def __init__(self, pending, writes: Writes, dump_dir: str):
        self.pending = pending
        self.writes = writes
        self.dump_dir = dump_dir
        self.done = False
        self.error: Optional[BaseException] = None

    def wait(self) -> Optional[BaseException]:
        if not self.done:
            try:
                self.pending.wait_committed()
            except OSError as error:  # dynaprobe.DumpIOError: no space, I/O, folder gone, ...
                self.error = error
                self.writes.failed(self.dump_dir, self.pending.step, error)
            else:
                self.writes.wrote(self.dump_dir, self.pending.step)
            self.done = True
        if self.error is not None and self.writes.strict:
            raise self.error
        return self.error
