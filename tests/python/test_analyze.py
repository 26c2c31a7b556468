"""The `dynaprobe` CLI (compare / ls / graphs) on dumps written by our real writer.

Metrics are checked against torch and numpy computed here, independently of the analyzer; the
reports against the layout and the example lines of the spec (precision-checker.zh.md:
报告说明, CSV 报告格式, 多卡 CSV 报告格式, 精度指标).
"""

import json
import math
import os
import subprocess
from dataclasses import dataclass
from typing import Optional

import h5py
import numpy as np
import pytest
import torch

from dynaprobe import _C

from dump_checksum import group_checksum, set_text_attribute

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
# 1. Metrics against torch and numpy


def metric_cases():
    """module -> (eager, compiled). Each exercises one kind of value the metrics must handle."""
    cases = {}
    a = randn(64, 33)
    cases["random_close"] = (a, a + np.float32(2e-5) * randn(64, 33))
    a = randn(64, 33)
    cases["random_far"] = (a, a + np.float32(3e-3) * randn(64, 33))  # some elements out of tolerance

    a = np.ones(16, np.float32)
    # |a - b| = 1.1005e-3: within atol + rtol * |b| (torch.allclose), not within atol + rtol * |a|
    cases["tolerance_edge"] = (a, a + np.float32(1.1005e-3))

    a = randn(257)
    b = a + np.float32(1e-6) * randn(257)
    a[3], b[7], a[11], b[11] = np.nan, np.nan, np.nan, np.nan  # NaN on each side and on both
    cases["nan"] = (a, b)

    a = randn(300)
    b = a.copy()
    b[5], b[6] = np.inf, -np.inf  # compiled overflows where eager is finite
    cases["inf_in_compiled"] = (a, b)

    a = randn(300)
    a[[1, 2]] = [np.inf, -np.inf]  # equal infinities: inf - inf is NaN, yet allclose holds
    cases["equal_infinities"] = (a, a.copy())

    a = randn(300)
    b = a.copy()
    a[9] = np.inf  # eager infinite, compiled finite: |a-b|/(|a|+1e-8) = inf/inf
    cases["inf_in_eager"] = (a, b)

    a = np.zeros(500, np.float32)
    a[:100] = -0.0
    cases["zeros"] = (a, np.zeros(500, np.float32))

    denormal = np.float32(1e-40)
    a = (np.arange(1, 401, dtype=np.float32) * np.float32(1e-43)).astype(np.float32)
    b = a.copy()
    b[::3] = np.nextafter(a[::3], np.float32(1))  # one denormal step apart
    b[1] = denormal
    a[2], b[2] = np.float32(1.4e-45), np.float32(0)
    cases["denormals"] = (a, b)

    a = randn(200) * np.float32(1e30)
    b = a * np.float32(1 + 1e-6)
    a[0], b[0] = np.float32(3e38), np.float32(-3e38)  # the difference overflows float32
    a[1], b[1] = np.float32(1e-30), np.float32(0)
    cases["large"] = (a, b)

    a = randn(50)
    b = a.copy()
    b[0] = 0.0
    b[1] = -a[1]
    cases["sign_flips"] = (a, b)

    cases["empty"] = (np.zeros((0,), np.float32), np.zeros((0,), np.float32))
    cases["empty_2d"] = (np.zeros((4, 0), np.float32), np.zeros((4, 0), np.float32))
    cases["scalar"] = (np.array(0.5, np.float32), np.array(0.50004, np.float32))
    cases["scalar_far"] = (np.array(2.0, np.float32), np.array(-1.0, np.float32))

    eager = torch.from_numpy(randn(40, 24)).bfloat16()
    compiled = (eager.float() + torch.from_numpy(randn(40, 24)) * 0.01).bfloat16()
    compiled[0, 0] = float("nan")
    cases["bf16"] = (eager, compiled)

    eager = torch.from_numpy(randn(40, 24)).half()
    compiled = (eager.float() * 1.0005).half()
    eager[1, 1], compiled[1, 1] = 70000.0, 65504.0  # overflow to inf in float16
    cases["fp16"] = (eager, compiled)

    eager = torch.from_numpy(randn(8, 8))
    cases["fp32_vs_bf16"] = (eager, eager.bfloat16())  # autocast output against float32
    return cases


METRIC_CASES = metric_cases()


def torch_reference(eager, compiled):
    """The spec's metrics (精度指标) computed with torch, on both tensors as float32."""
    a, b = as_float_tensor(eager), as_float_tensor(compiled)
    diff = (a - b).abs()
    rel = diff / (a.abs() + 1e-8)
    # The error in units of what torch.isclose allows: 0 where equal (equal infinities too), an
    # infinite difference stays infinite (inf / inf would be NaN), NaN where a side is NaN.
    allowed = ATOL + RTOL * b.abs()
    ratio = torch.where(a == b, 0.0, torch.where(diff.isinf(), diff, diff / allowed))
    return {
        "max_abs": diff.max().item(),
        "mean_abs": diff.mean().item(),
        "max_rel": rel.max().item(),
        "max_tol_ratio": ratio.max().item(),
        "allclose": torch.allclose(a, b, atol=ATOL, rtol=RTOL),
        "mismatches": int((~torch.isclose(a, b, atol=ATOL, rtol=RTOL)).sum()),
    }


def numpy_reference(eager, compiled):
    """Cosine similarity, RMSE and NaN/Inf counts in float64 numpy, on float32 values."""
    a = as_float_tensor(eager).numpy()
    b = as_float_tensor(compiled).numpy()
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    with np.errstate(all="ignore"):
        d = np.abs(a - b).astype(np.float64).ravel()  # the difference is taken in float32
        norms = np.dot(a64, a64) * np.dot(b64, b64)
        cosine = 1.0 if not a64.any() and not b64.any() else np.dot(a64, b64) / np.sqrt(norms)
        rmse = float(np.sqrt(np.mean(d * d))) if d.size else 0.0
        mismatches = int((~np.isclose(a, b, rtol=RTOL, atol=ATOL)).sum())
    return {
        "cosine": cosine,
        "rmse": rmse,
        "elements": a.size,
        "mismatches": mismatches,
        "nan_eager": int(np.isnan(a).sum()),
        "nan_compiled": int(np.isnan(b).sum()),
        "inf_eager": int(np.isinf(a).sum()),
        "inf_compiled": int(np.isinf(b).sum()),
    }


def same_float32(ours, theirs):
    if math.isnan(theirs):
        return math.isnan(ours)
    return np.float32(ours) == np.float32(theirs)


def close_or_both_nan(ours, theirs, rel):
    if math.isnan(theirs):
        return math.isnan(ours)
    if math.isinf(theirs):
        return ours == theirs
    return math.isclose(ours, theirs, rel_tol=rel, abs_tol=1e-12)


