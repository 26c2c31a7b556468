"""Helpers of the analyzer tests: dumps written by dynaprobe's own writer, the `dynaprobe` CLI run
as a user runs it, and data reproducing the spec's example numbers exactly."""

import json
import subprocess
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from dynaprobe import _C

ATOL, RTOL = 1e-4, 1e-3
RULE = "=" * 72
SECTION_RULE = "  " + "-" * 68
CSV_HEADER = "module_name,check_type,tensor_index,status,max_abs_diff,mean_abs_diff,max_rel_diff,shape,note"
MERGED_CSV_HEADER = "rank,scenario," + CSV_HEADER
SPEC_SHAPE = (2, 16, 128)  # the multi-rank example's shape: 4096 elements

# ---------------------------------------------------------------------------------------------
# Running the CLI


def run_cli(cli, *args, cwd=None):
    """Runs `dynaprobe ARGS`; stdout and stderr as text, never raises on a non-zero exit."""
    return subprocess.run([cli, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def compare_json(cli, tmp_path, *args):
    """Runs `dynaprobe compare ARGS --json` and returns (process, parsed JSON)."""
    out = tmp_path / "report.json"
    proc = run_cli(cli, "compare", *args, "--json", out)
    assert proc.returncode in (0, 1), proc.stderr
    return proc, json.loads(out.read_text())


def json_rows(report, rank_index=0, step_index=0):
    return report["ranks"][rank_index]["steps"][step_index]["rows"]


def json_row(report, module, kind="fwd_output", call=0, index=0):
    matches = [
        row for row in json_rows(report)
        if row["module"] == module and row["check_type"] == kind and row["call"] == call and row["tensor_index"] == index
    ]
    assert len(matches) == 1, f"{module} {kind}: {matches}"
    return matches[0]


def json_float(value):
    """The JSON report writes non-finite numbers as the strings "nan", "inf", "-inf"."""
    return float(value)


def csv_lines(path):
    return path.read_text().splitlines()


# ---------------------------------------------------------------------------------------------
# Writing dumps with dynaprobe's own writer


def stored(value):
    """(dtype name, C-contiguous numpy array) as the writer takes them: bfloat16 as uint16 bits."""
    if isinstance(value, torch.Tensor):
        value = value.detach().contiguous()
        if value.dtype == torch.bfloat16:
            return "bfloat16", value.view(torch.int16).numpy().view(np.uint16)
        return str(value.dtype).removeprefix("torch."), value.numpy()
    value = np.asarray(value)
    if not value.flags.c_contiguous:  # not np.ascontiguousarray: it turns 0-d arrays into 1-d
        value = value.copy(order="C")
    return str(value.dtype), value


def as_float_tensor(value):
    """What the spec compares: the tensor converted to float32."""
    return value.float() if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value)).float()


@dataclass
class Rec:
    """One tensor of a module, on one or both sides (None: not recorded on that side)."""

    module: str
    kind: str
    eager: Optional[object] = None
    compiled: Optional[object] = None
    call: int = 0
    index: int = 0

    def tuples(self, sides=("eager", "compiled")):
        for side in sides:
            value = getattr(self, side)
            if value is not None:
                dtype, array = stored(value)
                yield (self.module, self.call, self.kind, self.index, side, "", dtype, array)


def loss_recs(compiled, eager=None, dtype=np.float32):
    """Whole-network loss records (module LOSS, kind loss), 0-d tensors."""
    return [Rec("LOSS", "loss",
                eager=None if eager is None else np.array(eager, dtype=dtype),
                compiled=None if compiled is None else np.array(compiled, dtype=dtype))]


def write_dump(folder, recs, *, step=0, provenance=None, modules=(), graphs=(), sides=("eager", "compiled"),
               chunk_bytes=1 << 20):
    """Writes one step file of a dump folder; returns its path. `modules`: (name, attrs) pairs."""
    records = [t for rec in recs for t in rec.tuples(sides)]
    return _C.write_step(str(folder), step, dict(provenance or {}), records, list(graphs),
                         chunk_bytes=chunk_bytes, modules=list(modules))


def single_pass(**extra):
    return {"mode": "single_pass", **extra}


def two_pass(**extra):
    return {"mode": "two_pass", **extra}


def same(array):
    """An eager/compiled pair with no difference."""
    return dict(eager=array, compiled=array.copy())


RNG = np.random.default_rng(20240601)


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Data reproducing the spec's example numbers exactly


