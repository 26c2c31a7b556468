"""Runs of many ranks and steps: the summary leads the stdout report, the run's consistency is
checked, parts of a run analysed apart (--ranks/--steps, a process pool, Dask's LocalCluster)
merge into the report of the whole, byte for byte, in every format."""

import json
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from analyze_dumps import Rec, loss_recs, run_cli, single_pass, write_dump

from dynaprobe import analyze_run

FORMATS = ["merged-csv", "json", "html", "junit", "markdown"]


def write_run(run: Path, ranks: int, steps: int, faults=(), **provenance):
    """rank<R>/step files of 4 modules; each (rank, step, module) in `faults` is off by 0.5."""
    rng = np.random.default_rng(0)
    for rank in range(ranks):
        for step in range(steps):
            recs = loss_recs(compiled=0.5)
            for module in range(4):
                x = rng.standard_normal(32).astype(np.float32)
                y = x + np.float32(0.5) if (rank, step, module) in faults else x.copy()
                recs += [Rec(f"layers.{module}", "fwd_input", compiled=x),
                         Rec(f"layers.{module}", "fwd_output", eager=x, compiled=y)]
            write_dump(run / f"rank{rank}", recs, step=step,
                       provenance=single_pass(rank=str(rank), world_size=str(ranks),
                                              **provenance),
                       modules=[(f"layers.{m}", {"role": "wrapped"}) for m in range(4)])
    return run


def reports(cli, tmp, name, *args):
    """Every format of `dynaprobe *args` (compare or merge) under tmp/name.*: (stdout, {format:
    bytes}) with the file names taken out of stdout."""
    paths = {f: tmp / f"{name}.{f}" for f in FORMATS}
    proc = run_cli(cli, *args, *[a for f in FORMATS for a in (f"--{f}", paths[f])])
    assert proc.returncode in (0, 1), proc.stderr
    stdout = proc.stdout
    for f in FORMATS:
        stdout = stdout.replace(str(paths[f]), f"<{f}>")
    return stdout, {f: paths[f].read_bytes() for f in FORMATS}


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """8 ranks of 6 steps; rank 5 step 4 differs in layers.2 (and so in layers.3: carried)."""
    return write_run(tmp_path_factory.mktemp("run") / "run", 8, 6,
                     faults={(5, 4, 2), (5, 4, 3), (6, 5, 1)})


def test_the_summary_leads_and_names_the_failing_rank_step_and_module(faulty_run, dynaprobe_cli):
    proc = run_cli(dynaprobe_cli, "compare", faulty_run)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0] == "Summary: 48 steps on 8 ranks, 46 ALL PASS, 2 FAILED (3 FAIL rows, 0 WARN rows)"
    assert lines[1] == "Failing modules, root cause first:"
    table = [line.split() for line in lines[3:6]]
    # Earliest step first; within a step the root cause first.
    assert [row[:3] for row in table] == [["5", "4", "layers.2"], ["5", "4", "layers.3"],
                                          ["6", "5", "layers.1"]]
    assert "<-" in lines[3] and "forward root cause" in lines[3]
    assert lines[6].startswith("Root cause first seen in rank 5 step 4: forward layers.2 fwd_output[0]")
    # Then the full reports of the failing steps only, each with its rank, step and folder.
    assert "Rank 5 step 4: " in proc.stdout and "Rank 6 step 5: " in proc.stdout
    assert proc.stdout.count("RESULT:") == 2
    assert "Rank 0 step 0" not in proc.stdout