@pytest.fixture(scope="module", params=["single_pass", "two_dumps"])
def metric_report(request, tmp_path_factory, dynaprobe_cli):
    """Every metric case as one module's fwd_output, compared once per layout: a single-pass dump
    with both sides, or an eager dump and a compiled dump (`compare A B`)."""
    tmp = tmp_path_factory.mktemp(request.param)
    recs = [Rec(module, "fwd_output", eager=e, compiled=c) for module, (e, c) in METRIC_CASES.items()]
    recs.append(Rec("shape_mismatch", "fwd_output", eager=randn(2, 3), compiled=randn(3, 2)))
    if request.param == "single_pass":
        write_dump(tmp / "dump", recs, provenance=single_pass())
        dumps = [tmp / "dump"]
    else:
        write_dump(tmp / "eager", recs, provenance=two_pass(), sides=("eager",))
        write_dump(tmp / "compiled", recs, provenance=two_pass(), sides=("compiled",))
        dumps = [tmp / "eager", tmp / "compiled"]
    # The spec's allclose as it is: the bf16 cases are about its metrics, not the dtype floor.
    proc, report = compare_json(dynaprobe_cli, tmp, *dumps, "--csv", tmp / "report.csv",
                                "--fixed-tolerances")
    return proc, report, csv_lines(tmp / "report.csv")


NONEMPTY_CASES = [name for name, (e, _) in METRIC_CASES.items() if np.prod(tuple(e.shape)) > 0]


@pytest.mark.parametrize("module", NONEMPTY_CASES)
def test_spec_metrics_match_torch(metric_report, module):
    _, report, _ = metric_report
    eager, compiled = METRIC_CASES[module]
    want = torch_reference(eager, compiled)
    got = json_row(report, module)["metrics"]
    # Same float32 arithmetic as torch: max_abs and max_rel bit for bit, NaN where torch has NaN.
    assert same_float32(json_float(got["max_abs"]), want["max_abs"]), (got["max_abs"], want["max_abs"])
    assert same_float32(json_float(got["max_rel"]), want["max_rel"]), (got["max_rel"], want["max_rel"])
    ratio = json_float(got["max_tol_ratio"])
    assert same_float32(ratio, want["max_tol_ratio"]), (ratio, want["max_tol_ratio"])
    # Above 1 exactly when an element is outside tolerance.
    assert (ratio <= 1) == want["allclose"], (ratio, want["allclose"])
    assert close_or_both_nan(json_float(got["mean_abs"]), want["mean_abs"], 1e-6), (got["mean_abs"], want["mean_abs"])
    assert got["allclose"] == want["allclose"]
    assert got["mismatches"] == want["mismatches"]
    assert json_row(report, module)["status"] == ("PASS" if want["allclose"] else "FAIL")


@pytest.mark.parametrize("module", list(METRIC_CASES))
def test_extra_metrics_match_numpy(metric_report, module):
    _, report, _ = metric_report
    eager, compiled = METRIC_CASES[module]
    want = numpy_reference(eager, compiled)
    got = json_row(report, module)["metrics"]
    assert close_or_both_nan(json_float(got["cosine"]), want["cosine"], 1e-6), (got["cosine"], want["cosine"])
    assert close_or_both_nan(json_float(got["rmse"]), want["rmse"], 1e-6), (got["rmse"], want["rmse"])
    for key in ["elements", "mismatches", "nan_eager", "nan_compiled", "inf_eager", "inf_compiled"]:
        assert got[key] == want[key], key


def test_metric_cases_cover_what_they_claim():
    """Guards the test data itself: the special values are really there."""
    ref = {name: torch_reference(e, c) for name, (e, c) in METRIC_CASES.items() if name in NONEMPTY_CASES}
    assert ref["random_close"]["allclose"] and not ref["random_far"]["allclose"]
    assert ref["tolerance_edge"]["allclose"]
    assert math.isnan(ref["nan"]["max_abs"]) and math.isnan(ref["bf16"]["max_abs"])
    assert ref["equal_infinities"]["allclose"] and math.isnan(ref["equal_infinities"]["max_abs"])
    assert ref["inf_in_compiled"]["max_abs"] == math.inf and math.isnan(ref["inf_in_eager"]["max_rel"])
    assert ref["large"]["max_abs"] == math.inf
    assert 0 < ref["denormals"]["max_abs"] < 1.2e-38  # a subnormal difference
    assert ref["fp16"]["max_abs"] == math.inf


@pytest.mark.parametrize("module", ["empty", "empty_2d"])
def test_empty_tensors_have_zero_metrics_and_pass(metric_report, module):
    _, report, csv = metric_report
    row = json_row(report, module)
    assert row["status"] == "PASS"
    metrics = row["metrics"]
    assert (metrics["max_abs"], metrics["mean_abs"], metrics["max_rel"]) == (0, 0, 0)
    assert metrics["allclose"] is True and metrics["elements"] == 0
    shape = '"(0,)"' if module == "empty" else '"(4, 0)"'  # csv quotes fields with commas
    assert f"{module},fwd_output,0,PASS,0.000000e+00,0.000000e+00,0.000000e+00,{shape}," in csv


def test_zero_dimensional_tensors_show_an_empty_shape(metric_report):
    _, report, csv = metric_report
    assert json_row(report, "scalar")["eager"]["shape"] == []
    assert any(line.startswith("scalar,fwd_output,0,PASS,") and line.endswith(",(),") for line in csv)
    assert any(line.startswith("scalar_far,fwd_output,0,FAIL,3.000000e+00,3.000000e+00,1.500000e+00,(),") for line in csv)


def test_shape_mismatch_fails_with_infinite_metrics(metric_report):
    proc, report, csv = metric_report
    assert json_row(report, "shape_mismatch")["status"] == "FAIL"
    assert any(line.startswith('shape_mismatch,fwd_output,0,FAIL,inf,inf,inf,"((2, 3), (3, 2))",') for line in csv)
    assert "[!!] max_abs=inf  mean_abs=inf  max_rel=inf  shape=((2, 3), (3, 2))" in proc.stdout


def test_bf16_and_fp16_are_stored_with_their_dtype(metric_report):
    _, report, _ = metric_report
    assert json_row(report, "bf16")["eager"]["dtype"] == "bfloat16"
    assert json_row(report, "fp16")["compiled"]["dtype"] == "float16"
    mixed = json_row(report, "fp32_vs_bf16")
    assert (mixed["eager"]["dtype"], mixed["compiled"]["dtype"]) == ("float32", "bfloat16")


def test_failures_and_nan_make_the_comparison_fail(metric_report):
    proc, report, _ = metric_report
    assert proc.returncode == 1
    assert report["summary"]["all_pass"] is False
    assert "RESULT: FAILED" in proc.stdout


@pytest.mark.parametrize("shape", [(300, 257), (1100, 1031)], ids=["small", "large"])  # < and > 4 MiB a pair
@pytest.mark.parametrize("eager_chunk, compiled_chunk, threads", [
    (4096, 4096, 0), (4096, 12000, 0), (1 << 20, 3000, 0), (4096, 12000, 1)])
