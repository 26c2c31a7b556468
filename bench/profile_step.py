"""Where a checked step's training-thread time goes (issue 46): the checked step of
scale_bench.py's GPT-2 under cProfile, its time grouped by who spends it.

For each storage mode, a model with its GPT2Blocks checked single-pass (aot_eager) trains
--warmup steps unprofiled, then --steps steps under cProfile. The profile's own time
(``tottime``, time in a function less the functions it calls) is summed per group:

  dynaprobe/<room>/<module>.py   Python of the checker
  dynaprobe._C.<name>            the C++ extension's functions, called from Python
  torch.autograd (C++)           the autograd engine: the backward, which runs the hooks' Python
                                 too (their own time is in their groups)
  torch / transformers (Python)  the model's and torch's Python, eager and compiled
  torch ops (C++)                ATen ops called from Python (built-in methods of torch)
  other

and the functions of the checker and its extension are listed by own time. The same run times
the unchecked compiled step and the inherent step (scale_bench.py's "inherent": compiled plus an
eager forward and backward of every block call), unprofiled, medians of --steps, so that the
profile's totals can be read against them (cProfile slows Python-heavy code more than C++).

The unprofiled checked steps are also timed by phase: the training (forward and backward) and
``collect()``, each with the CPU time of the recorder's background threads (``dynaprobe-rec``,
which judge and write) in it. ``--without-param-grads`` adds, per storage mode, a checker that
records no parameter gradient (``record_shared_param_grads`` made a no-op): a diagnostic of what
those pairs cost, not a mode a user has.

    .venv/bin/python bench/profile_step.py [--size 4x256] [--dumps full,stats] [--steps 3]
        [--warmup 2] [--dtype float32] [--top 25] [--without-param-grads]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_bench import (  # noqa: E402
    Compiled,
    Dynaprobe,
    Inherent,
    InherentWithReference,
    gpt2,
    recorder_cpu_seconds,
)

import dynaprobe._modes.single_pass as single_pass  # noqa: E402

PACKAGE = os.sep + "dynaprobe" + os.sep


def group_of(function: tuple) -> str:
    """The group a pstats function key (file, line, name) is counted in."""
    file, _, name = function
    if PACKAGE in file:
        return "dynaprobe/" + file.rsplit(PACKAGE, 1)[1]
    if file == "~":  # a built-in: "<method 'x' of 'dynaprobe._C.Recorder' objects>", ...
        if "dynaprobe" in name:
            return "dynaprobe._C " + name
        if "run_backward" in name:
            return "torch.autograd (C++)"
        if "torch" in name:
            return "torch ops (C++)"
        return "other built-ins"
    if os.sep + "transformers" + os.sep in file:
        return "transformers (Python)"
    if os.sep + "torch" + os.sep in file:
        return "torch (Python)"
    return "other"


def profile_steps(config, ids, steps: int) -> pstats.Stats:
    profiler = cProfile.Profile()
    for _ in range(steps):
        profiler.enable()
        config.step(ids)
        profiler.disable()
        config.settle()
    return pstats.Stats(profiler)


def timed_steps(config, ids, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        config.step(ids)
        times.append(time.perf_counter() - start)
        config.settle()
    return statistics.median(times)


class WithoutParamGrads(Dynaprobe):
    """A checker whose steps record no parameter gradient (the diagnostic of the docstring)."""

    def setup(self):
        super().setup()
        collect = self.checker.collect

        def collect_without_param_grads(*args, **kwargs):
            recorded = single_pass.record_shared_param_grads
            single_pass.record_shared_param_grads = lambda step, targets: None
            try:
                return collect(*args, **kwargs)
            finally:
                single_pass.record_shared_param_grads = recorded

        self.checker.collect = collect_without_param_grads


def phases(config, ids, steps: int) -> dict:
    """Medians over ``steps`` checked steps: seconds of the training (forward and backward) and
    of collect(), and the recorder's CPU seconds in each."""
    rows = []
    for _ in range(steps):
        config.model.zero_grad(set_to_none=True)
        cpu, start = recorder_cpu_seconds(), time.perf_counter()
        loss = config.model(ids, labels=ids).loss
        loss.backward()
        trained_cpu, trained = recorder_cpu_seconds(), time.perf_counter()
        config.checker.collect(loss)
        rows.append((trained - start, trained_cpu - cpu, time.perf_counter() - trained,
                     recorder_cpu_seconds() - trained_cpu))
        config.settle()
    names = ("train", "train recorder CPU", "collect", "collect recorder CPU")
    return {name: statistics.median(row[i] for row in rows) for i, name in enumerate(names)}


