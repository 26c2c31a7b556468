"""Remedies, tried and proved on the stored call: ``python -m dynaprobe.remedy DUMP`` and
``PrecisionChecker.remedy()`` (docs/guide/diagnosis.md, From a finding to a fix).

For each failing module with a stored call, root cause first, the call is replayed (replay.py)
with the backend and inductor config it was captured with, which must fail again as the report
says, and then under each candidate change:

    switches      inductor config switches that change numerics, set over the recorded config:
                  eager's random numbers, eager's rounding at low-precision casts, no pattern
                  rewrites, no fusion, no split reductions, ... (``SWITCHES``); and each switch
                  the capture had set away from its default, put back (a custom post-grad pass)
    backends      the stock stages before inductor's code generation (and stock inductor when
                  the recorded backend is another): the module compiled with less of the pipeline
    uncompiled    the module left to run eagerly (``torch.compiler.disable``)

Each change's forward outputs and gradients (seeded with the stored grad_output) are judged
against the eager replay with the report's tolerances and verdict (``replay.judged``: against a
float64 replay where the capture had a reference). The changes whose every row
passes are ranked by what they cost: the median time of the call, forward and backward, compiled
with the change (measured here, after its compile). The cheapest is the remedy, printed as the
code to paste and written to the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from dynaprobe import _C
from dynaprobe._mechanics.graphs import real_backend
from dynaprobe._mechanics.replay_store import inductor_stock_value
from dynaprobe._offline.replay import (
    chosen_dump,
    failing_modules,
    inductor_patch,
    judged,
    load_call,
    replay_attributes,
    replay_of,
    step_files,
    step_result,
    stock_inductor_config,
)
from dynaprobe._offline.stored_call import (
    BACKEND_HELP,
    IMPORT_HELP,
    ReplayError,
    Run,
    StoredCall,
    import_modules,
    named_backend,
    recorded_name,
)
from dynaprobe._results.result import CompareResult

# Inductor switches that change numerics, each with what it does and the devices it matters on
# (None: every device). CompilerBisector's config changes, and the pass and fusion families it
# bisects, as far as a config switch turns them off.
SWITCHES: Tuple[Tuple[Dict[str, Any], str, Optional[str]], ...] = (
    ({"fallback_random": True}, "eager's random number generation (dropout, torch.rand)", None),
    ({"emulate_precision_casts": True}, "eager's rounding at each low-precision cast", None),
    ({"pattern_matcher": False}, "no pattern rewrites (joint-graph and post-grad passes)", None),
    ({"max_fusion_size": 1}, "no fusion: a kernel per op", None),
    ({"split_reductions": False}, "each reduction in one pass, not split", None),
    ({"online_softmax": False}, "softmax without the one-pass (online) rewrite", None),
    ({"cpp.simdlen": 1}, "scalar C++ kernels, no vectorization", "cpu"),
    ({"layout_optimization": False}, "no channels-last layout change for convolutions", "cuda"),
    ({"comprehensive_padding": False}, "no padding of strides", "cuda"),
)
# Stock backends before inductor's code generation, most of the pipeline first.
BACKENDS = ("aot_eager_decomp_partition", "aot_eager", "eager")
# Backends that never compile with inductor: its switches cannot change them.
_WITHOUT_INDUCTOR = frozenset(BACKENDS) | {"cudagraphs"}


@dataclass(frozen=True)
class Change:
    """One change to how a module compiles: inductor config switches set over the recorded
    config (with the recorded backend), another backend (``backend``, under inductor's stock
    config), or the module left uncompiled."""

    name: str
    what: str
    config: Dict[str, Any] = field(default_factory=dict)
    backend: Optional[str] = None  # a stock backend in place of the recorded one
    uncompiled: bool = False

    def code(self, module: str, recorded_backend: str) -> str:
        """The change as code to paste into the training script (``model``: the user's): for
        the module compiled on its own (per-block compile, as the checker compiles it), then,
        as a comment, the line for a model compiled whole (Dynamo inlines a submodule's own
        compile into the whole model's graph, so there a switch applies to the whole model)."""
        block = f'model.get_submodule("{module}")' if module else "model"
        if self.uncompiled:  # a graph break under a whole-model compile too
            return (f"block = {block}  # left uncompiled: Dynamo runs it eagerly\n"
                    "block.forward = torch.compiler.disable(block.forward)")
        if self.backend is None and recorded_backend != "inductor":
            lines = ["import torch._inductor.config  # before the first compiled step: every "
                     "module your backend compiles with inductor gets it"]
            return "\n".join(lines + [f"torch._inductor.config.{k} = {v!r}"
                                      for k, v in self.config.items()])
        arguments = self.compile_arguments(recorded_backend)
        return (f"{block}.compile({arguments})\n"
                f"# a model compiled whole: model = torch.compile(model, {arguments})")

    def compile_arguments(self, recorded_backend: str) -> str:
        """The arguments of ``torch.compile`` that make the change (for a backend, or for
        switches over inductor)."""
        if self.backend is not None:
            return f'backend="{self.backend}"'
        options = ", ".join(f"{json.dumps(k)}: {v!r}" for k, v in self.config.items())
        return f'backend="{recorded_backend}", options={{{options}}}'

    def compile_backend(self, recorded_backend) -> Any:
        """The backend that compiles a module with this change, in place of
        ``recorded_backend`` (as ``torch.compile(backend=..., options=...)`` makes it); for
        switches over a backend other than inductor, the backend itself (``global_config``
        gives the switches, set for the whole run as the pasted code sets them)."""
        if self.backend is not None:
            return real_backend(self.backend)
        if recorded_backend == "inductor":
            return real_backend("inductor", dict(self.config))
        return real_backend(recorded_backend)

    def global_config(self, recorded_backend) -> Dict[str, Any]:
        """The inductor switches this change sets for the whole run: those over a backend other
        than inductor, which no per-module option reaches."""
        return {} if self.backend is not None or self.uncompiled or \
            recorded_backend == "inductor" else dict(self.config)

    def to_json(self) -> dict:
        return {"name": self.name, "what": self.what, "uncompiled": self.uncompiled,
                "backend": self.backend,
                "config": {k: v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)
                           for k, v in self.config.items()}}


@dataclass
class Trial:
    """One change replayed: the report's rows against eager (``result``), or why it could not
    run (``error``), and the call's median time with it (``seconds``; NaN: not timed)."""

    change: Change
    result: Optional[CompareResult] = None
    error: str = ""
    seconds: float = math.nan

    @property
    def passes(self) -> bool:
        return self.result is not None and self.result.all_pass

    @property
    def verdict(self) -> str:
        if self.error:
            return "could not run"
        return "pass" if self.passes else "FAIL"

    def max_abs(self) -> float:
        values = [r.max_abs for r in self.result.rows if r.check_type != "note"] \
            if self.result is not None else []
        return max(values) if values else math.nan


RECORDED = Change("recorded", "the backend and inductor config the call was captured with")


@dataclass
class ModuleRemedy:
    """The changes tried on one stored call: ``recorded`` (the capture's own compile, which must
    fail again), then ``trials`` in the order tried; ``remedy``: the cheapest that passes."""

    module: str
    call: int
    step: int
    recorded_compile: str  # the recorded backend and config, in words
    recorded_backend: str  # its name, as the paste code spells it
    recorded: Trial
    trials: List[Trial] = field(default_factory=list)

    @property
    def reproduces(self) -> bool:
        """Whether the recorded compile fails on replay, as the report says it did."""
        return self.recorded.result is not None and not self.recorded.passes

    def passing(self) -> List[Trial]:
        """The changes that pass every row, cheapest first (those not timed last)."""
        found = [t for t in self.trials if t.passes]
        return sorted(found, key=lambda t: (math.isnan(t.seconds), t.seconds))

    @property
    def remedy(self) -> Optional[Trial]:
        found = self.passing()
        return found[0] if found and self.reproduces else None

    def code(self) -> str:
        """The remedy as code to paste; empty without one."""
        best = self.remedy
        return best.change.code(self.module, self.recorded_backend) if best else ""

    def text(self) -> str:
        lines = [f"Remedies for {self.module} call {self.call} (step {self.step}), captured with "
                 f"{self.recorded_compile}: each change replayed on the stored call and judged "
                 "against eager as the report judges"]
        if self.recorded.error:
            return "\n".join(lines + [f"  the recorded compile could not run: "
                                      f"{self.recorded.error}"]) + "\n"
        if not self.reproduces:
            return "\n".join(lines + [
                "  the recorded compile passes on replay: the difference does not reproduce from "
                "the stored call, so no change can be proved (replay every call with "
                "replay=\"all\" and check again, or bisect it: dynaprobe bisect)"]) + "\n"
        base = self.recorded.seconds
        lines += ["", f"  {'change':36} {'rows':13} {'max_abs':>12} {'call time':>11} "
                      f"{'x recorded':>10}"]
        for trial in [self.recorded] + self.trials:
            if trial.error:
                lines.append(f"  {trial.change.name:36} could not run: {trial.error}")
                continue
            timed = not math.isnan(trial.seconds)
            lines.append(f"  {trial.change.name:36} {trial.verdict:13} {trial.max_abs():12.4e} "
                         f"{_milliseconds(trial.seconds) if timed else '-':>11} "
                         f"{f'{trial.seconds / base:.2f}' if timed else '-':>10}")
        lines.append("")
        best = self.remedy
        if best is None:
            lines.append("  no change passes every row: report it (dynaprobe bundle)")
            return "\n".join(lines) + "\n"
        lines.append("  passing, cheapest first: " + ", ".join(
            f"{t.change.name} {t.seconds / base:.2f}x" for t in self.passing()))
        lines.append(f"  remedy: {best.change.name} ({best.change.what}): every row passes, "
                     f"{best.seconds / base:.2f}x the recorded call's time; paste:")
        lines += ["      " + line for line in self.code().splitlines()]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        def trial(t: Trial) -> dict:
            return {"change": t.change.to_json(), "verdict": t.verdict, "error": t.error,
                    "max_abs": _number(t.max_abs()), "seconds": _number(t.seconds)}

        best = self.remedy
        return {"module": self.module, "call": self.call, "step": self.step,
                "recorded_compile": self.recorded_compile, "reproduces": self.reproduces,
                "recorded": trial(self.recorded), "trials": [trial(t) for t in self.trials],
                "remedy": None if best is None else {**trial(best), "code": self.code()}}


@dataclass
class RemedyResult:
    """The remedies of a dump's step: one ``ModuleRemedy`` per failing module with a stored
    call, root cause first; ``skipped``: failing modules that could not be tried, and why.
    ``bool(result)``: some module's difference reproduced, and every one that did has a
    remedy."""

    dump: str
    step: int
    modules: List[ModuleRemedy] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        tried = [m for m in self.modules if m.reproduces]
        return bool(tried) and all(m.remedy is not None for m in tried)

    def text(self) -> str:
        parts = [m.text() for m in self.modules]
        if self.skipped:
            parts.append("".join(f"not tried: {why}\n" for why in self.skipped))
        return "\n".join(parts)

    def to_json(self) -> dict:
        return {"dump": self.dump, "step": self.step,
                "modules": [m.to_json() for m in self.modules], "skipped": self.skipped}


def candidates(backend, recorded_config: Dict[str, Any], device: str) -> List[Change]:
    """The changes to try on a call captured with ``backend`` and ``recorded_config`` on
    ``device``: see the module docstring."""
    changes = []
    if not (isinstance(backend, str) and backend in _WITHOUT_INDUCTOR):
        for config, what, only_on in SWITCHES:
            if only_on is None or device.startswith(only_on):
                changes.append(Change(_spelled(config), what, config))
        for key in recorded_config:  # a switch the capture set, put back to inductor's own
            stock = {key: inductor_stock_value(key)}
            changes.append(Change(_spelled(stock), "the capture's own switch put back to "
                                  "inductor's default", stock))
    if backend != "inductor":
        changes.append(Change('backend="inductor"', "stock inductor in place of the recorded "
                              "backend", backend="inductor"))
    changes += [Change(f'backend="{name}"', f"compiled by {name}: less of the pipeline",
                       backend=name) for name in BACKENDS if name != backend]
    changes.append(Change("uncompiled", "left to run eagerly: torch.compiler.disable",
                          uncompiled=True))
    return changes


def remedy_call(call: StoredCall, module=None, backend=None, changes: Optional[Sequence[Change]]
                = None, repeats: int = 5, from_class: bool = False,
                unpickle: bool = False) -> ModuleRemedy:
    """Tries the changes on ``call``; see the module docstring.

    Args:
        call: the stored call (``replay.load_call``).
        module: the module to run (default: replayed from the graphs Dynamo captured of it).
        backend: the backend the call was captured with, when the caller has it (default: as
            the dump recorded it, which must be found here: ``--backend``, ``--import``).
        changes: the changes to try (default: ``candidates`` for the recorded compile).
        repeats: how many timed runs of each passing change, after the judged one (median).
        from_class, unpickle: as for ``bisect_call``.
    """
    replay = replay_of(call, from_class, module, unpickle)
    backend = call.backend() if backend is None else backend
    recorded_config = call.inductor_config()
    stock = stock_inductor_config()
    eager = replay.run()
    if changes is None:
        changes = candidates(backend, recorded_config, getattr(replay, "device", "cpu"))

    def attempt(change: Change) -> Tuple[Trial, Optional[Run], Optional[Callable]]:
        if change.uncompiled:
            config, compile_with = stock, None
        elif change.backend is not None:
            config, compile_with = stock, change.backend
        else:
            config, compile_with = {**stock, **recorded_config, **change.config}, backend
        label = "remedy_" + "".join(c if c.isalnum() else "_" for c in change.name)
        try:
            with inductor_patch(config):
                runner = replay.runner(compile_with, label)
                run = runner()  # compiles, forward and backward
        except Exception as error:  # a change that cannot compile: said, the others still run
            return Trial(change, error=f"{type(error).__name__}: {error}".splitlines()[0]), \
                None, None

        def timed() -> Run:
            with inductor_patch(config):  # a recompile sees the change too
                return runner()

        return Trial(change), run, timed

    attempts = [attempt(change) for change in [RECORDED, *changes]]
    ran = [(trial, run, timed) for trial, run, timed in attempts if run is not None]
    results = judged(call, replay, eager, [run for _, run, _ in ran])
    for (trial, _, _), result in zip(ran, results):
        trial.result = result
    recorded, trials = attempts[0][0], [trial for trial, _, _ in attempts[1:]]
    found = ModuleRemedy(call.module, call.call, call.step, call.recorded_compile(),
                         recorded_name(call.replay.get("backend", {})), recorded, trials)
    if found.reproduces:
        for trial, _, timed in attempts:
            if timed is not None and (trial is recorded or trial.passes):
                trial.seconds = median_seconds(timed, repeats)
    return found


def remedy_dump(dump: str, modules: Optional[Sequence[str]] = None, step: Optional[int] = None,
                call: Optional[int] = None, among: Optional[Sequence[int]] = None,
                **options) -> RemedyResult:
    """The remedies of ``modules`` (default: the step's failing modules with a stored call, root
    cause first) at ``step`` (default: the first step of the dump, of the steps ``among`` when
    given, with a failing row); ``options`` as for ``remedy_call``."""
    chosen = None
    for index, path in step_files(dump, step):
        if among is not None and index not in among:
            continue
        result = step_result(index, path)
        if not result.all_pass or step is not None:
            chosen = (index, path, result)
            break
    if chosen is None:
        raise ReplayError(f"no step of {dump} has a failing row: nothing to remedy")
    index, path, result = chosen
    kept = replay_attributes(_C.read_step(path))
    found = RemedyResult(path, index)
    for module in list(modules or failing_modules(result)):
        if module not in kept:
            found.skipped.append(f"{module} (step {index}): the dump keeps no replay data of it "
                                 "(single-pass with replay=\"failing\", the default, keeps the "
                                 "calls with a failing row)")
            continue
        found.modules.append(remedy_call(load_call(path, module, call, index), **options))
    return found


def _spelled(config: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


def median_seconds(run: Callable[[], Any], repeats: int) -> float:
    """The median time of ``run`` after one untimed run (the first after a compile still
    settles): ``repeats`` runs at least, more (up to 200) while they add up to under 50 ms, so
    that a call of microseconds is timed as steadily as a long one."""
    run()
    times: List[float] = []
    while len(times) < max(1, repeats) or (sum(times) < 0.05 and len(times) < 200):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _number(value: float) -> Optional[float]:
    return None if math.isnan(value) else value


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynaprobe.remedy",
        description="Replays each failing module's stored call under candidate changes "
                    "(inductor switches, other backends, the module uncompiled), judges each as "
                    "the report does, and prints the cheapest change that passes as code to "
                    "paste.")
    parser.add_argument("dump", help="dump folder (or step file) with replay data")
    parser.add_argument("--module", action="append", default=None,
                        help="module path, as the report names it (repeatable; default: the "
                             "step's failing modules with a stored call, root cause first)")
    parser.add_argument("--call", type=int, default=None)
    parser.add_argument("--step", type=int, default=None,
                        help="default: the first step with a failing row")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs of each passing change (median; default 5)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write what was tried and the remedy as JSON")
    parser.add_argument("--from-class", action="store_true",
                        help="replay through the module rebuilt from its class instead of the "
                             "graphs Dynamo captured")
    parser.add_argument("--backend", default=None, metavar="MODULE:ATTRIBUTE", help=BACKEND_HELP)
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        metavar="MODULE", help=IMPORT_HELP)
    args = parser.parse_args(argv)
    try:
        import_modules(args.imports)
        backend = None if args.backend is None else named_backend(args.backend)
        result = remedy_dump(chosen_dump("remedy", args.dump), args.module, args.step, args.call,
                             backend=backend, repeats=args.repeats, from_class=args.from_class)
    except (ReplayError, OSError, _C.FormatError) as error:  # OSError: DumpIOError among them
        print(f"dynaprobe remedy: {error}", file=sys.stderr)
        return 2
    print(result.text(), end="")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result.to_json(), out, indent=1)
    if result:
        return 0
    if any(m.reproduces for m in result.modules):
        return 1  # a difference that reproduces and that no change fixes
    print("dynaprobe remedy: no failing module's difference reproduced on replay: nothing to "
          "remedy" + ("" if result.modules else " (no failing module keeps a stored call)"),
          file=sys.stderr)
    return 2