def test_metrics_do_not_depend_on_chunking_or_threads(tmp_path, dynaprobe_cli, shape, eager_chunk, compiled_chunk, threads):
    """Tensors are compared chunk by chunk, in parallel, with the two dumps chunked differently;
    the result must still be torch's, and the worst element the first largest."""
    a = randn(*shape)
    b = a + np.float32(1e-4) * randn(*shape)
    b[123, 45] += np.float32(0.5)
    b[250, 0] += np.float32(0.5)  # the same difference again, later: the first one is the worst
    write_dump(tmp_path / "eager", [Rec("big", "fwd_output", eager=a)], sides=("eager",), chunk_bytes=eager_chunk)
    write_dump(tmp_path / "compiled", [Rec("big", "fwd_output", compiled=b)], sides=("compiled",), chunk_bytes=compiled_chunk)
    _, report = compare_json(dynaprobe_cli, tmp_path, tmp_path / "eager", tmp_path / "compiled", "--threads", threads)
    got = json_row(report, "big")["metrics"]
    want = torch_reference(a, b)
    assert same_float32(got["max_abs"], want["max_abs"]) and same_float32(got["max_rel"], want["max_rel"])
    assert math.isclose(got["mean_abs"], want["mean_abs"], rel_tol=1e-6)
    assert got["mismatches"] == want["mismatches"] and got["allclose"] == want["allclose"]
    d = np.abs(a - b)
    first_worst = int(np.argmax(d))
    assert got["worst"]["flat_index"] == first_worst
    assert got["worst"]["index"] == list(np.unravel_index(first_worst, a.shape))
    assert (np.float32(got["worst"]["eager"]), np.float32(got["worst"]["compiled"])) == (a.flat[first_worst], b.flat[first_worst])


def test_worst_element_is_the_first_nan_difference(tmp_path, dynaprobe_cli):
    a = randn(1000)
    b = a.copy()
    b[10] += 100
    b[700], b[900] = np.nan, np.nan
    write_dump(tmp_path / "dump", [Rec("m", "fwd_output", eager=a, compiled=b)], chunk_bytes=512)
    _, report = compare_json(dynaprobe_cli, tmp_path, tmp_path / "dump")
    worst = json_row(report, "m")["metrics"]["worst"]
    assert worst["flat_index"] == 700 and worst["compiled"] == "nan"


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


def test_spec_example_data_is_what_the_docstrings_say():
    e, c = spec_core_fwd_output()
    ref = torch_reference(e, c)
    assert "%.6e %.6e %.6e" % (ref["max_abs"], ref["mean_abs"], ref["max_rel"]) == "1.192093e-07 3.421843e-08 2.980232e-07"
    e, c = spec_bf16_fwd_output()
    ref = torch_reference(e, c)
    assert "%.6e %.6e %.6e" % (ref["max_abs"], ref["mean_abs"], ref["max_rel"]) == "3.051758e-05 7.510185e-06 6.556511e-05"


# ---------------------------------------------------------------------------------------------
# 2. Report text and CSV


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


def test_stdout_report_has_the_spec_layout(tmp_path, dynaprobe_cli):
    spec_two_pass_dump(tmp_path / "dump")
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump")
    assert proc.returncode == 0, proc.stderr
    expected = "\n".join([
        RULE,
        "  Loss  eager=6.912340  compiled=6.912341  diff=1.200e-06",
        RULE,
        "",
        "  FORWARD INPUT",
        SECTION_RULE,
        report_row("pass", "layers.0", ZERO_DETAIL),
        "",
        "  FORWARD OUTPUT",
        SECTION_RULE,
        report_row("pass", "layers.0", ok_detail("1.192e-07", "3.422e-08", "2.980e-07", "(2, 16, 128)")),
        "",
        "  BACKWARD",
        SECTION_RULE,
        report_row("pass", "layers.0.grad_input", ZERO_DETAIL),
        report_row("pass", "layers.0.grad_output", ZERO_DETAIL),
        "",
        RULE,
        "  RESULT: ALL PASS  (atol=1e-4 rtol=1e-3)",
        RULE,
        "",
    ])
    assert proc.stdout == expected


def test_report_row_matches_the_spec_example_line_character_for_character(tmp_path, dynaprobe_cli):
    # The spec's own line, with its shape and numbers swapped for ours.
    spec_line = ("  pass  layers.0                                             [OK] max_abs=0.000e+00  "
                 "mean_abs=0.000e+00  max_rel=0.000e+00  shape=(2, 128, 4096)")
    assert report_row("pass", "layers.0", ok_detail("0.000e+00", "0.000e+00", "0.000e+00", "(2, 128, 4096)")) == spec_line
    spec_two_pass_dump(tmp_path / "dump")
    assert report_row("pass", "layers.0", ZERO_DETAIL) in run_cli(dynaprobe_cli, "compare", tmp_path / "dump").stdout.splitlines()


def test_failing_rows_are_marked_and_the_result_is_failed(tmp_path, dynaprobe_cli):
    e = np.full((2, 3), 1.0, np.float32)
    c = e.copy()
    c[1, 2] = 1.5
    write_dump(tmp_path / "dump", [Rec("layers.1", "fwd_output", eager=e, compiled=c),
                                   Rec("layers.1", "grad_input", eager=e, compiled=c)], provenance=two_pass())
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump")
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    fail_detail = "[!!] max_abs=5.000e-01  mean_abs=8.333e-02  max_rel=5.000e-01  shape=(2, 3)"
    assert report_row("FAIL", "layers.1", fail_detail) in lines
    assert report_row("FAIL", "layers.1.grad_input", fail_detail) in lines
    assert "  RESULT: FAILED  (2 FAIL, 0 WARN; atol=1e-4 rtol=1e-3)" in lines


def test_further_tensors_of_a_module_continue_under_its_line(tmp_path, dynaprobe_cli):
    x = np.ones((2, 3), np.float32)
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", **same(x), index=0),
                                   Rec("layers.0", "fwd_output", eager=x, compiled=x * 2, index=1)], provenance=two_pass())
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump")
    lines = proc.stdout.splitlines()
    first = lines.index(report_row("FAIL", "layers.0", ok_detail("0.000e+00", "0.000e+00", "0.000e+00", "(2, 3)")))
    assert lines[first + 1] == " " * 61 + "[!!] max_abs=1.000e+00  mean_abs=1.000e+00  max_rel=1.000e+00  shape=(2, 3)"


def test_single_pass_loss_line_has_nan_eager_and_says_why(tmp_path, dynaprobe_cli):
    write_dump(tmp_path / "dump", loss_recs(compiled=0.333408) + [Rec("layers.0", "fwd_output", **same(randn(4)))],
               provenance=single_pass())
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump")
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[1] == ("  Loss  eager=nan  compiled=0.333408  diff=nan"
                                           "  (single-pass: no whole-model eager run)")


def test_csv_reproduces_the_spec_example_lines(tmp_path, dynaprobe_cli):
    """The spec's CSV example (shape (2, 128, 4096)): header, the two-pass LOSS row, the
    fwd_input row and the IGNORED note row, verbatim."""
    spec_two_pass_dump(tmp_path / "dump", shape=(2, 128, 4096), modules=[("layers.0", {"role": "wrapped"}),
                                                                          ("layers.1", {"role": "ignored"})])
    csv = tmp_path / "precision_report.csv"
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--csv", csv)
    assert proc.returncode == 0, proc.stderr
    lines = csv_lines(csv)
    assert lines[0] == CSV_HEADER
    assert lines[1] == "LOSS,loss,0,PASS,1.200000e-06,N/A,N/A,eager=6.912340 compiled=6.912341,"
    assert 'layers.0,fwd_input,0,PASS,0.000000e+00,0.000000e+00,0.000000e+00,"(2, 128, 4096)",' in lines
    assert "layers.1,note,0,SKIP,,,,,IGNORED" in lines
    assert proc.stdout.endswith(f"CSV report saved to: {csv}\n")


