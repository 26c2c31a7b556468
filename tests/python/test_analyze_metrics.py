"""Metrics of `dynaprobe compare` against torch and numpy computed here, independently of the
analyzer (precision-checker.zh.md: 精度指标), on chunked tensors, empty, 0-d, NaN and mixed dtypes."""

import math

import numpy as np
import pytest
import torch
from analyze_dumps import (
    ATOL,
    RTOL,
    Rec,
    as_float_tensor,
    compare_json,
    csv_lines,
    json_float,
    json_row,
    randn,
    single_pass,
    spec_bf16_fwd_output,
    spec_core_fwd_output,
    two_pass,
    write_dump,
)


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
    """Cosine similarity, RMSE and NaN/Inf counts in float64 numpy, on float32 values. Equal
    elements (equal infinities too) differ by 0 in the RMSE; the cosine is over the finite
    elements (docs/report-format.md)."""
    a = as_float_tensor(eager).numpy()
    b = as_float_tensor(compiled).numpy()
    finite = lambda x: np.where(np.isfinite(x), x, 0).astype(np.float64).ravel()  # noqa: E731
    a64, b64 = finite(a), finite(b)
    with np.errstate(all="ignore"):
        # the difference is taken in float32
        d = np.where(a == b, 0, np.abs(a - b)).astype(np.float64).ravel()
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
    # The spec's allclose as it is: the bf16 cases are about its metrics, not the dtype floor,
    # nor the fp32 screen (tolerance_edge is 1e-3 off everywhere: within the tolerances, beyond
    # fp32 noise).
    proc, report = compare_json(dynaprobe_cli, tmp, *dumps, "--csv", tmp / "report.csv",
                                "--fixed-tolerances", "--verdict", "tolerances")
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


def test_spec_example_data_is_what_the_docstrings_say():
    e, c = spec_core_fwd_output()
    ref = torch_reference(e, c)
    assert "%.6e %.6e %.6e" % (ref["max_abs"], ref["mean_abs"], ref["max_rel"]) == "1.192093e-07 3.421843e-08 2.980232e-07"
    e, c = spec_bf16_fwd_output()
    ref = torch_reference(e, c)
    assert "%.6e %.6e %.6e" % (ref["max_abs"], ref["mean_abs"], ref["max_rel"]) == "3.051758e-05 7.510185e-06 6.556511e-05"
