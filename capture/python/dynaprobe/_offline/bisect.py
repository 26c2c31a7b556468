"""Stage bisection of a stored call: ``python -m dynaprobe.bisect DUMP --module NAME`` and
``PrecisionChecker.bisect(...)`` (docs/guide/diagnosis.md, From a failing row to a repro).

The stored call is replayed (replay.py) eagerly and through torch.compile's stages in order,
each adding one part of the pipeline to the one before:

    eager                       Dynamo's captured graph, run by Python
    aot_eager                   + AOTAutograd (functionalization, the joint forward/backward graph)
    aot_eager_decomp_partition  + Inductor's decompositions and the min-cut partitioner
    inductor                    + Inductor's lowering, fusion and code generation
    inductor_fallback_random    inductor with eager's random number generation
    recorded                    the backend and inductor config the call was captured with, when
                                they are not stock (a custom backend, a custom post-grad pass)

Each stage's forward outputs and gradients (seeded with the stored grad_output) are judged against
the eager run with the report's metrics, tolerances and verdict (``replay.judged``: against a
float64 replay where the capture had a reference). The first stage whose numbers change, in the
forward and in the backward, is where to look; when it is inductor, ``inductor_subsystems=True``
hands the replay to ``torch._inductor.compiler_bisector`` to name the inductor subsystem (passes,
lowerings, config switches) whose switching off restores the tolerances.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._C.vocabulary import KIND_FWD_OUTPUT
from dynaprobe._offline.judging import metrics_lines
from dynaprobe._offline.replay import (
    chosen_dump,
    inductor_patch,
    judged,
    load_call,
    replay_of,
    stock_inductor_config,
)
from dynaprobe._offline.stored_call import (
    BACKEND_HELP,
    IMPORT_HELP,
    UNPICKLE_RISK,
    ReplayError,
    StoredCall,
    import_modules,
    named_backend,
)
from dynaprobe._results.result import CompareResult


@dataclass(frozen=True)
class Stage:
    """One compile stage: a name, the backend that runs the pipeline up to it, and inductor
    config switches set while it compiles (``torch._inductor.config.patch``)."""

    name: str
    backend: Any
    config: Dict[str, Any] = field(default_factory=dict)


STAGES = (
    Stage("eager", "eager"),  # torch.compile's backend "eager", not a side
    Stage("aot_eager", "aot_eager"),
    Stage("aot_eager_decomp_partition", "aot_eager_decomp_partition"),
    Stage("inductor", "inductor"),
    Stage("inductor_fallback_random", "inductor", {"fallback_random": True}),
)


@dataclass
class StageResult:
    """How one stage's numbers compare with eager's: the report's rows (``result``), and per
    direction whether any number changed at all and whether a row fails the tolerances."""

    name: str
    result: Optional[CompareResult]
    error: str = ""  # the stage could not run (a backend error)

    def rows(self, forward: bool) -> list:
        """The report's rows of this stage: forward outputs, or the gradients."""
        if self.result is None:
            return []
        return [r for r in self.result.rows if r.check_type != "note"
                and (r.check_type == KIND_FWD_OUTPUT) == forward]

    @property
    def ran(self) -> bool:
        return not self.error

    def changed(self, forward: bool) -> bool:
        """Whether a number of the stage differs from eager's; never for a stage that did not
        run (its error is said, never taken for a finding)."""
        return any(r.max_abs != 0 or r.status != vocabulary.STATUS_PASS
                   for r in self.rows(forward))

    def failed(self, forward: bool) -> bool:
        return any(r.status == vocabulary.STATUS_FAIL for r in self.rows(forward))

    def max_abs(self, forward: bool) -> float:
        values = [r.max_abs for r in self.rows(forward)]
        return max(values) if values else float("nan")


