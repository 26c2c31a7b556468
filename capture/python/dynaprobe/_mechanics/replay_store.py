"""What the dump keeps of a call so that it can be replayed (``PrecisionChecker(replay=...)``):
the call's inputs with their argument structure, the grad_output it received, the module's
parameters and buffers, the RNG state before the call, its class and, when it pickles, its
structure without weights. Tensors are records of kind ``replay`` (stored whole, never compared);
the rest is the module attribute ``replay`` (JSON). The layout is in docs/dump-format.md
(Replay records); ``replay.py`` reads it back.
"""

from __future__ import annotations

import copy
import io
import json
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from dynaprobe._C import vocabulary
from dynaprobe._mechanics.graph_data import UnstorableGraph, graph_to_data

REPLAY_MODES = ("failing", "all", "none")
KIND = vocabulary.KIND_REPLAY  # formats::kind_name(Kind::kReplay)
# Labels of replay records: "<role>:<name>". Keep in sync with replay.py.
INPUT, GRAD_OUTPUT, PARAM, BUFFER, RNG, STRUCTURE = (
    "input", "grad_output", "param", "buffer", "rng", "structure")
# The graphs Dynamo ran for the call: "graph_tensor:<function>/<label>" (a tensor the graph holds),
# "graph_arg:<graph call>.<position>", "graph_grad:<graph call>.<output>",
# "graph_rng:<graph call>.cpu" and "graph_rng:<graph call>.cuda:<index>".
GRAPH_TENSOR, GRAPH_ARG, GRAPH_GRAD, GRAPH_RNG = ("graph_tensor", "graph_arg", "graph_grad",
                                                  "graph_rng")
_JSON_LEAVES = (type(None), bool, int, float, str)


def expect_replay(value, single_pass: bool, dump: str) -> str:
    """The replay policy: ``"failing"`` (calls with a row that fails, forward or backward),
    ``"all"`` or ``"none"``; None picks ``"failing"``, except under dump="stats" (metrics only)
    and in two-pass (its sides run on inputs of their own), which keep nothing."""
    if value is None:
        return "failing" if single_pass and dump != "stats" else "none"
    if value not in REPLAY_MODES:
        raise ValueError(f"replay must be None or one of {', '.join(map(repr, REPLAY_MODES))}, "
                         f"but received {value!r}")
    if value != "none" and not single_pass:
        raise ValueError(f"replay={value!r} needs single_pass=True: a replay runs one call's "
                         "inputs through both sides, which only single-pass shares")
    return value


