"""Checks of the arguments users pass to PrecisionChecker, up front, with messages that name the
argument and what was expected (a wrong value found halfway through a training step is worse)."""

from __future__ import annotations

import math
import numbers
import os
from typing import Optional

import torch

from dynaprobe._C.vocabulary import SIDE_COMPILED, SIDE_EAGER
from dynaprobe._mechanics import replay_store as _replay_store
from dynaprobe._mechanics import storage as _storage
from dynaprobe._mechanics.provenance import judging
from dynaprobe._mechanics.reference import expect_reference


def expect_tolerance(name: str, value) -> float:
    """A finite, non-negative real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a non-negative number, but received {value!r} "
                        f"({type(value).__name__})")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite non-negative number, but received {value!r}")
    return float(value)


def expect_flag(name: str, value) -> bool:
    """True or False: a string such as "no" is truthy, so it is refused rather than guessed."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, but received {value!r} "
                        f"({type(value).__name__})")
    return value


def expect_path(name: str, value, optional: bool = False):
    if optional and value is None:
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), but received {value!r}")
    return os.fspath(value)


def expect_cast_dtype(value) -> Optional[torch.dtype]:
    """None, or a floating torch.dtype (whether autocast supports it on the model's device is
    checked when the model is known: _planning.plan_check)."""
    if value is None:
        return None
    if not isinstance(value, torch.dtype):
        raise TypeError(f"cast_dtype must be None or a torch.dtype such as torch.bfloat16, but "
                        f"received {value!r} ({type(value).__name__})")
    if not value.is_floating_point:
        raise ValueError(f"cast_dtype must be a floating dtype that torch.autocast supports "
                         f"(torch.bfloat16, torch.float16), but received {value}")
    return value


def expect_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, but received {value!r}")
    return int(value)


def expect_depth(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"depth must be an integer >= 0 (0: the direct children), but received "
                         f"{value!r}")
    return int(value)


def expect_module_types(name: str, value) -> tuple:
    """A class or a collection of classes, as isinstance() takes them (a bare class is accepted,
    as FSDP's ModuleWrapPolicy users often write it)."""
    types = (value,) if isinstance(value, type) else value
    try:
        types = tuple(types)
    except TypeError:
        types = None
    if not types or not all(isinstance(t, type) for t in types):
        raise TypeError(f"{name} must be a module class or a tuple of module classes, e.g. "
                        f"(nn.Linear,), but received {value!r}")
    return types


def expect_backend(value):
    if not (isinstance(value, str) or callable(value)):
        raise TypeError(f"backend must be a torch.compile backend name (e.g. 'aot_eager', "
                        f"'inductor') or a callable backend, but received {value!r}")
    return value


def expect_verdict(value) -> str:
    """What decides a row with a reference verdict: "reference" or "tolerances"."""
    if value not in ("reference", "tolerances"):
        raise ValueError(f"verdict must be 'reference' (a reference verdict decides its row: "
                         f"noise passes, divergence fails) or 'tolerances' (the spec's tolerance "
                         f"check alone), but received {value!r}")
    return value