def test_csv_rows_have_the_spec_number_format(tmp_path, dynaprobe_cli):
    spec_two_pass_dump(tmp_path / "dump")
    csv = tmp_path / "r.csv"
    run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--csv", csv)
    assert csv_lines(csv)[1:] == [
        "LOSS,loss,0,PASS,1.200000e-06,N/A,N/A,eager=6.912340 compiled=6.912341,",
        'layers.0,fwd_input,0,PASS,0.000000e+00,0.000000e+00,0.000000e+00,"(2, 16, 128)",',
        'layers.0,fwd_output,0,PASS,1.192093e-07,3.421843e-08,2.980232e-07,"(2, 16, 128)",',
        'layers.0,grad_input,0,PASS,0.000000e+00,0.000000e+00,0.000000e+00,"(2, 16, 128)",',
        'layers.0,grad_output,0,PASS,0.000000e+00,0.000000e+00,0.000000e+00,"(2, 16, 128)",',
    ]


def test_single_pass_csv_loss_row_matches_the_spec(tmp_path, dynaprobe_cli):
    write_dump(tmp_path / "dump", loss_recs(compiled=0.333408) + [Rec("layers.0", "fwd_output", **same(randn(4)))],
               provenance=single_pass())
    csv = tmp_path / "r.csv"
    run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--csv", csv)
    assert csv_lines(csv)[1] == "LOSS,loss,0,PASS,N/A,N/A,N/A,compiled=0.333408,single_pass mode"


# ---------------------------------------------------------------------------------------------
# 3. Aligning the two sides


def compare_rows(cli, tmp_path, dump, *args):
    """(process, stdout lines, CSV lines) of `dynaprobe compare DUMP --csv`."""
    csv = tmp_path / "align.csv"
    proc = run_cli(cli, "compare", dump, "--csv", csv, *args)
    assert proc.returncode in (0, 1), proc.stderr
    return proc, proc.stdout.splitlines(), csv_lines(csv)


def test_tensor_missing_on_the_compiled_side_warns(tmp_path, dynaprobe_cli):
    x = randn(2, 3)
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", eager=x),
                                   Rec("layers.0", "grad_input", eager=x),
                                   Rec("layers.1", "fwd_output", **same(x))], provenance=two_pass())
    proc, lines, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump")
    assert proc.returncode == 1
    assert report_row("WARN", "layers.0", "MISSING_fwd_in_compiled") in lines
    assert report_row("WARN", "layers.0.grad_input", "MISSING_bwd_in_compiled") in lines
    assert 'layers.0,fwd_output,0,WARN,,,,"(2, 3)",MISSING_fwd_in_compiled' in csv
    assert 'layers.0,grad_input,0,WARN,,,,"(2, 3)",MISSING_bwd_in_compiled' in csv
    assert "  RESULT: FAILED  (0 FAIL, 2 WARN; atol=1e-4 rtol=1e-3)" in lines


def test_tensor_missing_on_the_eager_side_warns(tmp_path, dynaprobe_cli):
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", compiled=randn(5))], provenance=single_pass())
    proc, lines, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump")
    assert proc.returncode == 1
    assert report_row("WARN", "layers.0", "MISSING_fwd_in_eager") in lines
    assert "layers.0,fwd_output,0,WARN,,,,\"(5,)\",MISSING_fwd_in_eager" in csv


def test_single_pass_input_recorded_once_stands_for_both_sides(tmp_path, dynaprobe_cli):
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_input", compiled=randn(5)),
                                   Rec("layers.0", "fwd_output", **same(randn(5)))], provenance=single_pass())
    proc, _, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump")
    assert proc.returncode == 0
    assert "layers.0,fwd_input,0,PASS,0.000000e+00,0.000000e+00,0.000000e+00,\"(5,)\"," in csv


def test_module_inside_a_wrapped_module_is_skipped_when_compiled_fuses_it(tmp_path, dynaprobe_cli):
    x = randn(3)
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", **same(x)),
                                   Rec("layers.0.mlp", "fwd_output", eager=x),
                                   Rec("layers.0.mlp", "grad_input", eager=x)],
               provenance=two_pass(), modules=[("layers.0", {"role": "wrapped"}), ("layers.0.mlp", {})])
    proc, lines, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump")
    assert proc.returncode == 0  # skips do not fail the comparison
    assert report_row("skip", "layers.0.mlp", "SKIP_inside_compiled") in lines
    assert report_row("skip", "layers.0.mlp.grad_input", "SKIP_inside_compiled") in lines
    assert 'layers.0.mlp,fwd_output,0,SKIP,,,,"(3,)",SKIP_inside_compiled' in csv
    assert "  RESULT: ALL PASS  (atol=1e-4 rtol=1e-3)" in lines


def test_wrapped_module_without_compiled_backward_is_a_compiled_wrapper_skip(tmp_path, dynaprobe_cli):
    x = randn(3)
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", **same(x)),
                                   Rec("layers.0", "grad_output", eager=x)],
               provenance=two_pass(), modules=[("layers.0", {"role": "wrapped"})])
    proc, lines, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump")
    assert proc.returncode == 0
    assert report_row("skip", "layers.0.grad_output", "SKIP_compiled_wrapper") in lines
    assert 'layers.0,grad_output,0,SKIP,,,,"(3,)",SKIP_compiled_wrapper' in csv


def test_ignored_module_is_reported_and_not_compared(tmp_path, dynaprobe_cli):
    x = randn(3)
    far = x + 10
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", **same(x)),
                                   Rec("layers.1", "fwd_output", eager=x, compiled=far),
                                   Rec("layers.1.attn", "fwd_output", eager=x, compiled=far)],
               provenance=two_pass(), modules=[("layers.0", {"role": "wrapped"}), ("layers.1", {"role": "ignored"})])
    proc, lines, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump")
    assert proc.returncode == 0
    assert report_row("skip", "layers.1", "IGNORED") in lines
    assert "layers.1,note,0,SKIP,,,,,IGNORED" in csv
    assert not any(line.startswith(("layers.1,fwd_output", "layers.1.attn")) for line in csv)
    assert "layers.1.attn" not in proc.stdout


def test_module_called_twice_shows_both_calls(tmp_path, dynaprobe_cli):
    x = randn(3)
    y = x.copy()
    y[0] += 1
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", **same(x)),
                                   Rec("layers.0", "fwd_output", eager=x, compiled=y, call=1),
                                   Rec("layers.0", "grad_input", **same(x), call=1)], provenance=two_pass())
    proc, lines, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump")
    assert proc.returncode == 1
    assert report_row("pass", "layers.0", ok_detail("0.000e+00", "0.000e+00", "0.000e+00", "(3,)")) in lines
    assert any(line.startswith(report_row("FAIL", "layers.0 (call 1)", "[!!] max_abs=1.000e+00")) for line in lines)
    assert report_row("pass", "layers.0.grad_input (call 1)", ok_detail("0.000e+00", "0.000e+00", "0.000e+00", "(3,)")) in lines
    assert any(line.startswith("layers.0,fwd_output,0,PASS,") for line in csv)
    assert any(line.startswith("layers.0 (call 1),fwd_output,0,FAIL,1.000000e+00,") for line in csv)
    assert any(line.startswith("layers.0 (call 1),grad_input,0,PASS,") for line in csv)