@dataclass
class BisectResult:
    """The stages of one call, in order. ``first_changed(forward)`` names the first stage whose
    numbers differ from eager at all, ``first_failing(forward)`` the first that fails the
    report's verdict (``judged_by``; None: none); ``inductor`` is compiler_bisector's finding,
    when asked for. ``bool(result)``: no stage fails."""

    module: str
    call: int
    step: int
    stages: List[StageResult]
    inductor: Optional[Any] = None
    recorded: str = ""  # the backend and inductor config captured, in words
    route: str = ""  # what was replayed: the captured graph, or the module rebuilt from its class
    graph_unavailable: str = ""  # why the captured graph was not replayed, when it was not
    ops: Optional[Any] = None  # op localisation (``ops=True``): an ops_result.OpsResult
    ops_error: str = ""  # why the ops could not be compared, when asked for
    # What a stage fails: the report's verdict, against the call replayed in float64 where the
    # capture judged the call against a reference (replay.judged)
    judged_by: str = "the tolerances"

    def first_changed(self, forward: bool = True) -> Optional[str]:
        return next((s.name for s in self.stages if s.changed(forward)), None)

    def first_failing(self, forward: bool = True) -> Optional[str]:
        return next((s.name for s in self.stages if s.failed(forward)), None)

    def __bool__(self) -> bool:
        return self.first_failing(True) is None and self.first_failing(False) is None

    def made_before_codegen(self) -> Optional[str]:
        """With ``ops``: when no op of the compiled aten graphs fails (each matches its own
        eager evaluation) and a stage before inductor's code generation already fails, that
        stage: the aten graph itself carries the difference, made by a decomposition (or
        AOTAutograd's tracing, or the partitioner), not by a kernel. None otherwise."""
        if self.ops is None or self.ops.findings or any(g.fused_output for g in self.ops.graphs):
            return None
        return next((s.name for s in self.stages if s.name in BEFORE_CODEGEN
                     and (s.failed(True) or s.failed(False))), None)

    def not_run(self) -> List[StageResult]:
        """The stages that could not run (their errors say why)."""
        return [s for s in self.stages if not s.ran]

    def text(self) -> str:
        lines = [f"Stage bisection of {self.module} call {self.call} (step {self.step}), each "
                 "stage against eager:"]
        if self.route:
            lines.append(f"  replayed: {self.route}" + (
                f" ({self.graph_unavailable})" if self.graph_unavailable else ""))
        lines.append("")
        lines.append(f"  {'stage':28} {'forward max_abs':>16} {'':4} {'backward max_abs':>16}")
        for stage in self.stages:
            if stage.error:
                lines.append(f"  {stage.name:28} could not run: {stage.error}")
                continue
            cells = []
            for forward in (True, False):
                if not stage.rows(forward):  # no backward replayed (no grad_output stored)
                    cells.append(f"{'-':>16} {'':4}")
                    continue
                status = vocabulary.STATUS_FAIL if stage.failed(forward) else (
                    "diff" if stage.changed(forward) else "same")
                cells.append(f"{stage.max_abs(forward):16.6e} {status:4}")
            lines.append(f"  {stage.name:28} {cells[0]} {cells[1]}")
        lines.append("")
        ran = [s.name for s in self.stages if s.ran]
        lines.append(f"  stages run: {', '.join(ran) or 'none'}" + (
            f"; could not run: {', '.join(s.name for s in self.not_run())}"
            if self.not_run() else ""))
        for forward, direction in ((True, "forward"), (False, "backward")):
            changed, failing = self.first_changed(forward), self.first_failing(forward)
            lines.append(f"  {direction:8} first changes at: {changed or 'no stage'}; first fails "
                         f"{self.judged_by} at: {failing or 'no stage'}")
        stock = [s for s in self.stages if s.name != RECORDED]
        own = next((s for s in self.stages if s.name == RECORDED), None)
        if own is not None and own.error:
            lines.append(f"  the recorded backend ({self.recorded}) did not run: {own.error}")
        elif own is not None and not any(s.failed(True) or s.failed(False) for s in stock) \
                and (own.failed(True) or own.failed(False)):
            lines.append(f"  every stock stage passes and the recorded backend ({self.recorded}) "
                         "fails: the difference comes from the backend's own changes")
        if self.inductor is not None:
            lines.append(f"  inductor subsystem: {self.inductor}")
        if self.ops is not None:
            lines += ["", self.ops.text().rstrip("\n")]
            stage = self.made_before_codegen()
            if stage is not None:
                lines += ["", f"  the difference is in the aten graph itself: {stage} already "
                              f"fails and no op differs from its own eager evaluation, so "
                              f"{BEFORE_CODEGEN[stage]} made it, not a kernel"]
        elif self.ops_error:
            lines += ["", f"  ops not compared: {self.ops_error}"]
        for stage in self.stages:
            if stage.result is not None and (stage.failed(True) or stage.failed(False)):
                lines.append("")
                lines.append(f"  metrics at {stage.name}:")
                lines.extend(metrics_lines(stage.result.rows))
                break
        return "\n".join(lines) + "\n"


