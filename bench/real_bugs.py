"""The benchmark of real torch.compile bugs: how often dynaprobe names the module, the stage and
the op of a historical inductor correctness bug, and finds and confirms a remedy.

    python bench/real_bugs.py [--cases a,b] [--json FILE]

Each case of ``real_bug_cases.py`` reintroduces a fixed upstream bug inside real inductor
compilation (an inductor custom post-grad pass, or inductor's own fault switch), in the middle of
three blocks, with ground truth (module, aten op, forward or backward); two negative controls
have none. Per case, as a user runs it, with the case's inductor config set for the whole run:

1. a single-pass training step, each block wrapped and compiled with inductor: does it FAIL, and
   does the root cause in the case's direction name the block?
2. ``checker.bisect(block, ops=True)``: the first stage that fails in that direction (the bug
   is in the config the call was compiled with, so ``recorded``: every stock stage passes), and
   the first failing op of that direction's aten graph;
3. ``checker.remedy()``: a change that passes every row on the replayed call;
4. ``checker.confirm(remedy, ...)``: confirmed on the next step.

It prints a row per case and, per level, precision (of what was named, how much was right) and
recall (of the positives, how many were named right). A negative control counts as a false
positive at every level when its step FAILs. The table and the command are in
docs/performance.md ("A benchmark of real bugs").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_bug_cases import CASES, Case  # noqa: E402

from dynaprobe import PrecisionChecker  # noqa: E402

LEVELS = ("module", "stage", "op", "remedy", "confirmed")


@dataclass
class Outcome:
    """What dynaprobe said of one case; each level None where it named nothing."""

    case: str
    failed: bool
    module: Optional[str] = None
    stage: Optional[str] = None
    op: Optional[str] = None
    remedy: Optional[str] = None
    confirmed: Optional[bool] = None
    seconds: float = 0.0
    error: str = ""

    def right(self, case: Case) -> dict:
        """Per level: True named right, False named wrong, None named nothing."""
        named = {"module": self.module, "stage": self.stage, "op": self.op,
                 "remedy": self.remedy, "confirmed": self.confirmed or None}
        if case.module is None:  # a negative control: anything named is a false positive
            return {level: False if self.failed else None for level in LEVELS}
        truth = {"module": case.module, "stage": "recorded", "op": case.op}
        return {level: None if named[level] is None else
                (named[level] == truth[level] if level in truth else True) for level in LEVELS}


def run_case(case: Case, dump_dir: str) -> Outcome:
    """The four steps of the module docstring on ``case``, writing into ``dump_dir``."""
    start = time.perf_counter()
    torch._dynamo.reset()
    model, inputs = case.build(), case.inputs()

    def step(m):
        m.zero_grad()
        loss = m(*inputs).square().sum()
        loss.backward()
        return loss

    checker = PrecisionChecker(backend="inductor", dump_dir=dump_dir)
    checker.wrap_all_children(model, depth=0)
    with torch._inductor.config.patch(case.config):
        for _ in range(case.steps - 1):  # earlier steps, each followed by an SGD update
            checker.compare(step, model)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter -= 0.1 * parameter.grad
        result = checker.compare(step, model)
        outcome = Outcome(case.name, not result.all_pass)
        try:
            if outcome.failed:
                _diagnose(checker, result, case, outcome, step, model)
        except Exception as error:  # said in the row; the benchmark goes on
            outcome.error = f"{type(error).__name__}: {error}".splitlines()[0]
    outcome.seconds = time.perf_counter() - start
    return outcome


def _diagnose(checker, result, case: Case, outcome: Outcome, step, model) -> None:
    forward = (case.direction or "forward") == "forward"
    root = result.root_cause or {}
    finding = root.get("forward" if forward else "backward") or root.get("forward") or \
        root.get("backward")
    if finding is None:
        return
    outcome.module = finding["module"]
    bisected = checker.bisect(outcome.module, ops=True)
    outcome.stage = bisected.first_failing(forward)
    if bisected.ops is not None:
        kind = "forward" if forward else "backward"
        found = [g.finding for g in bisected.ops.graphs if g.kind == kind and g.finding] or \
            bisected.ops.findings
        outcome.op = found[0].op if found else None
    remedies = checker.remedy(outcome.module, repeats=1)
    chosen = next((m for m in remedies.modules if m.remedy is not None), None)
    if chosen is not None:
        outcome.remedy = chosen.remedy.change.name
        outcome.confirmed = bool(checker.confirm(chosen, step, model, repeats=1))


def scores(cases: List[Case], outcomes: List[Outcome]) -> dict:
    """Per level: (precision, recall) over the cases, as the module docstring defines them."""
    found = {}
    positives = sum(case.module is not None for case in cases)
    for level in LEVELS:
        marks = [outcome.right(case)[level] for case, outcome in zip(cases, outcomes)]
        named = [mark for mark in marks if mark is not None]
        right = sum(mark is True for mark in marks)
        found[level] = (right / len(named) if named else float("nan"),
                        right / positives if positives else float("nan"))
    return found


def table(cases: List[Case], outcomes: List[Outcome]) -> str:
    """A row per case (what was true, what dynaprobe named), then the scores."""
    rows = [("case", "truth: module, direction, op", "FAIL", "module", "stage", "op", "remedy",
             "confirmed", "s")]
    for case, outcome in zip(cases, outcomes):
        truth = "control" if case.module is None else f"{case.module} {case.direction} {case.op}"
        rows.append((case.name, truth, "yes" if outcome.failed else "no", outcome.module or "-",
                     outcome.stage or "-", outcome.op or "-", outcome.remedy or "-",
                     str(outcome.confirmed or "-"), f"{outcome.seconds:.0f}") + (
            (f"error: {outcome.error}",) if outcome.error else ()))
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in rows]
    lines.append("")
    for level, (precision, recall) in scores(cases, outcomes).items():
        lines.append(f"{level:10} precision {precision:.2f}  recall {recall:.2f}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--json", default=None, help="also write each case's outcome here")
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if args.cases is None or c.name in args.cases.split(",")]
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="dynaprobe-real-bugs-") as folder:
        for case in chosen:
            outcomes.append(run_case(case, os.path.join(folder, case.name)))
            print(f"{case.name}: {asdict(outcomes[-1])}", file=sys.stderr, flush=True)
    print(table(chosen, outcomes), end="")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump([asdict(o) for o in outcomes], out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