def spec_core_fwd_output():
    """(eager, compiled) of shape (2, 16, 128) whose metrics print as the spec's multi-rank example:
    max_abs 1.192093e-07, mean_abs 3.421843e-08, max_rel 2.980232e-07.

    max_abs = 2^-23: 1.5 one ulp off. max_rel = 2^-23 / 0.4. The sum of |diff| must be
    19263264 * 2^-37 (mean = sum / 4096): the two elements above (2 x 2^14 units), 2347 elements
    in [0.5, 1) one ulp (2^-24 = 8192 units) off, and single-ulp steps of 2^-26, 2^-27, 2^-28,
    2^-29 and 2^-32 (2048 + 1024 + 512 + 256 + 32 units). Every one-ulp step has a relative
    error below 2^-23, so max_rel stays 2.980232e-07.
    """
    f32 = np.float32
    eager = RNG.uniform(-1, 1, 4096).astype(f32)
    compiled = eager.copy()
    up = lambda x: np.nextafter(f32(x), f32(np.inf))  # noqa: E731
    eager[0], compiled[0] = f32(1.5), up(1.5)
    eager[1], compiled[1] = f32(0.4), f32(0.4) + f32(2.0**-23)
    halves = RNG.uniform(0.5, 0.99, 2347).astype(f32)
    eager[2:2349], compiled[2:2349] = halves, up(halves)
    for i, value in enumerate([0.2, 0.1, 0.05, 0.02, 0.003]):  # binades with ulps 2^-26 .. 2^-32
        eager[2349 + i], compiled[2349 + i] = f32(value), up(value)
    return eager.reshape(SPEC_SHAPE), compiled.reshape(SPEC_SHAPE)


def spec_bf16_fwd_output():
    """(eager, compiled) float32 data printing as the spec's bf16 example line: max_abs 2^-15,
    mean_abs 1008 * 2^-15 / 4096, max_rel 6.556511e-05 (one element near 0.4655 off by 2^-15).

    The line cannot come from two bfloat16 tensors: the element with |a - b| = 2^-15 needs
    |a| >= 2^-15 / 6.556511e-05 = 0.465 for its relative error to stay below max_rel, but near
    0.465 bfloat16 values are 2^-9 apart. Under autocast the wrapped block's output is float32
    (residual adds), which is what is stored here.
    """
    f32 = np.float32
    step = f32(2.0**-15)
    eager = RNG.uniform(-1, 1, 4096).astype(f32)
    compiled = eager.copy()
    eager[0] = f32(2.0**-15 / 6.556511e-05)
    compiled[0] = eager[0] + step
    big = RNG.uniform(0.5, 0.99, 1007).astype(f32)
    eager[1:1008], compiled[1:1008] = big, big + step
    return eager.reshape(SPEC_SHAPE), compiled.reshape(SPEC_SHAPE)


def spec_two_pass_dump(folder, shape=SPEC_SHAPE, modules=()):
    """A two-pass step: losses 6.91233985 / 6.91234105 (float64: printed 6.912340 / 6.912341,
    diff 1.200e-06 as in the spec's example) and layers.0 with every kind of tensor."""
    x = randn(*shape)
    out_e, out_c = spec_core_fwd_output() if shape == SPEC_SHAPE else (randn(*shape),) * 2
    grad = randn(*shape)
    recs = loss_recs(compiled=6.91234105, eager=6.91233985, dtype=np.float64) + [
        Rec("layers.0", "fwd_input", **same(x)),
        Rec("layers.0", "fwd_output", eager=out_e, compiled=out_c),
        Rec("layers.0", "grad_input", **same(grad)),
        Rec("layers.0", "grad_output", **same(grad)),
    ]
    return write_dump(folder, recs, provenance=two_pass(), modules=modules)


def report_row(flag, name, detail):
    return f"  {flag}  {name:<51}  {detail}"


def ok_detail(max_abs, mean_abs, max_rel, shape):
    return f"[OK] max_abs={max_abs}  mean_abs={mean_abs}  max_rel={max_rel}  shape={shape}"


ZERO_DETAIL = ok_detail("0.000e+00", "0.000e+00", "0.000e+00", "(2, 16, 128)")


def compare_rows(cli, tmp_path, dump, *args):
    """(process, stdout lines, CSV lines) of `dynaprobe compare DUMP --csv`."""
    csv = tmp_path / "align.csv"
    proc = run_cli(cli, "compare", dump, "--csv", csv, *args)
    assert proc.returncode in (0, 1), proc.stderr
    return proc, proc.stdout.splitlines(), csv_lines(csv)
