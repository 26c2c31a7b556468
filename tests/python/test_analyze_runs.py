"""Runs of several ranks compared by `dynaprobe compare` (precision-checker.zh.md: 多卡 CSV 报告格式)
and the provenance lines of two captures."""

import numpy as np
from analyze_dumps import (
    CSV_HEADER,
    MERGED_CSV_HEADER,
    SPEC_SHAPE,
    Rec,
    csv_lines,
    loss_recs,
    ok_detail,
    randn,
    report_row,
    run_cli,
    same,
    single_pass,
    spec_bf16_fwd_output,
    spec_core_fwd_output,
    two_pass,
    write_dump,
)


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
