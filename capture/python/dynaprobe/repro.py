"""``python -m dynaprobe.repro DUMP --module NAME [--call C] [--step S] -o DIR``: a standalone
folder that replays one stored call of a module, eagerly and compiled, and prints the report's
metrics (docs/user-guide.md, From a failing row to a repro).

The folder holds ``repro.py`` and ``repro_data.pt`` (the call's inputs and argument structure, its
grad_output, the module's weights, buffers, structure and RNG state, the backend and tolerances,
and the metrics the dump recorded). It runs anywhere torch and dynaprobe are installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

import torch

from dynaprobe import _C
from dynaprobe._replay import (UNPICKLE_RISK, ReplayError, StoredCall, inductor_patch, judge,
                               load_call, metrics_lines)
from dynaprobe._result import CompareResult

DATA_FILE = "repro_data.pt"
SCRIPT_FILE = "repro.py"
_DATA_VERSION = 1

_SCRIPT = '''#!/usr/bin/env python3
"""Standalone repro of module {module} (call {call}, step {step}) of a dynaprobe dump.

    python repro.py            needs torch and dynaprobe, and repro_data.pt next to this file

Rebuilds the module ({cls}) with its stored weights and buffers, runs the stored call's inputs
eagerly and compiled with the recorded backend ({backend}), forward and (when the call ran in
grad mode) backward seeded with the stored grad_output, from the stored RNG state, and prints
the report's metrics of both next to those the dump recorded. Exit code 1 when a row FAILs, as
`dynaprobe compare`.

The module is its class ({cls}) called without arguments, which must be importable here:
install the package that defines it or put its source folder on PYTHONPATH. If it needs
arguments, construct it yourself in build_module() below and keep `data.load_weights(module)`,
which sets the stored weights by name. `python repro.py --unpickle` rebuilds it from the pickle
in repro_data.pt instead: {risk}.
A custom backend is imported from where it was defined ({backend}); if that fails, set BACKEND.

Handing it to PyTorch's minifier (accuracy mode, level 4: minify while the numbers differ):
    TORCHDYNAMO_REPRO_AFTER=dynamo TORCHDYNAMO_REPRO_LEVEL=4 python repro.py   (any backend)
    TORCHDYNAMO_REPRO_AFTER=aot TORCHDYNAMO_REPRO_LEVEL=4 python repro.py      (inductor)
