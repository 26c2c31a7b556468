"""The stored call: what a dump (or a repro data file) keeps of one call of a module
(``PrecisionChecker(replay=...)``, replay_store.py), and running it. ``StoredCall`` rebuilds the
module and its weights, the captured graphs and the call's arguments, the recorded backend and
inductor config, and runs the call, forward and backward, into a ``Run``.

Finding a call in a dump and the two ways to replay it are replay.py's; judging two runs,
judging.py's.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._mechanics.capture import tensor_leaves
from dynaprobe._mechanics.graph_data import UntrustedGraph, graph_from_data
from dynaprobe._mechanics.graph_runner import GraphCall, own_tensor
from dynaprobe._mechanics.replay_store import (
    BUFFER,
    GRAD_OUTPUT,
    GRAPH_ARG,
    GRAPH_GRAD,
    GRAPH_RNG,
    GRAPH_TENSOR,
    INPUT,
    PARAM,
    RNG,
    split_label,
)
from dynaprobe._steps.compiling import own_entry

# Said wherever the pickled module structure can be unpickled (an explicit opt-in, never the
# default): a pickle names any callable, and unpickling calls it.
UNPICKLE_RISK = ("unpickling runs code the dump carries, as any pickle can: use it only on dumps "
                 "you trust")


# The --backend option of repro, bisect and bundle.
BACKEND_HELP = ("compile with this backend instead of the recorded one: module:attribute "
                "(imported: the dump never makes dynaprobe import anything) or a registered "
                "backend's name.")
IMPORT_HELP = ("import MODULE before replaying (repeatable): the module that defines or "
               "registers the recorded backend or inductor pass, as an error names it.")


class ReplayError(ValueError):
    """A call cannot be replayed from this dump; the message says why and what to do."""


@dataclass
class StoredCall:
    """One call's replay data: what the dump (or a repro data file) holds for it.

    ``tensors`` maps each replay record's label (``input:0``, ``param:lin.weight``,
    ``grad_output:0``, ``rng:cpu``, ...) to its tensor; ``description`` is the call's argument
    structure (module attribute ``replay``); ``replay`` the module's whole attribute;
    ``provenance`` the step's (tolerances, backend name, torch version).
    """

    module: str
    call: int
    step: int
    replay: dict
    tensors: Dict[str, torch.Tensor]
    provenance: Dict[str, str]
    structure: Optional[bytes] = None
    stored_outputs: Dict[Tuple[str, str, int], torch.Tensor] = field(default_factory=dict)
    path: str = ""  # the step file it was read from
    # The capture judged the module with a reference run (PrecisionChecker(reference=...), on
    # by default in bf16/fp16): a replay judges it with one too (replay.judged).
    referenced: bool = False

    @property
    def description(self) -> dict:
        return self.replay["calls"][str(self.call)]

    # ------------------------------------------------------------------ the module
    def build_module(self, device: str = "cpu", unpickle: bool = False) -> nn.Module:
        """The module with its stored weights. By default nothing the dump carries runs: the
        module is its recorded class called without arguments, which must be an ``nn.Module``
        class importable here. ``unpickle=True`` rebuilds it from the pickled structure the dump
        holds instead (any constructor), which runs code the dump carries (UNPICKLE_RISK). Raises
        ReplayError saying what to do otherwise."""
        if unpickle and self.structure is not None:
            try:
                module = torch.load(io.BytesIO(self.structure), weights_only=False)
            except Exception as error:
                raise ReplayError(
                    f"the module {self.module} ({self.replay['class']}) could not be rebuilt: "
                    f"{type(error).__name__}: {error}. Make its class importable (install the "
                    "package or put its source folder on PYTHONPATH), or build it yourself (in "
                    "the repro script's build_module(); bisect_call(module=...) in Python) and "
                    "load the weights with load_weights(module)") from error
        else:
            module = self._construct()
        module.to_empty(device=device)
        self.load_weights(module)
        return module

    def _construct(self) -> nn.Module:
        path = self.replay["class"]
        module_name, _, qualname = path.rpartition(".")
        try:
            cls = importlib.import_module(module_name)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except Exception as error:
            raise ReplayError(self._cannot_build(
                f"its class {path} cannot be imported here ({type(error).__name__}: "
                f"{error})")) from error
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ReplayError(f"the dump names {path} as the class of the module {self.module}, "
                              "which is not an nn.Module class: refused (a damaged or crafted "
                              "dump)")
        try:
            return cls()
        except Exception as error:
            raise ReplayError(self._cannot_build(
                f"its class {path} cannot be built without arguments ({type(error).__name__}: "
                f"{error})")) from error

    def _cannot_build(self, why: str) -> str:
        """What to do when the module cannot be built from its class alone."""
        pickled = ("; or rebuild it from the pickle the dump holds (--unpickle; unpickle=True in "
                   f"Python): {UNPICKLE_RISK}") if self.structure is not None else \
            " (the module did not pickle when it was captured)"
        return (f"the module {self.module} could not be rebuilt: {why}. Build it yourself in "
                "the repro script's build_module() (bisect_call(module=...) in Python) and load "
                f"the weights with load_weights(module){pickled}")

    def load_weights(self, module: nn.Module) -> None:
        """Sets every stored parameter and buffer of ``module`` (by name) to its stored value."""
        for label, tensor in self.tensors.items():
            role, name = split_label(label)
            if role not in (PARAM, BUFFER):
                continue
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            value = tensor.clone().to(_module_device(module))
            if role == PARAM:  # the Parameter object stays (ties, hooks), its data is set
                owner._parameters[leaf].data = value
            else:
                owner._buffers[leaf] = value

    # ------------------------------------------------------------------ the captured graphs
    def graph_calls(self) -> List[GraphCall]:
        """The call as the runs of the graphs Dynamo captured for it (graph_runner.py);
        ReplayError saying why when the dump keeps none."""
        graphs = self.description.get("graphs")
        if not graphs:
            raise ReplayError(f"call {self.call} of {self.module} keeps no captured graphs (a "
                              "dump written before dynaprobe kept them)")
        if "unavailable" in graphs:
            raise ReplayError(f"call {self.call} of {self.module} cannot be replayed from its "
                              f"captured graph: {graphs['unavailable']}")
        calls = []
        for index, stored in enumerate(graphs["calls"]):
            args, params = [], {}
            for position, arg in enumerate(stored["args"]):
                if "value" in arg:
                    args.append(arg["value"])
                    continue
                role, name = next(iter(arg.items()))
                label = {PARAM: f"{PARAM}:{name}", BUFFER: f"{BUFFER}:{name}"}.get(
                    role, f"{GRAPH_ARG}:{index}.{position}")
                if label not in self.tensors:
                    raise ReplayError(f"{self.path or 'the dump'}: the replay record {label} of "
                                      f"{self.module} call {self.call} is missing")
                args.append(self.tensors[label])
                if role == PARAM:
                    params[position] = name
            prefix = f"{GRAPH_GRAD}:{index}."
            grads = {int(label[len(prefix):]): t for label, t in self.tensors.items()
                     if label.startswith(prefix)}
            rng_prefix = f"{GRAPH_RNG}:{index}.cuda:"
            calls.append(GraphCall(
                stored["function"], args, list(stored["names"]),
                [int(i) for i in stored["requires_grad"]], list(stored["outputs"]), params,
                grads, self.tensors.get(f"{GRAPH_RNG}:{index}.cpu"),
                {int(label[len(rng_prefix):]): t for label, t in self.tensors.items()
                 if label.startswith(rng_prefix)}))
        return calls

    def graph_modules(self) -> Dict[str, torch.fx.GraphModule]:
        """The captured graphs the call ran, rebuilt from the dump's data (graph_data.py:
        nothing the dump carries runs but torch's operators)."""
        modules = {}
        for stored in self.description["graphs"]["calls"]:
            function = stored["function"]
            if function in modules:
                continue
            data = self.replay.get("graph_data", {}).get(function, {})
            prefix = f"{GRAPH_TENSOR}:{function}/"
            tensors = {label[len(prefix):]: t for label, t in self.tensors.items()
                       if label.startswith(prefix)}
            try:
                modules[function] = graph_from_data(data.get("graph"), tensors)
            except UntrustedGraph as error:
                raise ReplayError(f"{self.path or 'the dump'}: the captured graph {function} of "
                                  f"{self.module} is refused: {error}") from error
        return modules

    # ------------------------------------------------------------------ the call
    def arguments(self, device: str = "cpu", dtype: Optional[torch.dtype] = None
                  ) -> Tuple[tuple, dict, List[Tuple[int, torch.Tensor]]]:
        """Fresh copies of the call's (args, kwargs), floating ones in ``dtype`` when given; the
        inputs that required grad are leaves requiring grad (in grad mode), returned as (input
        index, leaf), and given to the call as their ``own_tensor``, which it may write in
        place."""
        description = self.description
        unsupported = [leaf["unsupported"] for leaf in description["leaves"]
                       if "unsupported" in leaf]
        if unsupported or description["tree"] is None:
            raise ReplayError(
                f"call {self.call} of {self.module} took arguments a replay cannot rebuild "
                f"({', '.join(unsupported)}): only tensors, numbers, strings, None, dtypes and "
                "devices in tuples, lists and dicts are stored")
        leaves, grad_leaves = [], []
        for leaf in description["leaves"]:
            if "tensor" in leaf:
                tensor = self.tensors[f"{INPUT}:{leaf['tensor']}"].clone().to(device)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                if description["grad_mode"] and leaf["requires_grad"]:
                    tensor.requires_grad_(True)
                    grad_leaves.append((leaf["tensor"], tensor))
                    tensor = own_tensor(tensor)
                leaves.append(tensor)
            elif "value" in leaf:
                leaves.append(leaf["value"])
            elif "dtype" in leaf:
                leaves.append(getattr(torch, leaf["dtype"].replace("torch.", "")))
            else:
                leaves.append(torch.device(leaf["device"]))
        args, kwargs = pytree.tree_unflatten(leaves, pytree.treespec_loads(description["tree"]))
        return tuple(args), dict(kwargs), grad_leaves

    def grad_outputs(self) -> Dict[int, torch.Tensor]:
        return {int(split_label(label)[1]): tensor for label, tensor in self.tensors.items()
                if split_label(label)[0] == GRAD_OUTPUT}

    def restore_rng(self) -> None:
        for label, state in self.tensors.items():
            role, name = split_label(label)
            if role != RNG:
                continue
            if name == "cpu":
                torch.set_rng_state(state)
            elif torch.cuda.is_available():
                torch.cuda.set_rng_state(state, int(name.split(":")[1]))

    def backend(self):
        """The backend the call was compiled with: a registered name, or the object at the
        module-level name it was recorded under. Nothing is imported because the dump names it:
        the module must be imported already (the training process's own, or one the user named:
        ``--backend``, ``--import``). Raises ReplayError saying which option to pass."""
        spec = self.replay.get("backend", {})
        if "name" in spec:
            name = spec["name"]
            if not _registered(name):
                where = spec.get("defined")
                raise ReplayError(f"the recorded backend {name!r} is not registered here: " + (
                    f"it was registered by {where}; {_how_to_import(where)}" if where else
                    "pass --backend module:attribute naming it"))
            return name
        if "import" in spec:
            return _resolved(spec["import"], "backend")
        raise ReplayError(f"the recorded backend {spec.get('unknown', '?')} has no module-level "
                          "name to find it by: pass --backend module:attribute naming it (edit "
                          "BACKEND in a repro script)")

    def inductor_config(self) -> Dict[str, object]:
        """The inductor config switches the capture had set away from their defaults (a custom
        post-grad pass, say), as values to patch; ReplayError for one that cannot be found (an
        object is found as ``backend`` finds one)."""
        config = {}
        for key, spec in self.replay.get("inductor_config", {}).items():
            if "value" in spec:
                config[key] = spec["value"]
            elif "import" in spec:
                config[key] = _resolved(spec["import"], f"inductor config {key}")
            else:
                raise ReplayError(f"the inductor config {key} was set to "
                                  f"{spec.get('unknown', '?')}, which has no module-level name to "
                                  "find it by: patch it yourself (torch._inductor.config)")
        return config

    def recorded_compile(self) -> str:
        """The recorded backend and inductor config, in words."""
        text = recorded_name(self.replay.get("backend", {}))
        for key, value in self.replay.get("inductor_config", {}).items():
            text += f", {key}={recorded_name(value)}"
        return text

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        """The autocast dtype the call ran under: the checker's ``cast_dtype``, else the user's
        own ``torch.autocast`` (provenance ``autocast``); None without autocast."""
        name = self.description.get("cast_dtype") or self.provenance.get(
            vocabulary.PROVENANCE_AUTOCAST)
        found = getattr(torch, str(name).replace("torch.", ""), None) if name else None
        return found if isinstance(found, torch.dtype) else None

    @property
    def tolerances(self) -> Tuple[float, float]:
        """The step's (atol, rtol), as the engine reads them from the dump."""
        judging = _C.Judging.of_dump(self.provenance, self.path or "the repro's data")
        return judging.atol, judging.rtol

    # ------------------------------------------------------------------ running
    def run(self, module: nn.Module, forward: Callable, backward: bool = True,
            dtype: Optional[torch.dtype] = None) -> "Run":
        """Runs ``forward`` (the module's, or a compiled one) on fresh copies of the inputs from
        the stored RNG state, then, when the call ran in grad mode and has a stored grad_output,
        its backward through ``torch.autograd.grad`` (``.grad`` is left alone). ``dtype``: its
        floating inputs and gradients raised to it and autocast off, for a module in ``dtype``
        (a reference)."""
        device = _module_device(module)
        args, kwargs, leaves = self.arguments(device, dtype)
        self.restore_rng()
        cast = self.autocast_dtype if dtype is None else None
        autocast = (torch.autocast(device_type=torch.device(device).type, dtype=cast)
                    if cast is not None else contextlib.nullcontext())
        grad_mode = bool(self.description["grad_mode"])
        with torch.set_grad_enabled(grad_mode), autocast:
            out = forward(*args, **kwargs)
        run = Run([t.detach() for _, t in tensor_leaves(out)])
        seeds = self.grad_outputs()
        if not (backward and grad_mode and seeds):
            return run
        outputs, grads = [], []
        for index, (_, tensor) in enumerate(tensor_leaves(out)):
            if tensor.requires_grad:
                outputs.append(tensor)
                seed = seeds.get(index)
                grads.append(seed.to(tensor.device, tensor.dtype) if seed is not None and
                             seed.shape == tensor.shape else torch.zeros_like(tensor))
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        inputs = [leaf for _, leaf in leaves] + [p for _, p in params]
        if outputs and inputs:
            found = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
            for (index, _), grad in zip(leaves, found):
                if grad is not None:
                    run.grad_input[index] = grad
            for (name, _), grad in zip(params, found[len(leaves):]):
                if grad is not None:
                    run.param_grad.append((name, grad))
        return run

    def compiled_forward(self, module: nn.Module, backend, label: str = "replay") -> Callable:
        """``torch.compile`` of the module's forward, through a code object of its own (as the
        checker compiles it: compilations for several backends do not share Dynamo's cache)."""
        return torch.compile(own_entry(module.forward, f"{label}_{self.module}"), backend=backend)