def class_path(obj) -> str:
    """``package.module.QualName`` of an object's class."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def backend_spec(backend) -> Dict[str, str]:
    """How a replay finds the backend again: ``{"name": ...}`` for a registered backend name,
    ``{"import": "module:attribute"}`` for a callable that a module holds under a global name,
    ``{"unknown": repr}`` otherwise (the repro script then asks for it). A name registered by
    the user's own code (``@register_backend``) also records where its function was defined,
    ``"defined": "module:attribute"``: a replay elsewhere names it as the option to pass."""
    if isinstance(backend, str):
        spec = {"name": backend}
        try:
            from torch._dynamo.backends.registry import lookup_backend  # noqa: PLC0415

            function = lookup_backend(backend)
        except Exception:  # not registered (torch.compile refuses it): the name alone
            return spec
        found = _object_spec(function)
        if "import" in found and not found["import"].startswith("torch"):
            spec["defined"] = found["import"]
        return spec
    return _object_spec(backend)


def _object_spec(backend) -> Dict[str, str]:
    """``{"import": "module:attribute"}`` for an object a module holds under a global name,
    else ``{"unknown": repr}``."""
    module, name = getattr(backend, "__module__", None), getattr(backend, "__qualname__", None)
    if module and name and "<" not in name:
        owner = sys.modules.get(module)
        target = owner
        for part in name.split("."):
            target = getattr(target, part, None)
        if target is backend:
            return {"import": f"{module}:{name}"}
    # Objects without a qualified name (aot_autograd(...) backends): a module-level name for it.
    for module_name, owner in list(sys.modules.items()):
        space = getattr(owner, "__dict__", None)
        if not isinstance(space, dict) or module_name.startswith(("torch", "dynaprobe")):
            continue
        for attribute, value in list(space.items()):
            if value is backend and not attribute.startswith("_"):
                return {"import": f"{module_name}:{attribute}"}
    return {"unknown": repr(backend)[:200]}


def inductor_config_changes() -> Dict[str, Tuple[object, object]]:
    """The inductor config switches this process has set away from what inductor uses out of
    the box: key -> (value, stock value). The stock value is the default, or the one a
    TORCHINDUCTOR_* variable gave (the environment is not a switch the process set). Empty when
    the config cannot be read (a torch without inductor)."""
    try:
        import torch._inductor.config as inductor_config  # noqa: PLC0415 - only when replaying

        changes = {}
        for key in inductor_config._get_dict(skip_default=True):
            # The object itself: the exported dict holds copies, which no module-level name
            # holds (a CustomGraphPass instance would not be found by its name).
            value, stock = getattr(inductor_config, key), inductor_stock_value(key)
            if value != stock:  # torch itself sets some to their stock values as it compiles
                changes[key] = (value, stock)
        return changes
    except Exception:
        return {}


def inductor_stock_value(key: str) -> object:
    """What inductor uses for the config switch ``key`` out of the box: its default, or the
    value a TORCHINDUCTOR_* variable gave (the environment is not a switch the process set)."""
    import torch._inductor.config as inductor_config  # noqa: PLC0415 - only when replaying
    from torch.utils._config_module import _UNSET_SENTINEL  # noqa: PLC0415

    entry = inductor_config._config[key]
    return entry.default if entry.env_value_default is _UNSET_SENTINEL else \
        entry.env_value_default


def inductor_config_spec() -> Dict[str, Dict]:
    """The inductor config switches set away from their defaults, each as a replay finds it
    again: ``{"value": v}`` for a JSON value, else where a module holds the object (a custom
    post-grad pass: a module-level function or ``CustomGraphPass`` instance). Empty when the
    config cannot be read: the replay uses the defaults, as it says."""
    spec = {}
    for key, (value, _) in sorted(inductor_config_changes().items()):
        try:
            json.dumps(value)
            spec[key] = {"value": value}
        except (TypeError, ValueError):
            spec[key] = _object_spec(value)
    return spec


def _structure_pickle(module: nn.Module) -> Optional[bytes]:
    """The module pickled with every parameter and buffer on the meta device (its structure and
    constructor-free state, no weights); None when it does not pickle (hooks holding closures,
    handles, ...). The instance ``forward`` dynaprobe installs is left out."""
    memo: dict = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else empty)
    try:
        twin = copy.deepcopy(module, memo)
        twin.__dict__.pop("forward", None)
        buffer = io.BytesIO()
        torch.save(twin, buffer)
        return buffer.getvalue()
    except Exception:  # not picklable: the replay rebuilds the class (docs/user-guide.md)
        return None


class CallRecord:
    """The replay records of one call: numbers the records it writes."""

    def __init__(self, step, module: str, call: int):
        self.step, self.module, self.call = step, module, call
        self.next_index = 0

    def add(self, label: str, tensor: torch.Tensor) -> None:
        self.step.record(self.module, self.call, KIND, self.next_index, vocabulary.SIDE_COMPILED,
                         tensor, label)
        self.next_index += 1


def _describe_arguments(args: tuple, kwargs: dict, record: CallRecord,
                        requires_grad: List[bool]) -> dict:
    """The argument structure as JSON (a pytree spec and its leaves), its tensors recorded."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    described, tensor_index = [], 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            record.add(f"{INPUT}:{tensor_index}", leaf.detach())
            grad = requires_grad[tensor_index] if tensor_index < len(requires_grad) else False
            described.append({"tensor": tensor_index, "requires_grad": grad})
            tensor_index += 1
        elif isinstance(leaf, _JSON_LEAVES) and not (isinstance(leaf, float) and leaf != leaf):
            described.append({"value": leaf})
        elif isinstance(leaf, (torch.dtype, torch.device)):
            described.append({type(leaf).__name__: str(leaf)})
        else:
            described.append({"unsupported": class_path(leaf)})
    try:
        tree = pytree.treespec_dumps(spec)
    except Exception as error:  # a container pytree cannot serialise
        tree = None
        described.append({"unsupported": f"argument structure ({type(error).__name__}: {error})"})
    return {"tree": tree, "leaves": described}