def test_module_note_is_a_warning_that_fails_the_result(tmp_path, dynaprobe_cli):
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", **same(randn(3)))], provenance=two_pass(),
               modules=[("layers.0", {"role": "wrapped"}),
                        ("layers.2", {"role": "wrapped", "note": "NOT_COMPILED", "reason": "graph break in forward"})])
    proc, lines, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump")
    assert proc.returncode == 1
    note = lines.index(report_row("WARN", "layers.2", "NOT_COMPILED"))
    assert lines[note + 1] == "        graph break in forward"
    assert "layers.2,note,0,WARN,,,,,NOT_COMPILED: graph break in forward" in csv
    assert "  RESULT: FAILED  (0 FAIL, 1 WARN; atol=1e-4 rtol=1e-3)" in lines


def test_exit_code_is_zero_when_everything_passes(tmp_path, dynaprobe_cli):
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", **same(randn(3)))], provenance=two_pass())
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump")
    assert proc.returncode == 0
    assert "  RESULT: ALL PASS  (atol=1e-4 rtol=1e-3)" in proc.stdout.splitlines()


def test_module_glob_limits_the_comparison(tmp_path, dynaprobe_cli):
    x = randn(3)
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", **same(x)),
                                   Rec("layers.1", "fwd_output", eager=x, compiled=x + 1),
                                   Rec("head", "fwd_output", **same(x))], provenance=two_pass())
    proc, _, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump", "--module", "layers.0*")
    assert proc.returncode == 0
    assert [line.split(",")[0] for line in csv[2:]] == ["layers.0"]
    proc, _, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump", "--module", "layers.*")
    assert proc.returncode == 1
    assert [line.split(",")[0] for line in csv[2:]] == ["layers.0", "layers.1"]


def test_module_filter_matching_nothing_is_a_usage_error(tmp_path, dynaprobe_cli):
    x = randn(3)
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", **same(x)), Rec("head", "fwd_output", **same(x))],
               provenance=two_pass(), modules=[("layers.0", {"role": "wrapped"}), ("head", {"role": "wrapped"})])
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--module", "typo*")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "RESULT" not in proc.stdout
    assert "'typo*'" in proc.stderr and "matches no module" in proc.stderr
    assert "layers.0, head" in proc.stderr  # what the dump has, to fix the typo with


def test_nothing_compared_is_never_a_pass(tmp_path, dynaprobe_cli):
    # A step with the loss and an ignored module only: no tensor had both sides to compare.
    x = randn(3)
    write_dump(tmp_path / "dump", loss_recs(eager=1.0, compiled=1.0) + [Rec("head", "fwd_output", **same(x))],
               provenance=two_pass(), modules=[("head", {"role": "ignored"})])
    csv = tmp_path / "r.csv"
    proc, report = compare_json(dynaprobe_cli, tmp_path, tmp_path / "dump", "--csv", csv)
    assert proc.returncode == 1
    assert "  RESULT: FAILED  (0 FAIL, 0 WARN, nothing compared; atol=1e-4 rtol=1e-3)" in proc.stdout.splitlines()
    assert csv_lines(csv)[1:] == ["LOSS,loss,0,PASS,0.000000e+00,N/A,N/A,eager=1.000000 compiled=1.000000,",
                                  "head,note,0,SKIP,,,,,IGNORED"]
    step = report["ranks"][0]["steps"][0]
    assert step["all_pass"] is False and report["summary"]["all_pass"] is False
    assert step["result"] == {"verdict": "FAILED", "fail": 0, "warn": 0, "pass": 0, "skip": 1, "compared": 0,
                              "noise_pass": 0, "no_reference_calls": 0, "loss_fail": False,
                              "nothing_compared": True}
    assert report["summary"]["nothing_compared_steps"] == 1 and report["summary"]["failed_steps"] == 1
    # The Python API reads the same verdict through the binding (result.all_pass).
    comparison = _C.compare(str(tmp_path / "dump"), str(tmp_path / "dump"))
    assert comparison.all_pass is False and comparison.steps[0].all_pass is False
    assert comparison.steps[0].counts["nothing_compared"] is True


def test_stdout_csv_and_json_agree_on_what_failed(tmp_path, dynaprobe_cli):
    # FAILED because of WARN rows only (a tensor missing on one side, a module note), then also
    # because of a FAIL row and the loss check: all three reports give the same counts.
    x = randn(3)
    recs = [Rec("layers.0", "fwd_output", **same(x)), Rec("layers.1", "fwd_output", eager=x)]
    modules = [("layers.0", {"role": "wrapped"}), ("layers.1", {"role": "wrapped"}),
               ("layers.2", {"role": "wrapped", "note": "NOT_RUN"})]
    write_dump(tmp_path / "warn", loss_recs(eager=1.0, compiled=1.0) + recs, provenance=two_pass(), modules=modules)
    write_dump(tmp_path / "fail", loss_recs(eager=1.0, compiled=2.0) + recs + [Rec("layers.3", "fwd_output", eager=x, compiled=x + 1)],
               provenance=two_pass(), modules=modules)
    for name, fail, warn, loss_fail, line in [
        ("warn", 0, 2, False, "  RESULT: FAILED  (0 FAIL, 2 WARN; atol=1e-4 rtol=1e-3)"),
        ("fail", 1, 2, True, "  RESULT: FAILED  (1 FAIL, 2 WARN, loss FAIL; atol=1e-4 rtol=1e-3)"),
    ]:
        csv = tmp_path / f"{name}.csv"
        proc, report = compare_json(dynaprobe_cli, tmp_path, tmp_path / name, "--csv", csv)
        assert proc.returncode == 1
        assert line in proc.stdout.splitlines()
        statuses = [row.split(",")[3] for row in csv_lines(csv)[1:]]
        assert statuses[0] == ("FAIL" if loss_fail else "PASS")  # the LOSS row
        assert (statuses[1:].count("FAIL"), statuses[1:].count("WARN")) == (fail, warn)
        result = report["ranks"][0]["steps"][0]["result"]
        assert (result["verdict"], result["fail"], result["warn"], result["loss_fail"]) == ("FAILED", fail, warn, loss_fail)
        summary = report["summary"]
        assert (summary["all_pass"], summary["fail"], summary["warn"], summary["loss_fail"]) == (False, fail, warn, int(loss_fail))
        statuses_json = [row["status"] for row in json_rows(report)]
        assert (statuses_json.count("FAIL"), statuses_json.count("WARN")) == (fail, warn)