@dataclass
class Run:
    """What one run of a call produced; ``labels`` names rows by (kind, index)."""

    outputs: List[torch.Tensor]
    grad_input: Dict[int, torch.Tensor] = field(default_factory=dict)
    param_grad: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    labels: Dict[Tuple[str, int], str] = field(default_factory=dict)


def recorded_imports(replay: dict) -> List[str]:
    """The modules a module's replay attribute names for its backend and inductor config objects
    (``--import`` them to replay with those), in order; the capture script (``__main__``), which
    no replay can import, left out."""
    specs = [replay.get("backend", {})] + list(replay.get("inductor_config", {}).values())
    paths = [spec.get("import") or spec.get("defined") or "" for spec in specs]
    modules = [p.partition(":")[0] for p in paths if ":" in p]
    return list(dict.fromkeys(m for m in modules if m != "__main__"))


def recorded_name(spec: dict) -> str:
    """How a recorded backend (or config object) was named: its registered name, its
    ``module:attribute``, or its repr."""
    if "value" in spec:
        return str(spec["value"])
    return str(spec.get("name") or spec.get("import") or spec.get("unknown", "?"))


def _registered(name: str) -> bool:
    """Whether ``name`` is a backend torch.compile knows here (built in, or registered)."""
    from torch._dynamo.backends.registry import lookup_backend  # noqa: PLC0415

    try:
        lookup_backend(name)
        return True
    except Exception:  # InvalidBackend
        return False


