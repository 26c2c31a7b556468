"""Replaying one stored call: finding it in a dump (``load_call``: the step file, its replay
data, its tensors) and replaying it, from the graphs Dynamo captured of it (``GraphReplay``: no
model code runs) or through its module rebuilt from its class (``ClassReplay``).

The stored call itself is stored_call.py; judging two runs with the engine, judging.py. Used by
``python -m dynaprobe.repro`` (a standalone folder), ``python -m dynaprobe.bisect``,
``PrecisionChecker.bisect`` and the bundle.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._C.vocabulary import (
    KIND_FWD_OUTPUT,
    KIND_GRAD_INPUT,
    SIDE_COMPILED,
    SIDE_REFERENCE,
)
from dynaprobe._mechanics.graph_runner import raised, replay_graphs
from dynaprobe._mechanics.replay_store import (
    GRAPH_TENSOR,
    KIND,
    PARAM,
    STRUCTURE,
    inductor_config_changes,
    split_label,
)
from dynaprobe._mechanics.storage import committed_steps
from dynaprobe._offline.judging import judge
from dynaprobe._offline.stored_call import ReplayError, Run, StoredCall
from dynaprobe._results.result import CompareResult
from dynaprobe._steps.compiling import own_entry


class ClassReplay:
    """A stored call replayed through its module, rebuilt from its class (or pickle)."""

    route = "the module rebuilt from its class"
    graph_unavailable = ""  # why the captured graph was not used, when it was not

    def __init__(self, call: StoredCall, module: nn.Module):
        self.call, self.module = call, module
        self._reference: Optional[Run] = None

    def run(self, backend=None, label: str = "replay") -> Run:
        """The call run eagerly (``backend`` None) or compiled with ``backend``."""
        return self.runner(backend, label)()

    def runner(self, backend=None, label: str = "replay") -> Callable[[], Run]:
        """What runs the call again and again, compiled once (on its first run) with
        ``backend``, or eagerly (None)."""
        forward = self.module.forward if backend is None else self.call.compiled_forward(
            self.module, backend, label)
        return lambda: self.call.run(self.module, forward)

    def reference(self) -> Run:
        """The call run eagerly in float64 on a copy of the module raised to it, its floating
        inputs and gradients too, autocast off: the reference of a low-precision call, as
        ``PrecisionChecker(reference="fp64")``. Run once, then kept."""
        if self._reference is None:
            wide = copy.deepcopy(self.module).to(torch.float64)
            self._reference = self.call.run(wide, wide.forward, dtype=torch.float64)
        return self._reference


class GraphReplay:
    """A stored call replayed from the graphs Dynamo captured of it: runs with no model code."""

    route = "the captured graph"

    def __init__(self, call: StoredCall):
        self.call = call
        self.calls = call.graph_calls()
        self.graphs = call.graph_modules()
        tensors = [a for c in self.calls for a in c.args if isinstance(a, torch.Tensor)]
        self.device = str(tensors[0].device) if tensors else "cpu"
        self._reference: Optional[Run] = None

    def run(self, backend=None, label: str = "replay") -> Run:
        """The graphs run by Python (``backend`` None) or each compiled with ``backend``."""
        return self.runner(backend, label)()

    def runner(self, backend=None, label: str = "replay") -> Callable[[], Run]:
        """What runs the call again and again, each graph compiled once (on its first run)
        with ``backend``, or run by Python (None)."""
        graphs = self.graphs if backend is None else {
            function: torch.compile(own_entry(gm.forward, f"{label}_{function}"),
                                    backend=backend)
            for function, gm in self.graphs.items()}
        return lambda: self._run(graphs)

    def reference(self) -> Run:
        """The graphs run by Python in float64, every floating tensor raised and autocast off:
        the reference of a low-precision call, as ``PrecisionChecker(reference="fp64")``. Run
        once, then kept."""
        if self._reference is None:
            self._reference = self._run(self.graphs, raised(self.calls), float64=True)
        return self._reference

    def _run(self, graphs: Dict[str, Callable], calls: Optional[List] = None,
             float64: bool = False) -> Run:
        replayed = replay_graphs(self.calls if calls is None else calls, graphs,
                                 bool(self.call.description["grad_mode"]),
                                 None if float64 else self.call.autocast_dtype, self.device)
        run = Run([t for _, t in replayed.outputs])
        for index, (name, _) in enumerate(replayed.outputs):
            run.labels[(KIND_FWD_OUTPUT, index)] = name
        for index, (name, grad) in enumerate(replayed.grad_inputs):
            run.grad_input[index] = grad
            run.labels[(KIND_GRAD_INPUT, index)] = name
        order = [split_label(label)[1] for label in self.call.tensors
                 if split_label(label)[0] == PARAM]  # the module's order, as the report's
        run.param_grad = sorted(replayed.param_grads.items(),
                                key=lambda item: order.index(item[0]) if item[0] in order else
                                len(order))
        return run


def replay_of(call: StoredCall, from_class: bool = False, module: Optional[nn.Module] = None,
              unpickle: bool = False):
    """How to replay ``call``: from its captured graphs (the default), or through ``module`` /
    the module rebuilt from its class (``from_class``, or when the dump keeps no usable graph:
    ``graph_unavailable`` on the result says why)."""
    why = ""
    if module is None and not from_class:
        try:
            return GraphReplay(call)
        except ReplayError as error:
            why = str(error)
    try:
        built = call.build_module(unpickle=unpickle) if module is None else module
    except ReplayError as error:
        if why:  # both routes closed: say why for each
            raise ReplayError(f"{why}. Rebuilding it from its class instead: {error}") from error
        raise
    replay = ClassReplay(call, built)
    replay.graph_unavailable = why
    return replay


def inductor_patch(config: Dict[str, object]):
    """``torch._inductor.config.patch(config)``; nothing for an empty one."""
    if not config:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config  # noqa: PLC0415 - only when needed

    return inductor_config.patch(config)


def stock_inductor_config() -> Dict[str, object]:
    """The switches this process has set away from inductor's defaults, each with its default:
    patched in, inductor compiles as it does out of the box (the stock stages of a bisection,
    whatever the training process set globally: a custom post-grad pass, say)."""
    return {key: default for key, (_, default) in inductor_config_changes().items()}


# ---------------------------------------------------------------------- reading a dump
def tensor_from_bytes(dtype: str, shape: tuple, data: bytes) -> torch.Tensor:
    torch_dtype = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)


def step_file(dump: str, step: Optional[int], module: str,
              among: Optional[Sequence[int]] = None) -> str:
    """The step file to replay from: ``step``'s, else the first step that keeps replay data of
    ``module`` (of the steps ``among``, when given: a checker's own)."""
    if os.path.isfile(dump):
        return dump
    dump = one_process(dump)
    steps = committed_steps(dump)
    if not steps:
        raise ReplayError(f"{dump} holds no committed step file (step_<N>.h5); pass a dump "
                          "folder written by PrecisionChecker")
    if step is not None:
        for index, path, _ in steps:
            if index == step:
                return path
        raise ReplayError(f"{dump} has no step {step}; its steps are "
                          f"{', '.join(str(s) for s, _, _ in steps)}")
    for index, path, _ in steps:
        if (among is None or index in among) and module in replay_attributes(
                _C.read_step(path)):
            return path
    raise ReplayError(f"no step of {dump}" + ("" if among is None else " this checker wrote") +
                      f" keeps replay data of module {module!r}: replay data is "
                      "kept for calls with a failing row, forward or backward (PrecisionChecker(replay="
                      "'failing'), the default) or for every call (replay='all')")


def step_files(dump: str, step: Optional[int]) -> List[tuple]:
    """(step, file) of a dump: ``step``'s, else all; a run folder reads its rank 0."""
    if not os.path.isfile(dump):
        dump = one_process(dump)
    if os.path.isfile(dump) or step is not None:
        path = step_file(dump, step, "")
        return [(int(_C.read_step(path)["step"]), path)]
    steps = committed_steps(dump)
    if not steps:
        step_file(dump, None, "")  # raises, saying what a dump folder holds
    return [(index, path) for index, path, _ in steps]


def step_result(index: int, path: str) -> CompareResult:
    """The report of step ``index`` of the dump holding the step file ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    comparison = _C.compare(folder, folder, step=index)
    return CompareResult.from_report(comparison.steps[0], folder, path, comparison)


def failing_modules(result: CompareResult) -> List[str]:
    """The step's failing modules, root cause first (forward, then backward), then in report
    order."""
    root = result.root_cause or {}
    order = [root[d]["module"] for d in ("forward", "backward") if root.get(d)]
    order += [r.module for r in result.rows if r.status == vocabulary.STATUS_FAIL]
    return list(dict.fromkeys(order))


def chosen_dump(command: str, dump: str) -> str:
    """The dump ``command`` (``"repro"``, ``"bisect"``, ``"bundle"``) reads for the path it was
    given: for a folder of runs (``dynaprobe_runs/``) its newest run, said on stderr as the
    dynaprobe CLI says it (analyze::choose_run)."""
    if not os.path.isdir(dump):
        return dump
    run, said = _C.choose_run(command, dump)
    if said:
        print(said, file=sys.stderr)
    return run


def one_process(dump: str) -> str:
    """The dump folder of one process: ``dump``, or the lowest rank's of a run folder (said)."""
    if not os.path.isdir(dump) or committed_steps(dump):
        return dump
    rank, folder = _C.find_rank_dumps(dump)[0]
    if os.path.normpath(folder) != os.path.normpath(dump):
        print(f"dynaprobe: {dump} is a run folder: reading its rank {rank} ({folder})",
              file=sys.stderr)
    return folder


def replay_attributes(info: dict) -> Dict[str, dict]:
    """Module -> its replay attribute (JSON), of a step's ``_C.read_step`` info."""
    found = {}
    for module, attributes in info.get("modules", []):
        text = attributes.get(vocabulary.ATTRIBUTE_REPLAY)
        if text:
            found[module] = json.loads(text)
    return found


def load_call(dump: str, module: str, call: Optional[int] = None,
              step: Optional[int] = None, among: Optional[Sequence[int]] = None) -> StoredCall:
    """The stored call ``call`` (default: the first one kept) of ``module`` from a dump folder
    (or one step file), at ``step`` (default: the first step keeping replay data of it, of the
    steps ``among`` when given)."""
    path = step_file(dump, step, module, among)
    info = _C.read_step(path)
    replays = replay_attributes(info)
    if module not in replays:
        known = ", ".join(sorted(replays)) or "none"
        raise ReplayError(f"{path} keeps no replay data of module {module!r} (modules with "
                          f"replay data: {known})")
    replay = replays[module]
    if "unavailable" in replay:  # e.g. an FSDP2-sharded module: the reason and what to do
        raise ReplayError(f"{path}: {replay['unavailable']}")
    calls = sorted(int(c) for c in replay["calls"])
    if call is None:
        call = calls[0]
    if call not in calls:
        raise ReplayError(f"{path}: module {module!r} keeps replay data of call(s) "
                          f"{', '.join(map(str, calls))}, not of call {call}")
    tensors, structure, outputs = {}, None, {}
    shared_calls = {replay.get("structure_call")} | {
        graph.get("call") for graph in replay.get("graph_data", {}).values()}
    for record in info["records"]:
        if record["module"] != module:
            continue
        if record["kind"] == KIND and (record["call"] == call or record["call"] in shared_calls):
            role, _ = split_label(record["label"])
            if record["call"] != call and role not in (STRUCTURE, GRAPH_TENSOR):
                continue
            tensor = tensor_from_bytes(*_C.read_record(path, module, record["call"], KIND,
                                                       record["tensor_index"], SIDE_COMPILED))
            if role == STRUCTURE:
                structure = tensor.numpy().tobytes()
            else:
                tensors[record["label"]] = tensor
        elif record["call"] == call and record["kind"] == KIND_FWD_OUTPUT and record["stored"]:
            outputs[(record["side"], record["kind"], record["tensor_index"])] = tensor_from_bytes(
                *_C.read_record(path, module, call, record["kind"], record["tensor_index"],
                                record["side"]))
    referenced = any(record["module"] == module and record["side"] == SIDE_REFERENCE
                     for record in info["records"])
    return StoredCall(module, call, int(info["step"]), replay, tensors,
                      dict(info["provenance"]), structure, outputs, path, referenced)


def judged(call: StoredCall, replay, eager: Run, runs: Sequence[Run]) -> List[CompareResult]:
    """Each of ``runs`` judged against the ``eager`` run of ``replay`` as the report judged
    the call: with the dump's tolerances and rules, and, where the capture judged it with a
    reference, with the call replayed in float64 (``reference()`` of either route) as every
    row's reference."""
    references = None
    if call.referenced and runs:
        references = [replay.reference()] * len(runs)
    return judge(call, [(eager, run) for run in runs], references=references)
