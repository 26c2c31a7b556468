"""A whole run analysed in shards, on any ``concurrent.futures.Executor``.

    from concurrent.futures import ProcessPoolExecutor
    from dynaprobe import analyze_run

    with ProcessPoolExecutor(8) as pool:
        report = analyze_run("dynaprobe_runs/20261201-120000-4242-0", executor=pool)
    print(report.text)
    report.save("html", "report.html")

Each shard is ``dynaprobe compare RUN --ranks R --steps S --json`` run by the engine in a worker
(a process of the pool, a Dask or Ray worker on another machine that sees the run's files); the
shards' JSON reports come back and merge into the report of the whole run, the very report
``dynaprobe compare RUN`` writes (docs/multi-rank.md#analysing-a-large-run).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Executor
from typing import List, Optional, Sequence, Tuple

from dynaprobe import _C

__all__ = ["RunReport", "analyze_run"]


def _index_text(indices: Optional[object], name: str) -> str:
    """"0-3,8" from a str, an int or an iterable of ints; "" (all) from None."""
    if indices is None:
        return ""
    if isinstance(indices, str):
        return indices
    if isinstance(indices, int):
        return str(indices)
    try:
        return ",".join(str(int(i)) for i in indices)
    except (TypeError, ValueError):
        raise TypeError(f"analyze_run(): {name} expects a str such as '0-3,8', an int or ints, "
                        f"but received {indices!r}") from None


def _analyze_shard(eager: str, compiled: str, ranks: str, steps: str, atol: Optional[float],
                   rtol: Optional[float], module: str) -> str:
    """The JSON report of one shard; runs in the executor's worker."""
    return _C.analyze_run_json(eager, compiled, ranks, steps, atol, rtol, module)


class RunReport:
    """The report of a whole run, merged from the JSON reports of its shards."""

    def __init__(self, shards: Sequence[Tuple[str, str]]):
        self._shards = list(shards)
        self._summary: Optional[dict] = None

    def render(self, format: str, all_steps: bool = False) -> str:
        """The report in ``format``: "text" (what ``dynaprobe compare`` prints) or a registered
        format ("json", "html", "junit", "markdown", "merged-csv")."""
        return _C.render_run(self._shards, format, all_steps)

    @property
    def text(self) -> str:
        """The stdout report: the run's summary first, then the first failing steps' reports."""
        return self.render("text")

    @property
    def summary(self) -> dict:
        """The JSON report's summary: all_pass, ranks, steps, failed_steps, row counts,
        root_cause_first_seen, warnings (the run's consistency)."""
        if self._summary is None:
            self._summary = json.loads(self.render("json"))["summary"]
        return self._summary

    @property
    def all_pass(self) -> bool:
        return bool(self.summary["all_pass"])

    def save(self, format: str, path: str) -> str:
        """Writes the report in ``format`` to ``path``; returns the path."""
        with open(path, "w", encoding="utf-8") as out:
            out.write(self.render(format))
        return path

    def __bool__(self) -> bool:
        return self.all_pass


def analyze_run(run_dir: str, compiled_dir: Optional[str] = None, *,
                executor: Optional[Executor] = None, ranks=None, steps=None,
                ranks_per_shard: int = 1, atol: Optional[float] = None,
                rtol: Optional[float] = None, module: str = "") -> RunReport:
    """Compares every rank and step of a run (or those ``ranks`` and ``steps`` select: "0-3,8",
    an int or ints) and returns its report.

    With ``executor`` (any ``concurrent.futures.Executor``: a ``ProcessPoolExecutor``, Dask's
    ``Client.get_executor()``, Ray's), the run is split into shards of ``ranks_per_shard``
    ranks, each analysed by a worker, which must see ``run_dir`` at the same path. Without, it is
    analysed here. Either way the report is the one ``dynaprobe compare`` writes of the whole run.
    ``compiled_dir``: the compiled side, when it was captured separately (``dynaprobe compare
    RUN RUN2``).
    """
    if ranks_per_shard < 1:
        raise ValueError(f"analyze_run(): ranks_per_shard must be >= 1, but received "
                         f"{ranks_per_shard!r}")
    eager = os.path.abspath(os.fspath(run_dir))
    compiled = eager if compiled_dir is None else os.path.abspath(os.fspath(compiled_dir))
    rank_text, step_text = _index_text(ranks, "ranks"), _index_text(steps, "steps")
    if executor is None:
        return RunReport([(eager, _C.analyze_run_json(eager, compiled, rank_text, step_text, atol,
                                                      rtol, module))])
    planned: List[int] = [rank for rank, _ in _C.plan_run(eager, compiled, rank_text, step_text)]
    shards = [",".join(str(r) for r in planned[i:i + ranks_per_shard])
              for i in range(0, len(planned), ranks_per_shard)]
    futures = [executor.submit(_analyze_shard, eager, compiled, shard, step_text, atol, rtol,
                               module) for shard in shards]
    return RunReport([(f"shard of ranks {shard}", future.result())
                      for shard, future in zip(shards, futures)])