RECORDED = "recorded"
# The stages before inductor's code generation, and what each adds to the aten graph.
BEFORE_CODEGEN = {
    "aot_eager": "AOTAutograd's tracing (functionalization, the decompositions it applies by "
                 "default)",
    "aot_eager_decomp_partition": "one of inductor's decompositions (or the min-cut "
                                  "partitioner)",
}


def recorded_stage(call: StoredCall, backend=None) -> Optional[Stage]:
    """The stage of the backend and inductor config the call was captured with (``backend``:
    the backend itself, when the caller has it; else found as ``StoredCall.backend`` finds it);
    None when they are a stock stage's (nothing more to learn). Raises ReplayError when they
    cannot be found here."""
    backend = call.backend() if backend is None else backend
    config = call.inductor_config()
    if isinstance(backend, str) and not config and backend in {s.backend for s in STAGES}:
        return None
    return Stage(RECORDED, backend, config)


def bisect_call(call: StoredCall, stages: Optional[Sequence[Stage]] = None, module=None,
                inductor_subsystems: bool = False, unpickle: bool = False,
                from_class: bool = False, ops: bool = False, backend=None) -> BisectResult:
    """Replays ``call`` eagerly and through each stage; see the module docstring.

    Args:
        call: the stored call (``_replay.load_call``).
        stages: the stages, in pipeline order: ``Stage`` values, and ``RECORDED`` for the stage
            of the recorded backend and config (``recorded_stage``; left out when they are
            stock, said as a stage that could not run when they cannot be found here). Default:
            ``STAGES``, then ``RECORDED``. Each compiles under inductor's stock config with the
            stage's own switches: a switch the process has set counts only in ``RECORDED``.
        module: the module to run (default: the call is replayed from the graphs Dynamo
            captured of it, as the dump keeps them; or, where it keeps none, through the module
            rebuilt from its class).
        inductor_subsystems: when a stage named ``inductor`` is the first to fail, run
            ``torch._inductor.compiler_bisector`` on the replay (it resets Dynamo, and compiles
            many times: slow).
        unpickle: rebuild the module from the pickle the dump holds (``StoredCall.build_module``;
            runs code the dump carries: only for dumps you trust).
        from_class: replay through the module rebuilt from its class, not the captured graphs.
        ops: also find the first op of the module's aten graphs, forward and backward, whose
            value under the recorded backend fails against eager beyond fp64 noise, and the
            inductor kernel that computes it (``dynaprobe._offline.ops``; needs the captured graph).
        backend: the backend the call was captured with, when the caller has it (default:
            imported by the name the dump recorded).
    """
    replay = replay_of(call, from_class, module, unpickle)
    eager = replay.run()
    runs, results = [], []
    stages = list(STAGES) + [RECORDED] if stages is None else list(stages)
    stock = stock_inductor_config()  # what the process set is no stage's unless recorded
    for stage in stages:
        if stage == RECORDED:  # the recorded backend's stage, when it is not a stock one
            try:
                stage = recorded_stage(call, backend)
            except ReplayError as error:  # said as the stage's error; the others still run
                results.append(StageResult(RECORDED, None, str(error)))
                runs.append((Stage(RECORDED, None), None))
                continue
            if stage is None:
                continue
        try:
            with inductor_patch({**stock, **stage.config}):
                runs.append((stage, replay.run(stage.backend, f"bisect_{stage.name}")))
        except Exception as error:  # a stage that cannot compile: said, the others still run
            results.append(StageResult(stage.name, None,
                                       f"{type(error).__name__}: {error}".splitlines()[0]))
            runs.append((stage, None))
    runs.sort(key=lambda pair: pair[0].name == RECORDED)  # the recorded stage comes last
    verdicts = iter(judged(call, replay, eager, [run for _, run in runs if run is not None]))
    failed_stages = {r.name: r for r in results}
    ordered = [failed_stages.get(stage.name) or StageResult(stage.name, next(verdicts))
               for stage, _ in runs]
    result = BisectResult(call.module, call.call, call.step, ordered,
                          recorded=call.recorded_compile(), route=replay.route,
                          graph_unavailable=getattr(replay, "graph_unavailable", ""),
                          judged_by="against the float64 reference" if call.referenced
                          else "the tolerances")
    if inductor_subsystems and "inductor" in (result.first_failing(True),
                                               result.first_failing(False)):
        with inductor_patch(stock):
            result.inductor = _inductor_subsystem(call, replay, eager)
    if ops:
        from dynaprobe._offline.ops import localise  # noqa: PLC0415 - only when asked for

        try:
            result.ops = localise(call, call.backend() if backend is None else backend,
                                  call.inductor_config(), call.recorded_compile())
        except ReplayError as error:
            result.ops_error = str(error)
    return result