def expect_tolerance_rules(value) -> dict:
    """None or {pattern: (atol, rtol)}, patterns non-empty strings without line breaks."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"tolerances must be a dict {{pattern: (atol, rtol)}}, e.g. "
                        f"{{'layers.*.mlp': (1e-3, 1e-2)}}, but received {value!r}")
    rules = {}
    for pattern, pair in value.items():
        if not isinstance(pattern, str) or not pattern or "\n" in pattern:
            raise ValueError(f"tolerances: a pattern must be a non-empty one-line string, but "
                             f"received {pattern!r}")
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"tolerances[{pattern!r}] must be (atol, rtol), but received {pair!r}")
        rules[pattern] = (expect_tolerance(f"tolerances[{pattern!r}] atol", pair[0]),
                          expect_tolerance(f"tolerances[{pattern!r}] rtol", pair[1]))
    return rules


def _received(value) -> str:
    if callable(value) and not isinstance(value, (torch.nn.Module, type)):
        return f"the function {getattr(value, '__qualname__', type(value).__name__)}"
    text = repr(value)
    return f"{text} ({type(value).__name__})" if len(text) <= 60 else type(value).__name__


def expect_module(call: str, name: str, value) -> torch.nn.Module:
    """An ``nn.Module`` argument of a method; ``call`` shows the method called correctly."""
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, but received {_received(value)}: "
                        f"call it as {call}")
    return value


def expect_installable(model, single_pass: bool, installed, cast_dtype,
                       deepcopy_forbidden) -> None:
    """install(model): a module, a single-pass checker, not installed yet; no cast_dtype for a
    model compiled whole, which runs as it was compiled. ``deepcopy_forbidden(model)``: whether
    the model is FSDP2/DTensor-sharded."""
    expect_module("checker.install(model)", "model", model)
    if not single_pass:
        if deepcopy_forbidden(model):
            raise RuntimeError(
                "install() only supports single_pass=True, and two-pass (single_pass=False) "
                "deep-copies the model, which FSDP2/DTensor-sharded models forbid: use "
                "PrecisionChecker(single_pass=True) with install(model) and collect(loss)")
        raise RuntimeError("install() only supports single_pass=True; for two-pass use "
                           "compare(run_step, model)")
    if installed is not None:
        raise RuntimeError("this checker is already installed on a model; call uninstall() "
                           "first")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and cast_dtype is not None:
        raise ValueError("install() of a compiled model (whole-model mode) checks the model "
                         "as it was compiled: cast_dtype is not available (enter "
                         "torch.autocast around the step instead); create the checker "
                         "without it")


def expect_installed(installed) -> None:
    """collect() needs install()."""
    if installed is None:
        raise RuntimeError("collect() needs install(model) first (single-pass), then a "
                           "training or inference step: checker.install(model); loss = "
                           "step(model); checker.collect(loss)")


def expect_comparable(model, single_pass: bool, installed, deepcopy_forbidden) -> None:
    """compare(): single-pass installs on ``model`` (not while installed), two-pass deep-copies
    it (``deepcopy_forbidden(model)``: FSDP2/DTensor-sharded models forbid it)."""
    if single_pass and installed is not None:
        raise RuntimeError("compare() cannot run while install() is active; call "
                           "collect() instead, or uninstall() first")
    if not single_pass and deepcopy_forbidden(model):
        raise RuntimeError(
            "two-pass (single_pass=False) deep-copies the model, which FSDP2/DTensor-sharded "
            "models forbid; use single-pass: PrecisionChecker(single_pass=True) with "
            "install(model) and collect(loss)")


def expect_side(side) -> None:
    """capture(): one side."""
    if side not in (SIDE_EAGER, SIDE_COMPILED):
        raise ValueError(f"side must be 'eager' or 'compiled', not {side!r}")


def expect_step(call: str, fn, model) -> None:
    """``(fn, model)`` of compare() and capture(): the step function first, then the model."""
    if isinstance(fn, torch.nn.Module) and not isinstance(model, torch.nn.Module):
        raise TypeError(f"the arguments are swapped: the step function comes first, then the "
                        f"model: {call}")
    if not callable(fn):
        raise TypeError(f"fn must be a function running one step of the model and returning "
                        f"its loss, but received {_received(fn)}: {call}")
    expect_module(call, "model", model)


def expect_loss(name: str, value) -> None:
    """A loss: a one-element tensor or a real number (None: none)."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be the step's scalar loss, but received a tensor of "
                             f"shape {tuple(value.shape)}: pass loss (or loss.mean())")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be the step's loss (a one-element tensor or a number), but "
                        f"received {_received(value)}")


class CheckerOptions:
    """The options a PrecisionChecker is made with, checked up front, as its public attributes
    (see PrecisionChecker for each); ``check_every``/``check_steps`` become the schedule of its
    checked steps, ``dump_dir`` the folder it was given (None: the default)."""

    def __init__(self, backend, threshold, dump_graphs, graph_dir, cast_dtype, capture_input,
                 single_pass, *, dump_dir, scenario, rtol, memory_budget_bytes, reference,
                 verdict, tolerances, dtype_aware_tolerances, dump, check_every, check_steps,
                 disk_budget_bytes, replay, strict_io):
        self.backend = expect_backend(backend)
        self.threshold = expect_tolerance("threshold", threshold)
        self.dump_graphs = expect_flag("dump_graphs", dump_graphs)
        self.graph_dir = expect_path("graph_dir", graph_dir)
        self.cast_dtype = expect_cast_dtype(cast_dtype)
        self.capture_input = expect_flag("capture_input", capture_input)
        self.single_pass = expect_flag("single_pass", single_pass)
        if not isinstance(scenario, str):
            raise TypeError(f"scenario must be a str, but received {scenario!r}")
        self.scenario = scenario
        self.rtol = expect_tolerance("rtol", rtol)
        self.memory_budget_bytes = expect_positive_int("memory_budget_bytes", memory_budget_bytes)
        self._dump_dir_given = expect_path("dump_dir", dump_dir, optional=True)
        self.reference = expect_reference(reference, self.single_pass)
        self.verdict = expect_verdict(verdict)
        self.tolerances = expect_tolerance_rules(tolerances)
        self.dtype_aware_tolerances = expect_flag("dtype_aware_tolerances",
                                                  dtype_aware_tolerances)
        self.dump = _storage.expect_dump_mode(dump)
        self._schedule = _storage.Schedule(expect_positive_int("check_every", check_every),
                                           _storage.expect_steps(check_steps))
        self.disk_budget_bytes = None if disk_budget_bytes is None else \
            expect_positive_int("disk_budget_bytes", disk_budget_bytes)
        self.replay = _replay_store.expect_replay(replay, self.single_pass, self.dump)
        self.strict_io = expect_flag("strict_io", strict_io)
        # The tolerances as the engine takes them, built once and passed to each verb's steps.
        self._judging = judging(self)