def test_step_option_selects_one_step(tmp_path, dynaprobe_cli):
    x = randn(3)
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", **same(x))], step=0, provenance=two_pass())
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", eager=x, compiled=x + 1)], step=1, provenance=two_pass())
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump")
    assert proc.returncode == 1
    assert "Step 1" in proc.stdout.splitlines()  # the failing step's report, after the summary
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--step", "0")
    assert proc.returncode == 0 and "Step 1" not in proc.stdout
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--step", "1")
    assert proc.returncode == 1 and "FAIL  layers.0" in proc.stdout
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--step", "7")
    assert proc.returncode == 2 and "--steps 7 matches no step" in proc.stderr
    # --step reads that step's file only (a checker compares each step of a long run as it ends):
    # damage to another step does not stop it.
    (tmp_path / "dump" / "step_00000001.h5").write_bytes(b"damaged" * 100)
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--step", "0")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump")
    assert proc.returncode == 3 and "step_00000001.h5" in proc.stderr


def test_step_missing_from_one_dump_is_warned_about(tmp_path, dynaprobe_cli):
    x = randn(3)
    for step in (0, 1):
        write_dump(tmp_path / "eager", [Rec("layers.0", "fwd_output", eager=x)], step=step, sides=("eager",))
    write_dump(tmp_path / "compiled", [Rec("layers.0", "fwd_output", compiled=x)], step=0, sides=("compiled",))
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "eager", tmp_path / "compiled")
    assert proc.returncode == 1
    assert "step 1 is only in the eager dump" in proc.stderr
    assert report_row("WARN", "layers.0", "MISSING_fwd_in_compiled") in proc.stdout.splitlines()


def test_unfinished_step_is_skipped_with_a_warning(tmp_path, dynaprobe_cli):
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", **same(randn(3)))], provenance=two_pass())
    (tmp_path / "dump" / "step_00000001.h5.partial").write_bytes(b"killed mid-write")
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump")
    assert proc.returncode == 0
    assert "step_00000001.h5.partial" in proc.stderr and "unfinished" in proc.stderr


def tolerance_dump(folder, provenance):
    """layers.0 off by 5e-4 (fails at the default atol=1e-4 on values near 0.01)."""
    e = np.full(4, 0.01, np.float32)
    return write_dump(folder, [Rec("layers.0", "fwd_output", eager=e, compiled=e + np.float32(5e-4))], provenance=provenance)


def test_dump_tolerances_are_used_by_default(tmp_path, dynaprobe_cli):
    tolerance_dump(tmp_path / "default", two_pass())
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "default")
    assert proc.returncode == 1 and "  RESULT: FAILED  (1 FAIL, 0 WARN; atol=1e-4 rtol=1e-3)" in proc.stdout
    tolerance_dump(tmp_path / "loose", two_pass(atol="0.001", rtol="0.01"))
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "loose")
    assert proc.returncode == 0 and "  RESULT: ALL PASS  (atol=1e-3 rtol=0.01)" in proc.stdout


def test_tolerance_options_override_the_dump(tmp_path, dynaprobe_cli):
    tolerance_dump(tmp_path / "loose", two_pass(atol="0.001", rtol="0.01"))
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "loose", "--atol", "1e-5", "--rtol", "1e-5")
    assert proc.returncode == 1 and "  RESULT: FAILED  (1 FAIL, 0 WARN; atol=1e-5 rtol=1e-5)" in proc.stdout
    tolerance_dump(tmp_path / "default", two_pass())
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "default", "--atol", "1e-3")
    assert proc.returncode == 0 and "  RESULT: ALL PASS  (atol=1e-3 rtol=1e-3)" in proc.stdout


def test_one_tolerance_option_keeps_the_dump_value_of_the_other(tmp_path, dynaprobe_cli):
    # --help: "--rtol ... (default: the dump's, else 1e-3)", also when only --atol is given.
    e = np.ones(4, np.float32)
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", eager=e, compiled=e + np.float32(5e-3))],
               provenance=two_pass(atol="0.001", rtol="0.01"))  # passes by rtol alone
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--atol", "1e-5")
    assert proc.returncode == 0 and "  RESULT: ALL PASS  (atol=1e-5 rtol=0.01)" in proc.stdout.splitlines()
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--rtol", "0")
    assert proc.returncode == 1 and "  RESULT: FAILED  (1 FAIL, 0 WARN; atol=1e-3 rtol=0)" in proc.stdout.splitlines()


# ---------------------------------------------------------------------------------------------
# 4. Multi-rank runs


def spec_core_rank(run, rank):
    """rank<R>/ of the spec's "core" scenario: single-pass, loss 0.333408, layers.0 input equal,
    output as in the example, grad_input equal."""
    x, grad = randn(*SPEC_SHAPE), randn(*SPEC_SHAPE)
    out_e, out_c = spec_core_fwd_output()
    recs = loss_recs(compiled=0.333408) + [
        Rec("layers.0", "fwd_input", compiled=x),  # single-pass: the input is recorded once
        Rec("layers.0", "fwd_output", eager=out_e, compiled=out_c),
        Rec("layers.0", "grad_input", **same(grad)),
    ]
    write_dump(run / f"rank{rank}", recs, provenance=single_pass(rank=str(rank), scenario="core", world_size="2"),
               modules=[("layers.0", {"role": "wrapped"})])


def test_merged_csv_of_a_run_reproduces_the_spec_core_lines(tmp_path, dynaprobe_cli):
    run = tmp_path / "core"
    spec_core_rank(run, 0)
    spec_core_rank(run, 1)
    merged = tmp_path / "merged.csv"
    proc = run_cli(dynaprobe_cli, "compare", run, "--merged-csv", merged)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = csv_lines(merged)
    assert lines[0] == MERGED_CSV_HEADER
    for spec_line in [
        "0,core,LOSS,loss,0,PASS,N/A,N/A,N/A,compiled=0.333408,single_pass mode",
        '0,core,layers.0,fwd_input,0,PASS,0.000000e+00,0.000000e+00,0.000000e+00,"(2, 16, 128)",',
        '0,core,layers.0,fwd_output,0,PASS,1.192093e-07,3.421843e-08,2.980232e-07,"(2, 16, 128)",',
        '0,core,layers.0,grad_input,0,PASS,0.000000e+00,0.000000e+00,0.000000e+00,"(2, 16, 128)",',
        "1,core,LOSS,loss,0,PASS,N/A,N/A,N/A,compiled=0.333408,single_pass mode",
        '1,core,layers.0,fwd_input,0,PASS,0.000000e+00,0.000000e+00,0.000000e+00,"(2, 16, 128)",',
    ]:
        assert spec_line in lines
    ranks = [line.split(",")[0] for line in lines[1:]]
    assert ranks == ["0"] * 4 + ["1"] * 4  # rank 0's rows, then rank 1's
    assert all(line.split(",")[1] == "core" for line in lines[1:])