def report(name: str, stats: pstats.Stats, steps: int, top: int) -> None:
    groups = defaultdict(float)
    own = []
    for function, (_, calls, tottime, _, _) in stats.stats.items():
        group = group_of(function)
        groups[group] += tottime / steps
        if group.startswith("dynaprobe"):
            own.append((tottime / steps, calls // steps, group, function[2], function[1]))
    total = sum(groups.values())
    print(f"\n== {name}: {total:.3f} s a profiled step")
    print(f"{'group':58} {'s/step':>8} {'share':>6}")
    for group, seconds in sorted(groups.items(), key=lambda item: -item[1]):
        if seconds >= 0.001:
            print(f"{group:58} {seconds:8.3f} {seconds / total:6.1%}")
    checker = sum(s for g, s in groups.items() if g.startswith("dynaprobe"))
    print(f"{'checker (Python and extension)':58} {checker:8.3f} {checker / total:6.1%}")
    print(f"\n  checker functions by own time ({name}):")
    print(f"  {'s/step':>8} {'calls':>7}  function")
    for seconds, calls, group, function, line in sorted(own, reverse=True)[:top]:
        print(f"  {seconds:8.4f} {calls:7d}  {group}:{line}({function})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="4x256", help="layers x hidden (default 4x256, 3.5M)")
    parser.add_argument("--tokens", default="4x256", help="batch x sequence (default 4x256)")
    parser.add_argument("--dumps", default="full,stats")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--without-param-grads", action="store_true",
                        help="also time each storage mode recording no parameter gradient")
    args = parser.parse_args()
    layers, hidden = (int(n) for n in args.size.split("x"))
    batch, sequence = (int(n) for n in args.tokens.split("x"))
    torch.manual_seed(0)
    ids = torch.randint(0, 50257, (batch, sequence))
    dtype = getattr(torch, args.dtype)
    print(f"GPT-2 {layers}x{hidden}, {batch}x{sequence} tokens, {args.dtype}, aot_eager, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as scratch:
        unprofiled = {}
        kinds = [("compiled", Compiled), ("inherent", Inherent)]
        if dtype != torch.float32:  # the default reference runs: its arithmetic is inherent too
            kinds.append(("inherent+ref", InherentWithReference))
        for name, kind in kinds:
            config = kind(name, gpt2(layers, hidden).to(dtype))
            config.setup()
            for _ in range(args.warmup):
                config.step(ids)
            unprofiled[name] = timed_steps(config, ids, args.steps)
        by_phase = {}
        kinds = [("checked", Dynaprobe)] + (
            [("no param grads", WithoutParamGrads)] if args.without_param_grads else [])
        for dump in args.dumps.split(","):
            for label, kind in kinds:
                name = f"{label} {dump}"
                config = kind(name, gpt2(layers, hidden).to(dtype),
                              os.path.join(scratch, name.replace(" ", "-")), dump)
                config.setup()
                for _ in range(args.warmup):
                    config.step(ids)
                    config.settle()
                unprofiled[name] = timed_steps(config, ids, args.steps)
                by_phase[name] = phases(config, ids, args.steps)
                if kind is Dynaprobe:
                    report(f"checked, dump={dump!r}", profile_steps(config, ids, args.steps),
                           args.steps, args.top)
        print("\nunprofiled, median s/step:")
        for name, seconds in unprofiled.items():
            ratios = [f"{seconds / unprofiled[base]:.2f}x {base}"
                      for base in ("inherent", "inherent+ref") if base in unprofiled]
            print(f"  {name:22} {seconds:.3f}  ({', '.join(ratios)})")
        print("\nby phase, unprofiled, medians in seconds (the recorder's CPU: both its threads):")
        print(f"  {'':22} {'train':>7} {'rec CPU':>8} {'collect':>8} {'rec CPU':>8}")
        for name, measured in by_phase.items():
            print(f"  {name:22} " + " ".join(f"{value:{width}.3f}" for value, width in
                                             zip(measured.values(), (7, 8, 8, 8))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