class Candidate:
    """A checked call whose replay data may be kept, held by reference until it is decided
    (``SinglePass.decide_replays``: when the call's backward is done, or at collect()), so that
    the calls that pass cost no copy.

    ``args``/``kwargs`` are the eager re-run's copies of the call's inputs (taken before the
    training call); ``params`` the module's parameters and ``buffers`` its buffers before the
    call, each with its version counter (``Tensor._version``), or None for a private copy (a
    buffer the training call changed in place: its value before, copied from ``ModuleState``);
    ``rng`` the RNG state before the call (``_capture.RngState``); ``pending`` its eager
    backward (``_step.PendingBackward``), whose grad_outputs seed a backward replay;
    ``graph_calls`` the runs of the module's compiled graphs during the call
    (``_graphs.LiveGraphCall``), for a replay from the captured graphs; ``given`` the tensors the
    training call received, in the order of the tensors of ``args``/``kwargs``: a graph
    argument that is one of them has its value from before the call there, should the call or a
    later one write it in place.
    """

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, requires_grad: List[bool],
                 params: list, buffers: list, rng, grad_mode: bool, sharded: bool,
                 graph_calls: Optional[list] = None, given: Optional[list] = None):
        self.module = module
        self.args, self.kwargs, self.requires_grad = args, kwargs, requires_grad
        self.params = params  # (name, tensor, version)
        self.buffers = buffers  # (name, tensor, version or None)
        self.rng = rng
        self.grad_mode = grad_mode
        self.sharded = sharded  # FSDP2/DTensor parameters: cannot be replayed (see unavailable)
        self.graph_calls = graph_calls or []
        self.given = given or []
        self.pending = None

    def release(self) -> None:
        """Its replay data is decided: the runs of its graphs let go of their tensors."""
        for live in self.graph_calls:
            live.release()

    def ready(self) -> bool:
        """Its backward is done (or none will come): every verdict of the call is known."""
        return self.pending is None or self.pending.done

    def backward_checks_parameters_only(self) -> bool:
        """No input of the call needs a gradient: its backward shows only in its parameter
        gradients, which the report compares per step, at collect()."""
        return self.grad_mode and not any(self.requires_grad) and bool(self.params)

    def changed(self) -> List[str]:
        """The parameters and buffers changed since the call (an optimizer step before the
        decision, ...) or freed, by name: the replay would not be the call's."""
        return [name for name, tensor, version in self.params + self.buffers
                if version is not None and (tensor._version != version or (
                    tensor.numel() > 0 and tensor.untyped_storage().size() == 0))]


def watch_parameters(module: nn.Module) -> list:
    return [(n, p, p._version) for n, p in module.named_parameters()]


def watch_buffers(module: nn.Module) -> list:
    """The module's buffers with their version counters, before the training call."""
    return [(n, b, b._version) for n, b in module.named_buffers()]


def buffers_before(watched: list, saved: Dict[str, torch.Tensor]) -> list:
    """After the training call: a buffer it changed in place (batch norm statistics) is replaced
    by a copy of its value before (``saved``, ModuleState's copies, taken before the call and
    copied again here before the eager re-run changes them); the others stay references."""
    return [(n, saved[n].clone(), None) if b._version != v and n in saved else (n, b, v)
            for n, b, v in watched]


def record_call(step, name: str, call: int, candidate: Candidate, cast_dtype,
                backend: Dict[str, str], captured: Optional[dict] = None) -> None:
    """Records what replaying call ``call`` of ``name`` needs (see Candidate) into the step."""
    attributes = step.attributes.setdefault(name, {})
    replay = json.loads(attributes.get(vocabulary.ATTRIBUTE_REPLAY) or "{}")
    module = candidate.module
    if candidate.sharded:
        replay = {"class": class_path(module), "calls": {}, "unavailable": unavailable_sharded(
            name)}
        attributes[vocabulary.ATTRIBUTE_REPLAY] = json.dumps(replay, sort_keys=True)
        return
    record = CallRecord(step, name, call)
    description = _describe_arguments(candidate.args, candidate.kwargs, record,
                                      candidate.requires_grad)
    description.update({"grad_mode": candidate.grad_mode,
                        "cast_dtype": None if cast_dtype is None else str(cast_dtype)})
    for param_name, param, _ in candidate.params:
        record.add(f"{PARAM}:{param_name}", param.detach())
    for buffer_name, buffer, _ in candidate.buffers:
        record.add(f"{BUFFER}:{buffer_name}", buffer.detach())
    record.add(f"{RNG}:cpu", candidate.rng.cpu)
    for index, state in candidate.rng.cuda.items():
        record.add(f"{RNG}:cuda:{index}", state)
    grads = candidate.pending.grads if candidate.pending is not None else {}
    for index, grad in sorted(grads.items()):  # seed a backward replay
        record.add(f"{GRAD_OUTPUT}:{index}", grad)
    if not replay:  # the module's first replayed call in this step: its class and structure
        structure = _structure_pickle(module)
        replay = {"class": class_path(module), "backend": backend, "calls": {},
                  "structure_call": None if structure is None else call}
        config = inductor_config_spec()
        if config:
            replay["inductor_config"] = config
        if structure is not None:
            record.add(f"{STRUCTURE}:pickle",
                       torch.frombuffer(bytearray(structure), dtype=torch.uint8))
    description["graphs"] = _record_graph_calls(record, replay, candidate, captured or {})
    replay["calls"][str(call)] = description
    attributes[vocabulary.ATTRIBUTE_REPLAY] = json.dumps(replay, sort_keys=True)