def test_merged_csv_reproduces_the_spec_bf16_line(tmp_path, dynaprobe_cli):
    run = tmp_path / "bf16"
    e, c = spec_bf16_fwd_output()
    write_dump(run / "rank0", loss_recs(compiled=0.333408) + [Rec("layers.1", "fwd_output", eager=e, compiled=c)],
               provenance=single_pass(rank="0", scenario="bf16", cast_dtype="torch.bfloat16"))
    write_dump(run / "rank1", loss_recs(compiled=0.333408) + [Rec("layers.1", "fwd_output", **same(e))],
               provenance=single_pass(rank="1", scenario="bf16", cast_dtype="torch.bfloat16"))
    merged = tmp_path / "merged.csv"
    assert run_cli(dynaprobe_cli, "compare", run, "--merged-csv", merged).returncode == 0
    assert '0,bf16,layers.1,fwd_output,0,PASS,3.051758e-05,7.510185e-06,6.556511e-05,"(2, 16, 128)",' in csv_lines(merged)


def test_merged_csv_reproduces_the_spec_ignore_line(tmp_path, dynaprobe_cli):
    run = tmp_path / "ignore"
    for rank in (0, 1):
        x = randn(*SPEC_SHAPE)
        write_dump(run / f"rank{rank}", loss_recs(compiled=0.333408) + [
            Rec("layers.0", "fwd_output", eager=x, compiled=x + 1),  # ignored: never compared
            Rec("layers.1", "fwd_output", **same(x))],
            provenance=single_pass(rank=str(rank), scenario="ignore"),
            modules=[("layers.0", {"role": "ignored"}), ("layers.1", {"role": "wrapped"})])
    merged = tmp_path / "merged.csv"
    assert run_cli(dynaprobe_cli, "compare", run, "--merged-csv", merged).returncode == 0
    lines = csv_lines(merged)
    assert "1,ignore,layers.0,-,0,SKIP,N/A,N/A,N/A,,IGNORED" in lines
    assert "0,ignore,layers.0,-,0,SKIP,N/A,N/A,N/A,,IGNORED" in lines


def test_two_runs_are_compared_rank_by_rank(tmp_path, dynaprobe_cli):
    data = {rank: randn(4) for rank in (0, 1)}
    for rank, x in data.items():
        write_dump(tmp_path / "eager_run" / f"rank{rank}", [Rec("layers.0", "fwd_output", eager=x)], sides=("eager",),
                   provenance=two_pass(rank=str(rank), scenario="core"))
        y = x + np.float32(rank)  # rank 1 differs
        write_dump(tmp_path / "compiled_run" / f"rank{rank}", [Rec("layers.0", "fwd_output", compiled=y)],
                   sides=("compiled",), provenance=two_pass(rank=str(rank), scenario="core"))
    merged = tmp_path / "merged.csv"
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "eager_run", tmp_path / "compiled_run", "--merged-csv", merged)
    assert proc.returncode == 1
    lines = csv_lines(merged)
    assert any(line.startswith("0,core,layers.0,fwd_output,0,PASS,0.000000e+00,") for line in lines)
    assert any(line.startswith("1,core,layers.0,fwd_output,0,FAIL,1.000000e+00,") for line in lines)
    write_dump(tmp_path / "compiled_run" / "rank2", [Rec("layers.0", "fwd_output", compiled=data[0])], sides=("compiled",))
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "eager_run", tmp_path / "compiled_run")
    assert proc.returncode == 2 and "rank" in proc.stderr


def test_per_rank_csvs_are_named_after_the_rank(tmp_path, dynaprobe_cli):
    run = tmp_path / "core"
    spec_core_rank(run, 0)
    spec_core_rank(run, 1)
    proc = run_cli(dynaprobe_cli, "compare", run, "--csv", tmp_path / "precision.csv")
    assert proc.returncode == 0
    for rank in (0, 1):
        path = tmp_path / f"precision_rank{rank}.csv"
        assert f"CSV report saved to: {path}" in proc.stdout.splitlines()
        lines = csv_lines(path)
        assert lines[0] == CSV_HEADER
        assert lines[1] == "LOSS,loss,0,PASS,N/A,N/A,N/A,compiled=0.333408,single_pass mode"
        assert 'layers.0,fwd_output,0,PASS,1.192093e-07,3.421843e-08,2.980232e-07,"(2, 16, 128)",' in lines
    assert not (tmp_path / "precision.csv").exists()


def test_a_failing_rank_fails_the_run(tmp_path, dynaprobe_cli):
    run = tmp_path / "core"
    spec_core_rank(run, 0)
    x = randn(3)
    write_dump(run / "rank1", [Rec("layers.0", "fwd_output", eager=x, compiled=x + 1)],
               provenance=single_pass(rank="1", scenario="core"))
    merged = tmp_path / "merged.csv"
    proc = run_cli(dynaprobe_cli, "compare", run, "--merged-csv", merged)
    assert proc.returncode == 1
    assert any(line.startswith("1,core,layers.0,fwd_output,0,FAIL,") for line in csv_lines(merged))


# ---------------------------------------------------------------------------------------------
# 5. Provenance


def test_different_provenance_is_reported_and_the_comparison_still_runs(tmp_path, dynaprobe_cli):
    x = randn(3)
    write_dump(tmp_path / "a", [Rec("layers.0", "fwd_output", eager=x)], sides=("eager",),
               provenance=two_pass(torch_version="2.12.0", backend="aot_eager"))
    write_dump(tmp_path / "b", [Rec("layers.0", "fwd_output", compiled=x)], sides=("compiled",),
               provenance=two_pass(torch_version="2.13.0", backend="inductor"))
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "Provenance differs between the eager and the compiled dump:" in lines
    assert "  torch_version: eager=2.12.0  compiled=2.13.0" in lines
    assert "  backend: eager=aot_eager  compiled=inductor" in lines
    assert report_row("pass", "layers.0", ok_detail("0.000e+00", "0.000e+00", "0.000e+00", "(3,)")) in lines


def test_same_provenance_is_not_reported(tmp_path, dynaprobe_cli):
    x = randn(3)
    write_dump(tmp_path / "a", [Rec("layers.0", "fwd_output", eager=x)], sides=("eager",), provenance=two_pass(backend="inductor"))
    write_dump(tmp_path / "b", [Rec("layers.0", "fwd_output", compiled=x)], sides=("compiled",), provenance=two_pass(backend="inductor"))
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 0 and "Provenance differs" not in proc.stdout


# ---------------------------------------------------------------------------------------------
# 6. ls, graphs, help and errors


def test_ls_lists_records_without_reading_tensor_data(tmp_path, dynaprobe_cli):
    path = write_dump(tmp_path / "dump", [Rec("layers.0.mlp", "fwd_output", **same(randn(2, 16, 128))),
                                          Rec("layers.0.mlp", "grad_input", compiled=torch.ones(4, 8).bfloat16())],
                      provenance=single_pass(backend="inductor"), modules=[("layers.0.mlp", {"role": "wrapped"})])
    with h5py.File(path, "r+") as f:  # ls must work from the index alone
        del f["tensors"]
    proc = run_cli(dynaprobe_cli, "ls", tmp_path / "dump")
    assert proc.returncode == 0, proc.stderr
    records = [line.split() for line in proc.stdout.splitlines() if line.startswith("  layers.0.mlp ")]
    assert ["layers.0.mlp", "0", "fwd_output", "0", "eager", "float32", "(2,", "16,", "128)"] == records[0][:9]
    assert ["layers.0.mlp", "0", "fwd_output", "0", "compiled", "float32", "(2,", "16,", "128)"] == records[1][:9]
    assert ["layers.0.mlp", "0", "grad_input", "0", "compiled", "bfloat16", "(4,", "8)"] == records[2][:8]
    assert "role=wrapped" in proc.stdout and "inductor" in proc.stdout