The minifier writes torch_compile_debug/.../minifier/minifier_launcher.py; run that script to
shrink the graph to the operations that change the numbers. `python -m dynaprobe.bisect` on the
dump names the compile stage (aot_eager, decompositions and partition, inductor) first at fault.
"""

import os
import sys

import torch

from dynaprobe.repro import load_repro, replay

HERE = os.path.dirname(os.path.abspath(__file__))
data = load_repro(os.path.join(HERE, "{data_file}"))


def build_module():
    return data.build_module(unpickle="--unpickle" in sys.argv[1:])


BACKEND = data.backend()  # the recorded backend; set it yourself if it cannot be imported


if __name__ == "__main__":
    sys.exit(replay(data, build_module(), BACKEND))
'''


class ReproData(StoredCall):
    """A StoredCall read from a repro data file, with the metrics the dump recorded (``recorded``:
    one line per row, as ``metrics_lines`` writes them)."""

    recorded: tuple = ()


def write_repro(dump: str, module: str, out_dir: str, call: Optional[int] = None,
                step: Optional[int] = None) -> str:
    """Writes the repro folder of a stored call of ``module``; returns the script's path.

    Args:
        dump: the dump folder (or one step file) of a PrecisionChecker run with replay data.
        module: the module path, as the report names it.
        call: which call of the module in that step (default: the first one kept).
        step: which step (default: the first one keeping replay data of ``module``).
        out_dir: the folder to write (created; its repro files are replaced).
    """
    stored = load_call(dump, module, call, step)
    dump_dir = os.path.dirname(os.path.abspath(stored.path))
    comparison = _C.compare(dump_dir, dump_dir, step=stored.step, module_glob=module)
    recorded = CompareResult.from_report(comparison.steps[0], dump_dir, stored.path, comparison)
    rows = [r for r in recorded.rows if r.module == module and r.check_type != "note" and (
        r.call == stored.call or r.check_type == "param_grad")]
    os.makedirs(out_dir, exist_ok=True)
    torch.save({
        "version": _DATA_VERSION,
        "module": stored.module, "call": stored.call, "step": stored.step,
        "replay": json.dumps(stored.replay), "provenance": stored.provenance,
        "tensors": stored.tensors,
        "structure": None if stored.structure is None else torch.frombuffer(
            bytearray(stored.structure), dtype=torch.uint8),
        "recorded": metrics_lines(rows),
    }, os.path.join(out_dir, DATA_FILE))
    backend = stored.replay.get("backend", {})
    script = os.path.join(out_dir, SCRIPT_FILE)
    with open(script, "w", encoding="utf-8") as f:
        f.write(_SCRIPT.format(module=module, call=stored.call, step=stored.step,
                               cls=stored.replay["class"], data_file=DATA_FILE,
                               backend=next(iter(backend.values()), "?"),
                               risk=UNPICKLE_RISK))
    return script


def load_repro(path: str) -> ReproData:
    """The stored call of a repro data file (``repro_data.pt``). Read with weights_only: the
    module's pickled structure is only unpickled by ``build_module()``."""
    saved = torch.load(path, weights_only=True)
    if saved.get("version") != _DATA_VERSION:
        raise ReplayError(f"{path} is a repro data file of version {saved.get('version')}, this "
                          f"dynaprobe reads version {_DATA_VERSION}: make the repro again")
    structure = saved["structure"]
    data = ReproData(saved["module"], saved["call"], saved["step"], json.loads(saved["replay"]),
                     saved["tensors"], saved["provenance"],
                     None if structure is None else structure.numpy().tobytes())
    data.recorded = tuple(saved["recorded"])
    return data


def replay(data: StoredCall, module: torch.nn.Module, backend, out=sys.stdout) -> int:
    """Runs the stored call eagerly and compiled with ``backend``, prints the recorded and the
    replayed metrics; returns 1 when a replayed row FAILs, else 0."""
    eager = data.run(module, module.forward)
    with inductor_patch(data.inductor_config()):  # as captured: a custom post-grad pass, say
        compiled = data.run(module, data.compiled_forward(module, backend))
    result = judge(data, [(eager, compiled)])[0]
    recorded = getattr(data, "recorded", None)
    if recorded:
        print(f"recorded ({data.module} call {data.call}, step {data.step}):", file=out)
        for line in recorded:
            print(line, file=out)
    print("replayed:", file=out)
    for line in metrics_lines(result.rows):
        print(line, file=out)
    return 0 if result.all_pass else 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynaprobe.repro",
        description="Writes a standalone folder (repro.py + repro_data.pt) that replays a stored "
                    "call of a module eagerly and compiled and prints the report's metrics.")
    parser.add_argument("dump", help="dump folder (or step file) with replay data")
    parser.add_argument("--module", required=True, help="module path, as the report names it")
    parser.add_argument("--call", type=int, default=None, help="call of the module (default: "
                        "the first one kept)")
    parser.add_argument("--step", type=int, default=None, help="step (default: the first one "
                        "keeping replay data of the module)")
    parser.add_argument("-o", "--output", required=True, help="folder to write")
    args = parser.parse_args(argv)
    try:
        script = write_repro(args.dump, args.module, args.output, args.call, args.step)
    except (ReplayError, OSError, ValueError) as error:
        print(f"dynaprobe repro: {error}", file=sys.stderr)
        return 2
    print(f"Repro written to: {script}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