def _record_graph_calls(record: CallRecord, replay: dict, candidate: Candidate,
                        captured: dict) -> dict:
    """Records the runs of the compiled graphs of the call (a replay from the captured graphs,
    docs/dump-format.md): ``{"calls": [...]}``, or ``{"unavailable": why}``. Each graph is
    stored once per step, as data (graph_data.py), under the first call that ran it."""
    if not candidate.graph_calls:
        return {"unavailable": "Dynamo ran no compiled graph for this call"}
    names = {id(t): (PARAM, n) for n, t in candidate.module.named_parameters()}
    names.update({id(t): (BUFFER, n) for n, t in candidate.module.named_buffers()})
    # Values from before the call of what it (or a later call) may write in place: the inputs
    # (their re-run copies) and the buffers it changed (their private copies, recorded).
    copies = [t for t in pytree.tree_leaves((candidate.args, candidate.kwargs))
              if isinstance(t, torch.Tensor)]
    input_before = {id(t): copy for t, copy in zip(candidate.given, copies)}
    buffers_kept = {(BUFFER, n) for n, _, version in candidate.buffers if version is None}
    stored = replay.setdefault("graph_data", {})
    calls = []
    for index, live in enumerate(candidate.graph_calls):
        function = live.function
        if function not in stored:
            try:
                data, tensors = graph_to_data(captured[function])
            except (UnstorableGraph, KeyError) as error:
                stored[function] = {"unstorable": str(error)}
            else:
                for label, tensor in tensors.items():
                    record.add(f"{GRAPH_TENSOR}:{function}/{label}", tensor)
                stored[function] = {"graph": data, "call": record.call}
        if "unstorable" in stored[function]:
            return {"unavailable": f"its graph {function} cannot be stored as data: "
                                   f"{stored[function]['unstorable']}"}
        changed = [position for position in live.overwritten + live.changed_since()
                   if id(live.args[position]) not in input_before
                   and names.get(id(live.args[position])) not in buffers_kept]
        if changed:
            return {"unavailable": f"argument(s) {', '.join(map(str, sorted(set(changed))))} of "
                                   f"{function} were written in place, during or after the call, "
                                   "without a copy from before"}
        args = []
        for position, value in enumerate(live.args):
            if isinstance(value, torch.Tensor):
                if position not in live.before and id(value) in names:
                    role, name = names[id(value)]
                    args.append({role: name})
                else:
                    before = live.before.get(position, input_before.get(id(value), value))
                    record.add(f"{GRAPH_ARG}:{index}.{position}", before.detach())
                    args.append({"tensor": position})
            elif isinstance(value, (bool, int, float)):
                args.append({"value": value})
            else:
                return {"unavailable": f"argument {position} of {function} is a "
                                       f"{class_path(value)}"}
        for position, grad in sorted(live.grads.items()):
            record.add(f"{GRAPH_GRAD}:{index}.{position}", grad)
        record.add(f"{GRAPH_RNG}:{index}.cpu", live.rng)
        for device, state in live.cuda_rng.items():
            record.add(f"{GRAPH_RNG}:{index}.cuda:{device}", state)
        graph = captured[function].graph
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        flat = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
        calls.append({"function": function, "args": args,
                      "names": [n.target for n in graph.nodes if n.op == "placeholder"],
                      "outputs": [getattr(n, "name", str(n)) for n in flat],
                      "requires_grad": live.requires_grad})
    return {"calls": calls}


def unavailable_sharded(name: str) -> str:
    """Why an FSDP2-sharded module keeps no replay data, and what to do instead."""
    return (f"the module {name} is sharded by FSDP2 (fully_shard): its full parameters exist "
            "only while it runs, so dynaprobe keeps no replay data of it. To reproduce it, build "
            "the module without fully_shard in one process, load its full weights (on the "
            "training run: torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True))), check it there with "
            "PrecisionChecker (replay='failing' is the default) on the call's inputs (its "
            "fwd_input records, dump='full'), and run python -m dynaprobe.repro or "
            "dynaprobe.bisect on that dump")


def split_label(label: str) -> Tuple[str, str]:
    role, _, name = label.partition(":")
    return role, name