GRAPH_TEXT = "def forward(self, x):\n    return (x * 2,)\n"


def test_graphs_are_written_as_py_files_named_after_the_graph(tmp_path, dynaprobe_cli):
    names = ["__compiled_fn_1.Forward_Graph.1a2b3c4d", "__compiled_fn_2.Backward_Graph.5e6f7a8b"]
    write_dump(tmp_path / "dump", [Rec("m", "fwd_output", **same(randn(2)))],
               graphs=[(name, "forward", GRAPH_TEXT + "# " + name, {}) for name in names])
    out = tmp_path / "graphs"
    proc = run_cli(dynaprobe_cli, "graphs", tmp_path / "dump", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == [name + ".py" for name in sorted(names)]
    for name in names:
        assert (out / f"{name}.py").read_text() == GRAPH_TEXT + "# " + name


def test_hostile_graph_names_cannot_escape_the_output_folder(tmp_path, dynaprobe_cli):
    path = write_dump(tmp_path / "run" / "dump", [Rec("m", "fwd_output", **same(randn(2)))],
                      graphs=[(name, "forward", GRAPH_TEXT, {}) for name in ["x..y", "...", "..\\evil", "a b"]])
    with h5py.File(path, "r+") as f:  # names our writer refuses, in a crafted file (resealed)
        f["graphs"][".."] = np.bytes_(GRAPH_TEXT.encode())
        set_text_attribute(f["graphs"][".."], "kind", "forward")
        f["graphs"].attrs.create("checksum", group_checksum(f["graphs"], with_text=True), dtype="<u8")
    before = set(p for p in tmp_path.rglob("*"))
    out = tmp_path / "run" / "out" / "graphs"
    proc = run_cli(dynaprobe_cli, "graphs", tmp_path / "run" / "dump", "-o", out)
    assert proc.returncode == 0, proc.stderr
    created = set(tmp_path.rglob("*")) - before
    files = {p for p in created if p.is_file()}
    assert len(files) == 5  # one file per graph, none lost to a collision
    for p in files:
        assert p.parent == out and p.suffix == ".py" and not p.name.startswith(".")
        assert p.read_text() == GRAPH_TEXT
    assert "x..y.py" in os.listdir(out)


def test_graphs_reports_a_dump_without_graphs(tmp_path, dynaprobe_cli):
    write_dump(tmp_path / "dump", [Rec("m", "fwd_output", **same(randn(2)))])
    proc = run_cli(dynaprobe_cli, "graphs", tmp_path / "dump", "-o", tmp_path / "g")
    assert proc.returncode == 0 and "no graphs" in proc.stderr


@pytest.mark.parametrize("subcommand, options", [
    ([], ["compare", "ls", "graphs"]),
    (["compare"], ["--csv", "--merged-csv", "--json", "--atol", "--rtol", "--step", "--module", "--threads", "DUMP"]),
    (["ls"], ["DUMP"]),
    (["graphs"], ["DUMP", "--output"]),
])
def test_help_works_for_every_subcommand(dynaprobe_cli, subcommand, options):
    proc = run_cli(dynaprobe_cli, *subcommand, "--help")
    assert proc.returncode == 0, proc.stderr
    for option in options:
        assert option in proc.stdout


@pytest.mark.parametrize("args", [
    ["compare", "DUMP", "--bogus"],
    ["compare"],
    ["compare", "DUMP", "--atol", "abc"],
    ["compare", "DUMP", "--rtol", "-1"],
    ["graphs", "DUMP"],
    ["frobnicate"],
    [],
], ids=["unknown-option", "missing-dump", "atol-not-a-number", "negative-rtol", "graphs-without-output",
        "unknown-subcommand", "no-subcommand"])
def test_bad_command_lines_exit_with_2(tmp_path, dynaprobe_cli, args):
    write_dump(tmp_path / "dump", [Rec("m", "fwd_output", **same(randn(2)))])
    args = [str(tmp_path / "dump") if a == "DUMP" else a for a in args]
    proc = run_cli(dynaprobe_cli, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip()


@pytest.mark.parametrize("subcommand", [["compare"], ["ls"], ["graphs", "-o", "out"]])
def test_nonexistent_path_exits_with_3(tmp_path, dynaprobe_cli, subcommand):
    missing = tmp_path / "no_such_dump"
    proc = run_cli(dynaprobe_cli, subcommand[0], missing, *subcommand[1:], cwd=tmp_path)
    assert proc.returncode == 3
    assert str(missing) in proc.stderr


def broken_dumps(tmp_path):
    """name -> dump folder whose step file is not a valid dump."""
    dumps = {}
    bogus = tmp_path / "random" / "step_00000000.h5"
    bogus.parent.mkdir()
    bogus.write_bytes(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    dumps["random-bytes"] = bogus.parent

    path = write_dump(tmp_path / "truncated", [Rec("m", "fwd_output", **same(randn(64, 1024)))])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    dumps["truncated"] = tmp_path / "truncated"

    path = write_dump(tmp_path / "newer", [Rec("m", "fwd_output", **same(randn(3)))])
    with h5py.File(path, "r+") as f:
        f.attrs.create("dynaprobe_format_version", np.bytes_(b"3.0"))  # fixed-length, as 2.0 has it
    dumps["newer-format"] = tmp_path / "newer"
    return dumps


@pytest.mark.parametrize("kind", ["random-bytes", "truncated", "newer-format"])
@pytest.mark.parametrize("subcommand", [["compare"], ["ls"], ["graphs", "-o", "out"]])
def test_invalid_dumps_exit_with_3_naming_the_file(tmp_path, dynaprobe_cli, kind, subcommand):
    dump = broken_dumps(tmp_path)[kind]
    proc = run_cli(dynaprobe_cli, subcommand[0], dump, *subcommand[1:], cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert str(dump / "step_00000000.h5") in proc.stderr
    if kind == "newer-format":
        assert "3.0" in proc.stderr and "upgrade" in proc.stderr


def test_folder_without_step_files_exits_with_3(tmp_path, dynaprobe_cli):
    (tmp_path / "empty").mkdir()
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "empty")
    assert proc.returncode == 3 and str(tmp_path / "empty") in proc.stderr


def test_unwritable_report_path_exits_with_3(tmp_path, dynaprobe_cli):
    write_dump(tmp_path / "dump", [Rec("m", "fwd_output", **same(randn(2)))])
    (tmp_path / "a_file").write_text("")
    target = tmp_path / "a_file" / "report.csv"  # a folder that is a file
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump", "--csv", target)
    assert proc.returncode == 3 and str(target) in proc.stderr


# ---------------------------------------------------------------------------------------------
# 7. Progress bar


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path, dynaprobe_cli):
    x = randn(256, 1024)  # large enough to take a moment
    write_dump(tmp_path / "dump", [Rec(f"layers.{i}", "fwd_output", **same(x)) for i in range(4)], provenance=two_pass())
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "dump")
    assert proc.returncode == 0
    assert proc.stderr == ""
