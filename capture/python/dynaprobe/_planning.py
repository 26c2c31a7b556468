"""Planning a check: which wrapped modules become compile targets, how every wrapped or ignored
module is described in the dump's /modules, and the model's provenance (devices, dtypes)."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn

from dynaprobe._C import vocabulary


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
        "device": ", ".join(described),
        "param_dtypes": ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in params})),
    }