def _resolved(path: str, what: str):
    """The object at ``module:attribute`` that the dump recorded, from its module as imported
    here already; ReplayError naming the option that imports it otherwise. A dump never makes
    this process import anything."""
    module_name, _, attribute = path.partition(":")
    value = sys.modules.get(module_name)
    try:
        if value is None:
            raise AttributeError(f"module {module_name} is not imported here")
        for part in attribute.split("."):
            value = getattr(value, part)
    except AttributeError as error:  # the capture script's __main__ is not this process's
        raise ReplayError(f"the recorded {what} {path} is not found here ({error}): "
                          f"{_how_to_import(path, what == 'backend')}") from error
    return value


def _how_to_import(path: str, backend: bool = True) -> str:
    """The option that imports the object recorded at ``module:attribute`` (a backend's, or an
    inductor config object's, which ``--backend`` does not set)."""
    module_name = path.partition(":")[0]
    if module_name == "__main__":
        return ("it was defined in the capture script itself (__main__), which a replay cannot "
                "import: move it into a module and pass " +
                ("--backend module:attribute" if backend else "--import MODULE"))
    also = f" (or --backend {path})" if backend else ""
    return f"pass --import {module_name}{also}, with its folder on PYTHONPATH"


def named_backend(text: str):
    """The backend the user named (``--backend``): a registered backend's name, or
    ``module:attribute``, imported because the user named it. ReplayError naming ``text`` and
    the option when it cannot be found."""
    module_name, colon, attribute = text.partition(":")
    if not colon:
        if _registered(text):
            return text
        raise ReplayError(f"--backend {text}: not a registered backend here; expected "
                          "module:attribute, or a registered backend's name (e.g. inductor)")
    try:
        value = importlib.import_module(module_name)
        for part in attribute.split("."):
            value = getattr(value, part)
    except Exception as error:
        raise ReplayError(f"--backend {text}: cannot import it ({type(error).__name__}: {error}); "
                          "make its module importable (install its package or put its folder "
                          "on PYTHONPATH)") from error
    return value


def import_modules(names: List[str]) -> None:
    """Imports the modules the user named with ``--import``; ReplayError naming one that fails."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:
            raise ReplayError(f"--import {name}: cannot import it ({type(error).__name__}: "
                              f"{error}); install its package or put its folder on "
                              "PYTHONPATH") from error


def _module_device(module: nn.Module) -> str:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return str(tensor.device)
    return "cpu"