def _inductor_subsystem(call: StoredCall, replay, eager):
    """torch._inductor.compiler_bisector on the replay: passes while the stage's numbers stay
    within the tolerances."""
    from torch._inductor.compiler_bisector import CompilerBisector  # noqa: PLC0415

    def passes() -> bool:
        torch._dynamo.reset()
        backend = CompilerBisector.get_backend() or "inductor"
        run = replay.run(backend, "compiler_bisector")
        return judged(call, replay, eager, [run])[0].all_pass

    return CompilerBisector.do_bisect(passes)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynaprobe.bisect",
        description="Replays a stored call through torch.compile's stages (eager, aot_eager, "
                    "aot_eager_decomp_partition, inductor, inductor with fallback_random) and "
                    "names the first stage whose numbers change.")
    parser.add_argument("dump", help="dump folder (or step file) with replay data")
    parser.add_argument("--module", required=True, help="module path, as the report names it")
    parser.add_argument("--call", type=int, default=None)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--stages", default=None, help="comma-separated subset of "
                        + ", ".join(s.name for s in STAGES) + f", {RECORDED} (default: all, "
                        f"{RECORDED} when the captured backend or inductor config is not stock)")
    parser.add_argument("--inductor-subsystems", action="store_true",
                        help="when inductor is the first stage to fail, find its subsystem with "
                             "torch._inductor.compiler_bisector (slow)")
    parser.add_argument("--ops", action="store_true",
                        help="also name the first op of the module's aten graphs (forward, "
                             "backward) whose value under the recorded backend fails against "
                             "eager beyond fp64 noise, with its source line and inductor kernel")
    parser.add_argument("--from-class", action="store_true",
                        help="replay through the module rebuilt from its class (which must be "
                             "importable here) instead of the graphs Dynamo captured")
    parser.add_argument("--unpickle", action="store_true",
                        help="with --from-class: rebuild the module from the pickle the dump "
                             f"holds, when its class needs constructor arguments: {UNPICKLE_RISK}")
    parser.add_argument("--backend", default=None, metavar="MODULE:ATTRIBUTE",
                        help=BACKEND_HELP + f" Its stage is {RECORDED}.")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        metavar="MODULE", help=IMPORT_HELP)
    args = parser.parse_args(argv)
    names = [] if not args.stages else args.stages.split(",")
    by_name = {s.name: s for s in STAGES}
    unknown = [n for n in names if n not in by_name and n != RECORDED]
    if unknown:
        print(f"dynaprobe bisect: unknown stage(s) {', '.join(unknown)}; the stages are "
              f"{', '.join(by_name)}, {RECORDED}", file=sys.stderr)
        return 2
    try:
        import_modules(args.imports)
        backend = None if args.backend is None else named_backend(args.backend)
        call = load_call(chosen_dump("bisect", args.dump), args.module, args.call, args.step)
        result = bisect_call(call, [by_name.get(n, RECORDED) for n in names] or None,
                             inductor_subsystems=args.inductor_subsystems,
                             unpickle=args.unpickle, from_class=args.from_class or args.unpickle,
                             ops=args.ops, backend=backend)
    except (ReplayError, OSError, _C.FormatError) as error:  # OSError: DumpIOError among them
        print(f"dynaprobe bisect: {error}", file=sys.stderr)
        return 2
    print(result.text(), end="")
    if not result:
        return 1
    for stage in result.not_run():  # no stage that ran fails: the answer is incomplete
        print(f"dynaprobe bisect: stage {stage.name} could not run: {stage.error}",
              file=sys.stderr)
    return 2 if result.not_run() else 0