def test_all_steps_prints_every_step_and_the_default_shows_the_first_failing_ones(
        tmp_path, dynaprobe_cli):
    run = write_run(tmp_path / "run", 1, 6, faults={(0, s, 0) for s in range(1, 6)})
    proc = run_cli(dynaprobe_cli, "compare", run)
    assert proc.stdout.startswith("Summary: 6 steps, 1 ALL PASS, 5 FAILED (5 FAIL rows, 0 WARN rows)\n")
    assert proc.stdout.count("RESULT:") == 3  # the first 3 failing steps
    assert "Step 1\n" in proc.stdout and "Step 3\n" in proc.stdout and "Step 4\n" not in proc.stdout
    assert "The reports of the first 3 of 5 failing steps follow" in proc.stdout
    proc = run_cli(dynaprobe_cli, "compare", run, "--all-steps")
    assert proc.stdout.count("RESULT:") == 6 and "Step 0\n" in proc.stdout


def test_parts_of_a_run_merge_into_the_report_of_the_whole(faulty_run, tmp_path, dynaprobe_cli):
    whole_stdout, whole = reports(dynaprobe_cli, tmp_path, "whole", "compare", faulty_run)
    # By ranks, and the last ranks by steps too: a rank's steps from two reports.
    parts = []
    for i, selection in enumerate([["--ranks", "0-3"], ["--ranks", "4-7", "--steps", "0-2"],
                                   ["--ranks", "4-7", "--steps", "3-5"]]):
        part = tmp_path / f"part{i}.json"
        proc = run_cli(dynaprobe_cli, "compare", faulty_run, *selection, "--json", part)
        assert proc.returncode in (0, 1), proc.stderr
        parts.append(part)
    assert json.loads(parts[1].read_text())["summary"]["steps"] == 12
    merged_stdout, merged = reports(dynaprobe_cli, tmp_path, "merged", "merge", *reversed(parts))
    assert merged_stdout == whole_stdout
    for f in FORMATS:
        assert merged[f] == whole[f], f
    # Python's executors give the same report.
    with ProcessPoolExecutor(2) as pool:
        report = analyze_run(faulty_run, executor=pool, ranks_per_shard=3)
    assert report.render("json").encode() == whole["json"]
    assert report.render("junit").encode() == whole["junit"]
    assert not report.all_pass and report.summary["root_cause_first_seen"] == {"rank": 5, "step": 4}
    # The stdout report, less the lines that name the files the CLI wrote.
    assert report.text == "".join(line for line in whole_stdout.splitlines(keepends=True)
                                  if not line.startswith("Full reports:")
                                  and " report saved to: " not in line)


def test_merge_refuses_overlapping_and_damaged_reports(faulty_run, tmp_path, dynaprobe_cli):
    part = tmp_path / "part.json"
    run_cli(dynaprobe_cli, "compare", faulty_run, "--ranks", "1", "--json", part)
    proc = run_cli(dynaprobe_cli, "merge", part, part)
    assert proc.returncode == 2 and "rank 1 step 0 is in both" in proc.stderr
    damaged = tmp_path / "damaged.json"
    damaged.write_text(part.read_text()[:-200])
    proc = run_cli(dynaprobe_cli, "merge", damaged)
    assert proc.returncode == 3 and f"{damaged}: not a dynaprobe JSON report" in proc.stderr
    other = tmp_path / "other.json"
    other.write_text('{"ranks": [{"rank": "zero"}]}')
    proc = run_cli(dynaprobe_cli, "merge", other)
    assert proc.returncode == 3 and '"rank" is not an integer' in proc.stderr


def test_selections_that_match_nothing_name_what_there_is(faulty_run, dynaprobe_cli):
    proc = run_cli(dynaprobe_cli, "compare", faulty_run, "--ranks", "9-12")
    assert proc.returncode == 2 and "--ranks 9-12 matches no rank" in proc.stderr
    assert "its ranks are 0-7" in proc.stderr
    proc = run_cli(dynaprobe_cli, "compare", faulty_run, "--steps", "40")
    assert proc.returncode == 2 and "its steps are 0-5" in proc.stderr
    proc = run_cli(dynaprobe_cli, "compare", faulty_run, "--ranks", "3-1")
    assert proc.returncode == 2 and "--ranks: expected N, N-M or a list of them" in proc.stderr


