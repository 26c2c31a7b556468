"""Writing a checker's reports: a step's report on stdout and in every format of ``dynaprobe
compare --FORMAT PATH`` (``PrecisionChecker.report``), and the merged CSV of every rank gathered
on rank 0 (``PrecisionChecker.gather_report``)."""

from __future__ import annotations

import os
from typing import Dict, Optional

from dynaprobe import _C
from dynaprobe._mechanics.distributed import gather_to_rank0, rank_and_world
from dynaprobe._results.result import CompareResult


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def print_report(result: Optional[CompareResult], csv_path: Optional[str],
                 format_paths: Dict[str, Optional[str]], only_failing: bool = False) -> None:
    """See PrecisionChecker.report."""
    formats = {name.replace("-", "_") + "_path": (name, title)
               for name, title in _C.report_formats()}
    unknown = sorted(set(format_paths) - set(formats))
    if unknown:
        raise TypeError(f"report() got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"the report formats are {', '.join(['csv_path', *formats])}")
    if result is None:
        return
    if not isinstance(result, CompareResult):
        raise TypeError(f"result must be what collect() or compare() returned (a "
                        f"CompareResult), but received {type(result).__name__}: call it as "
                        f"checker.report(checker.collect(loss))")
    print(result.text(only_failing), end="")
    if csv_path:
        write_text(csv_path, result.csv())
        print(f"CSV report saved to: {csv_path}")
    for keyword, (name, title) in formats.items():
        path = format_paths.get(keyword)
        if path:
            write_text(path, result.render(name))
            print(f"{title} report saved to: {path}")


def gather_merged_csv(results, csv_path: Optional[str], timeout: float) -> Optional[str]:
    """See PrecisionChecker.gather_report."""
    results = [results] if isinstance(results, CompareResult) else list(results)
    rank, world = rank_and_world()
    mine = [result.merged_csv(rank) for result in results]
    gathered = gather_to_rank0(mine, timeout) if world > 1 else [mine]
    if rank != 0:
        return None
    if len({len(texts) for texts in gathered}) > 1:
        raise ValueError("gather_report(): the ranks passed different numbers of results ("
                         + ", ".join(f"rank {r}: {len(t)}" for r, t in enumerate(gathered))
                         + "); pass the same scenarios in the same order on every rank")
    text = _C.render_merged_csv([])  # the header
    for index in range(len(mine)):
        for texts in gathered:
            text += texts[index].split("\n", 1)[1]  # without its header
    if csv_path:
        write_text(csv_path, text)
        print(f"Merged CSV report saved to: {csv_path}")
    return text
