"""The report of `dynaprobe compare`: the stdout layout and CSV lines of the spec
(precision-checker.zh.md: 报告说明, CSV 报告格式), how the two sides are aligned, steps and tolerances."""

import numpy as np
from analyze_dumps import (
    CSV_HEADER,
    RULE,
    SECTION_RULE,
    ZERO_DETAIL,
    Rec,
    compare_json,
    compare_rows,
    csv_lines,
    json_rows,
    loss_recs,
    ok_detail,
    randn,
    report_row,
    run_cli,
    same,
    single_pass,
    spec_two_pass_dump,
    two_pass,
    write_dump,
)

from dynaprobe import _C


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


def test_tensor_missing_on_the_compiled_side_warns(tmp_path, dynaprobe_cli):
    x = randn(2, 3)
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", eager=x),
                                   Rec("layers.0", "grad_input", eager=x),
                                   Rec("layers.1", "fwd_output", **same(x))], provenance=two_pass())
    proc, lines, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump")
    assert proc.returncode == 1
    assert report_row("WARN", "layers.0", "MISSING_fwd_in_compiled") in lines
    assert report_row("WARN", "layers.0.grad_input", "MISSING_bwd_in_compiled") in lines
    # The note, then why, in words (the text report prints it under the row).
    assert ('layers.0,fwd_output,0,WARN,,,,"(2, 3)","MISSING_fwd_in_compiled: the compiled run '
            'recorded no such tensor: it called the module fewer times, or the module took or '
            'returned fewer tensors there"') in csv
    assert ('layers.0,grad_input,0,WARN,,,,"(2, 3)",MISSING_bwd_in_compiled: no gradient reached '
            'it in the compiled backward: the compiled run took another path') in csv
    assert "  RESULT: FAILED  (0 FAIL, 2 WARN; atol=1e-4 rtol=1e-3)" in lines


def test_tensor_missing_on_the_eager_side_warns(tmp_path, dynaprobe_cli):
    write_dump(tmp_path / "dump", [Rec("layers.0", "fwd_output", compiled=randn(5))], provenance=single_pass())
    proc, lines, csv = compare_rows(dynaprobe_cli, tmp_path, tmp_path / "dump")
    assert proc.returncode == 1
    assert report_row("WARN", "layers.0", "MISSING_fwd_in_eager") in lines
    assert any(line.startswith('layers.0,fwd_output,0,WARN,,,,"(5,)","MISSING_fwd_in_eager: the '
                               'eager run recorded no such tensor') for line in csv), csv


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
    x[0] = 0.5  # + 1 exactly, whatever the random draws before this test (the CSV has 7 digits)
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
                              "noise_pass": 0, "no_reference_calls": 0, "referenced": 0,
                              "screened": 0, "low_precision_unreferenced": 0, "loss_fail": False,
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
    """layers.0 off by 5e-4 (fails at the default atol=1e-4 on values near 0.01). 5% of its
    magnitude is beyond fp32 noise, which FAILs a row the tolerances pass: these dumps ask for
    the tolerances' verdict alone (verdict=tolerances), as the spec has it."""
    provenance = {"verdict": "tolerances", **provenance}
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
