"""``PrecisionChecker.confirm()``: a remedy applied in the training process and proved on the
next checked step (docs/guide/diagnosis.md, From a finding to a fix).

The step runs twice from the same state, as two-pass runs it: an eager copy of the model, and a
copy whose wrapped modules compile with the remedy's changes (a module left uncompiled runs
eagerly and is not compared). It is confirmed when every row passes, the losses match (the
report's loss verdict) and so do the gradient norms, within the checker's tolerances. The step
is timed too, each form warmed up (compiled) and then run ``repeats`` times: eager, the wrapped
modules compiled as the checker compiles them (``torch.compile(module)``), and compiled with the
remedy, so that the speed the remedy keeps is measured. A confirmed remedy stays applied: later
checked steps compile those modules with it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn as nn

from dynaprobe._C.vocabulary import SIDE_COMPILED, SIDE_EAGER
from dynaprobe._offline.remedy import Change, ModuleRemedy, RemedyResult, median_seconds
from dynaprobe._offline.replay import inductor_patch
from dynaprobe._results.result import CompareResult
from dynaprobe._steps import planning as _planning


@dataclass
class Confirmation:
    """The checked step run with the remedy (``result``), the gradient norms of its eager and
    compiled sides, and the median step times (``seconds``: ``eager``, ``compiled`` without the
    remedy, ``remedied``). ``bool(confirmation)``: confirmed."""

    changes: Dict[str, Change]
    result: CompareResult
    grad_norms: Tuple[float, float]
    tolerances: Tuple[float, float]
    every_module_uncompiled: bool = False  # no wrapped module left to compare
    seconds: Dict[str, float] = field(default_factory=dict)

    @property
    def grad_norms_match(self) -> bool:
        eager, compiled = self.grad_norms
        atol, rtol = self.tolerances
        return abs(compiled - eager) <= atol + rtol * abs(eager)

    @property
    def losses_match(self) -> bool:
        eager, compiled = self.result.loss_eager, self.result.loss_compiled
        atol, rtol = self.tolerances
        return abs(compiled - eager) <= atol + rtol * abs(eager)

    @property
    def rows_pass(self) -> bool:
        """Every row passes; with no row compared, when every wrapped module was left
        uncompiled by the remedy (the losses and gradient norms then decide)."""
        if self.result.counts.get("compared", 0) == 0:
            return self.every_module_uncompiled
        return self.result.all_pass

    @property
    def confirmed(self) -> bool:
        return self.rows_pass and self.losses_match and self.grad_norms_match

    def __bool__(self) -> bool:
        return self.confirmed

    def text(self) -> str:
        step = self.result.step
        eager, compiled = self.grad_norms
        facts = (f"loss eager={self.result.loss_eager!r} compiled={self.result.loss_compiled!r}, "
                 f"gradient norm eager={eager!r} compiled={compiled!r}")
        if self.confirmed:
            rows = "every row passes" if self.result.counts.get("compared", 0) else \
                "every wrapped module left uncompiled (no row to compare)"
            lines = [f"confirmed on step {step}: {rows}, {facts}"]
        else:
            failing = [f"{r.module} {r.check_type}[{r.tensor_index}]"
                       for r in self.result.failures]
            why = ([f"{len(failing)} row(s) fail or warn ({', '.join(failing[:4])})"]
                   if failing else []) + ([] if self.losses_match else
                                          ["the losses differ beyond the tolerances"]) + (
                [] if self.grad_norms_match else
                ["the gradient norms differ beyond the tolerances"])
            lines = [f"not confirmed on step {step}: {'; '.join(why) or 'the step fails'}; "
                     f"{facts}"]
        lines += [f"  {module}: {change.name} ({change.what})"
                  for module, change in self.changes.items()]
        if self.seconds:
            remedied, before, eager = (self.seconds[k] for k in ("remedied", "compiled", "eager"))
            lines.append(f"  a step with the remedy takes {remedied * 1e3:.3g} ms: "
                         f"{remedied / before:.2f}x the compiled step without it "
                         f"({before * 1e3:.3g} ms), {remedied / eager:.2f}x eager "
                         f"({eager * 1e3:.3g} ms)")
        if self.confirmed:
            lines.append("  applied from now on: the checker compiles these modules with it")
        return "\n".join(lines) + "\n"


def changes_of(remedy) -> Dict[str, Change]:
    """Module -> change, of what ``checker.confirm`` was given: a ``RemedyResult`` (each
    module's remedy), a ``ModuleRemedy`` (its remedy), or a dict of module -> ``Change``."""
    if isinstance(remedy, RemedyResult):
        found = [m for m in remedy.modules if m.remedy is not None]
        return {m.module: m.remedy.change for m in found}
    if isinstance(remedy, ModuleRemedy):
        return {} if remedy.remedy is None else {remedy.module: remedy.remedy.change}
    if isinstance(remedy, dict) and all(isinstance(c, Change) for c in remedy.values()):
        return dict(remedy)
    raise TypeError(f"checker.confirm takes what checker.remedy() returned (a RemedyResult, or "
                    f"one of its modules), or a dict of module -> Change; it received "
                    f"{type(remedy).__name__}")


def confirm(checker, remedy, fn: Callable[[nn.Module], Any], model: nn.Module,
            repeats: int = 3) -> Confirmation:
    """``PrecisionChecker.confirm``; see the module docstring."""
    changes = changes_of(remedy)
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError("checker.confirm checks modules compiled on their own (per-block "
                         "compile); for a model compiled whole, apply the remedy's whole-model "
                         "line (remedy.text()) and check the next step as before")
    if not changes:
        raise ValueError("the remedy holds no change to confirm: no module's difference "
                         "reproduced, or no change passed (remedy.text() says which)")
    paths = dict(_planning.plan_check(model, checker._wrapped, checker._ignored,
                                      checker.cast_dtype).targets)
    unknown = [m for m in changes if m not in paths]
    if unknown:
        raise ValueError(f"the remedy changes {', '.join(unknown)}, which the checker does not "
                         f"wrap in this model (its wrapped modules: {', '.join(paths)})")
    installed = checker._installation is not None
    if installed:
        checker.uninstall()  # the step runs on copies; installed again after, with the changes
    backend = checker.backend
    settings: Dict[str, Any] = {}
    for change in changes.values():
        settings.update(change.global_config(backend))
    uncompiled = [model.get_submodule(paths[m]) for m, c in changes.items() if c.uncompiled]
    recorder = checker._compiler.graphs
    before = dict(recorder.changed)
    ignored = list(checker._ignored)
    recorder.changed.update({m: c.compile_backend(backend) for m, c in changes.items()
                             if not c.uncompiled})
    checker._ignored.extend(uncompiled)
    confirmed = False
    try:
        by_path = {paths[m]: c for m, c in changes.items()}
        # The checker compiles the wrapped modules of the compiled side itself (with the
        # changed backends); only a module left uncompiled is changed on the copy.
        sides = [(SIDE_EAGER, copy.deepcopy(model)),
                 (SIDE_COMPILED, _remedied(copy.deepcopy(model), by_path, backend, []))]
        with inductor_patch(settings):
            result = checker._run_sides(fn, model, sides)
        found = Confirmation(changes, result, (_grad_norm(sides[0][1]), _grad_norm(sides[1][1])),
                             (checker._judging.atol, checker._judging.rtol),
                             len(uncompiled) == len(paths))
        targets = list(paths.values())
        found.seconds = {
            "eager": _step_seconds(fn, copy.deepcopy(model), {}, repeats),
            "compiled": _step_seconds(fn, _remedied(copy.deepcopy(model), {}, backend,
                                                    targets), {}, repeats),
            "remedied": _step_seconds(fn, _remedied(copy.deepcopy(model), by_path, backend,
                                                    targets), settings, repeats)}
        confirmed = found.confirmed
        return found
    finally:
        if not confirmed:  # only a confirmed remedy stays applied
            recorder.changed.clear()
            recorder.changed.update(before)
            checker._ignored[:] = ignored
        if installed:
            checker.install(model)


def _remedied(model: nn.Module, changes: Dict[str, Change], backend,
              compiled: List[str]) -> nn.Module:
    """``model`` with each changed module (by path) as the remedy's code makes it, and the other
    modules at ``compiled`` (paths) compiled on their own with ``backend``, as the checker
    compiles its wrapped modules."""
    for path in compiled:
        if path not in changes:
            model.get_submodule(path).compile(backend=backend)
    for path, change in changes.items():
        block = model.get_submodule(path)
        if change.uncompiled:
            block.forward = torch.compiler.disable(block.forward)
        elif compiled:
            block.compile(backend=change.compile_backend(backend))
    return model


def _grad_norm(model: nn.Module) -> float:
    grads = [p.grad.detach().double() for p in model.parameters() if p.grad is not None]
    return math.sqrt(sum(float(g.square().sum()) for g in grads)) if grads else 0.0


def _step_seconds(fn: Callable, model: nn.Module, settings: Dict[str, Any],
                  repeats: int) -> float:
    """The median time of ``fn(model)`` after a run that compiles."""
    with inductor_patch(settings):
        fn(model)
        return median_seconds(lambda: fn(model), repeats)
