"""Planning a check: which modules wrap_by_policy() and wrap_all_children() select, which wrapped
modules become compile targets, how every wrapped or ignored module is described in the dump's
/modules, and the model's provenance (devices, dtypes)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from dynaprobe._C import vocabulary
from dynaprobe._mechanics.capture import autocast_device_type, devices_of
from dynaprobe._mechanics.distributed import nested_fully_shard

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def of_types(model: nn.Module, module_types) -> Iterator[nn.Module]:
    """The submodules of ``model`` (itself too) of ``module_types``, in model order."""
    for _, module in model.named_modules():
        if isinstance(module, module_types):
            yield module


def children_at_depth(model: nn.Module, depth: int) -> List[nn.Module]:
    """The submodules ``depth`` levels below the direct children of ``model`` (depth=0: the
    direct children). Containers (ModuleList, ModuleDict, Sequential) are looked through without
    using up depth; modules without children are taken where the recursion reaches them."""
    found: List[nn.Module] = []

    def visit(module: nn.Module, remaining: int) -> None:
        for child in module.children():
            if isinstance(child, _CONTAINERS):
                visit(child, remaining)
            elif remaining <= 0 or not any(True for _ in child.children()):
                found.append(child)
            else:
                visit(child, remaining - 1)

    visit(model, depth)
    return found


def _under(name: str, prefix: str) -> bool:
    return prefix == "" and name != "" or name.startswith(prefix + ".")


def plan(model: nn.Module, wrapped_modules: List[nn.Module], ignored_modules: List[nn.Module]):
    """``(targets, entries)``: the compile targets (outermost wrapped modules, not ignored) in
    model order as (display name, path) pairs, and the /modules entries (display name,
    attributes) of every wrapped or ignored module. Display names are the paths, the root model
    shown by its class name."""
    names = {}
    for name, module in model.named_modules():
        names.setdefault(id(module), name)
    order = list(names.values())
    root_name = type(model).__name__

    def display(name: str) -> str:
        return name if name else root_name

    unknown = [m for m in wrapped_modules if id(m) not in names]
    if unknown:
        raise ValueError(f"{len(unknown)} wrapped module(s) are not part of the model passed "
                         f"to install()/compare(): wrap modules of this model")
    wrapped = sorted((names[id(m)] for m in wrapped_modules), key=order.index)
    ignored = [names[id(m)] for m in ignored_modules if id(m) in names]
    if not wrapped:
        raise ValueError("no module is wrapped: call wrap(), wrap_by_policy() or "
                         "wrap_all_children() before install() or compare()")
    targets, entries = [], []
    for name in wrapped:
        outer = next((w for w in wrapped if w != name and _under(name, w)), None)
        if any(i == name or _under(name, i) for i in ignored):
            continue
        if outer is not None:
            entries.append((display(name), {
                vocabulary.ATTRIBUTE_ROLE: vocabulary.ROLE_WRAPPED,
                vocabulary.ATTRIBUTE_NOTE: vocabulary.NOTE_INSIDE_COMPILED,
                vocabulary.ATTRIBUTE_REASON: f"inside {display(outer)}, which is compiled as a whole",
            }))
            continue
        targets.append(name)
        entries.append((display(name), {vocabulary.ATTRIBUTE_ROLE: vocabulary.ROLE_WRAPPED}))
    for name in ignored:
        entries.append((display(name), {vocabulary.ATTRIBUTE_ROLE: vocabulary.ROLE_IGNORED}))
    entries.sort(key=lambda e: order.index(e[0]) if e[0] in order else -1)
    return [(display(n), n) for n in targets], entries


@dataclasses.dataclass
class Plan:
    """What a check of one model runs and says: its compile targets (display name, path), the
    /modules entries (display name, attributes), the model's provenance (``describe_model``) and
    its devices (whose autocast a call runs in)."""

    targets: List[Tuple[str, str]]
    modules: List[Tuple[str, Dict[str, str]]]
    devices: Dict[str, str]
    model_devices: set


def plan_check(model: nn.Module, wrapped_modules: List[nn.Module],
               ignored_modules: List[nn.Module], cast_dtype: Optional[torch.dtype]) -> Plan:
    """The plan of checking ``model``; refuses a cast_dtype autocast would drop."""
    targets, modules = plan(model, wrapped_modules, ignored_modules)
    devices = describe_model(model)
    model_devices = devices_of([], model)
    expect_autocast(cast_dtype, autocast_device_type(model_devices))
    return Plan(targets, modules, devices, model_devices)


def expect_autocast(cast_dtype: Optional[torch.dtype], device_type: str) -> None:
    """torch.autocast silently disables itself (with a warning) for a dtype the device does not
    support: the run would not be checked under the dtype the report names."""
    if cast_dtype is None:
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        context = torch.autocast(device_type=device_type, dtype=cast_dtype)
    if not getattr(context, "_enabled", True) or caught:
        said = "; ".join(str(w.message).splitlines()[0] for w in caught)
        raise ValueError(f"cast_dtype={cast_dtype} is not supported by torch.autocast on "
                         f"device type {device_type!r}" + (f" ({said})" if said else "")
                         + ": pass a dtype it supports there, e.g. torch.bfloat16")


def describe_model(model: nn.Module) -> Dict[str, str]:
    """Provenance of the model: where it runs and in which dtypes (cross-machine reports)."""
    params = list(model.parameters())
    devices = sorted({str(p.device) for p in params}) or ["cpu"]
    described = []
    for device in devices:
        if device.startswith("cuda") and torch.cuda.is_available():
            described.append(f"{device} ({torch.cuda.get_device_name(torch.device(device))})")
        else:
            described.append(device)
    return {
        vocabulary.PROVENANCE_DEVICE: ", ".join(described),
        vocabulary.PROVENANCE_PARAM_DTYPES: ", ".join(
            sorted({str(p.dtype).replace("torch.", "") for p in params})),
    }


def warn_nested_fully_shard(entries: List[Tuple[str, Dict[str, str]]], name: str,
                            module: nn.Module, stacklevel: int) -> None:
    """A wrapped module holding fully_shard units below it: their parameters are still
    sharded when it is called (each unit gathers its own inside), so their gradients are not
    compared; its eager re-run gathers them again, on every rank alike. Said in its /modules
    entry (``entries``) and in a warning (``stacklevel``: the caller of install())."""
    nested = nested_fully_shard(module)
    if not nested:
        return
    for entry, attributes in entries:
        if entry == name:
            attributes[vocabulary.ATTRIBUTE_NESTED_FULLY_SHARD] = ", ".join(nested)
    warnings.warn(
        f"dynaprobe: wrapped module {name} contains fully_shard units ({', '.join(nested)}): "
        "the gradients of their parameters are not compared (they are sharded when it is "
        "called); wrap the fully_shard units themselves to compare them", stacklevel=stacklevel)