def test_the_summary_warns_about_an_inconsistent_run(tmp_path, dynaprobe_cli):
    run = write_run(tmp_path / "run", 8, 6, torch_version="2.13.0")
    shutil.rmtree(run / "rank3")
    shutil.copytree(run / "rank0", run / "rank3")  # a copied folder: rank 0's files
    shutil.rmtree(run / "rank6")                   # a missing rank
    (run / "rank2" / "step_00000005.h5").unlink()  # a step on some ranks only
    write_run(tmp_path / "other", 8, 6, torch_version="2.12.0")
    shutil.rmtree(run / "rank7")
    shutil.copytree(tmp_path / "other" / "rank7", run / "rank7")  # another torch
    proc = run_cli(dynaprobe_cli, "compare", run, "--json", tmp_path / "r.json",
                   "--markdown", tmp_path / "r.md")
    warnings = [
        "rank3/ holds the files of rank 0 (provenance rank=0): a copied or misplaced folder; its "
        "rows are reported as rank 3's",
        "torch_version differs between ranks: 2.13.0 on ranks 0-5, 2.12.0 on rank 7",
        "missing rank 6 of world_size 8: no rank folder, or no selected step in it",
        "step 5 only on 6 of 7 ranks: missing on rank 2",
    ]
    summary = proc.stdout.split("\n\n")[0]
    assert f"Run warnings ({len(warnings)}):" in summary
    for warning in warnings:
        assert f"  {warning}\n" in summary
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["warnings"] == warnings
    assert "### Run warnings" in (tmp_path / "r.md").read_text()


def test_a_rank_folder_from_another_run_is_named(tmp_path, dynaprobe_cli):
    import torch
    import torch.nn as nn

    from dynaprobe import PrecisionChecker

    for run in ("runA", "runB"):
        model = nn.Sequential(nn.Linear(4, 4))
        checker = PrecisionChecker(dump_dir=str(tmp_path / run / "rank0"))
        checker.wrap(model)
        checker.compare(lambda m: m(torch.ones(2, 4)).sum(), model)
    shutil.move(tmp_path / "runB" / "rank0", tmp_path / "runA" / "rank1")  # copied by hand
    proc = run_cli(dynaprobe_cli, "compare", tmp_path / "runA")
    assert "  run differs between ranks: runA on rank 0, runB on rank 1\n" in proc.stdout
    assert "  rank1/ holds the files of rank 0 (provenance rank=0)" in proc.stdout


@pytest.mark.slow
def test_a_real_eight_rank_gloo_run_with_one_fault(tmp_path, dynaprobe_cli):
    run = tmp_path / "run"
    script = Path(__file__).with_name("eight_ranks.py")
    proc = subprocess.run([sys.executable, script, run, "8"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = run_cli(dynaprobe_cli, "compare", run, "--junit", tmp_path / "junit.xml")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Summary: 64 steps on 8 ranks, 63 ALL PASS, 1 FAILED")
    assert lines[3].split()[:3] == ["5", "7", "0"] and "forward root cause" in lines[3]
    assert any(line.startswith("Root cause first seen in rank 5 step 7: forward 0 fwd_output[0]")
               for line in lines[:8])
    assert "Run warnings" not in result.stdout
    assert 'name="dynaprobe.rank5.step7" tests="' in (tmp_path / "junit.xml").read_text()


def test_dask_local_cluster_gives_the_process_pools_report(faulty_run):
    import distributed  # scripts/setup.sh installs it
    with ProcessPoolExecutor(2) as pool:
        pooled = analyze_run(faulty_run, executor=pool, ranks_per_shard=2)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        dasked = analyze_run(faulty_run, executor=client.get_executor(), ranks_per_shard=2)
    for f in ["text", "json", "junit", "markdown", "merged-csv"]:
        assert dasked.render(f) == pooled.render(f), f
    assert dasked.summary["failed_steps"] == 2
