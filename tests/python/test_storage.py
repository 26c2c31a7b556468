"""What a run keeps: dump="full" / "failing" / "stats" (every pair judged in memory, its metrics
stored), which steps are checked, the disk budget, and the report they give — the same in the
process and from `dynaprobe compare` (docs/guide/storage-and-scale.md)."""

import os
import re
import subprocess
import sys

import h5py
import pytest
import torch
import torch.nn as nn
from analyze_dumps import run_cli
from models import MLP, perturbed_gelu_backend

from dynaprobe import _C, PrecisionChecker


class Chain(nn.Module):
    """norm -> mlp (GELU, perturbed by the backend) -> proj: only mlp's rows fail."""

    def __init__(self, width=16):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = MLP(width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return self.proj(self.mlp(self.norm(x)))


def _step_files(folder) -> list:
    """The step files of a dump folder (its writer's lock file apart)."""
    return sorted(f for f in os.listdir(folder) if f.startswith("step_"))


def checked_step(tmp_path, dump, width=16, batch=8, single_pass=True, dtype=torch.float32,
                 **kwargs):
    """One checked training step of Chain under `dump`; returns (result, step file)."""
    torch.manual_seed(0)
    model = Chain(width).to(dtype)
    x = torch.randn(batch, width, dtype=dtype)
    checker = PrecisionChecker(backend=perturbed_gelu_backend, dump=dump, single_pass=single_pass,
                               dump_dir=str(tmp_path / dump), **kwargs)
    checker.wrap_all_children(model, depth=0)
    if single_pass:
        checker.install(model)
        loss = model(x).square().sum()
        loss.backward()
        result = checker.collect(loss)
        checker.uninstall()
    else:
        result = checker.compare(lambda m: m(x).square().sum(), model)
    return result, result.dump_file


def rows(result):
    return [(r.module, r.check_type, r.tensor_index, r.status, r.max_abs, r.max_rel, r.mean_abs)
            for r in result]


def stored_tensors(step_file):
    info = _C.read_step(step_file)
    return {(r["module"], r["kind"], r["side"]) for r in info["records"] if r["stored"]}


@pytest.mark.parametrize("single_pass", [True, False], ids=["single_pass", "two_pass"])
def test_every_dump_mode_gives_the_full_report(tmp_path, single_pass):
    results = {dump: checked_step(tmp_path, dump, single_pass=single_pass)[0]
               for dump in ("full", "failing", "stats")}
    assert not results["full"].all_pass
    assert {r.module for r in results["full"].failures} == {"mlp", "proj"} - (
        {"proj"} if single_pass else set())
    for dump in ("failing", "stats"):
        assert rows(results[dump]) == rows(results["full"]), dump
        text = results[dump].text().replace(f"/{dump}", "/full")
        if dump == "stats" and single_pass:  # keeps no replay data: the next line says so
            keep = "keep its call for replay (single-pass with dump=\"full\" or \"failing\""
            assert keep in results[dump].root_cause["next"]
            assert keep not in results["full"].root_cause["next"]
            text = text.replace(results[dump].root_cause["next"].replace(f"/{dump}", "/full"),
                                results["full"].root_cause["next"])
        assert text == results["full"].text()


def test_the_cli_prints_the_in_process_report_byte_for_byte(tmp_path, dynaprobe_cli, capsys):
    for dump in ("full", "failing", "stats"):
        result, step_file = checked_step(tmp_path, dump)
        proc = run_cli(dynaprobe_cli, "compare", os.path.dirname(step_file))
        assert proc.returncode == 1, proc.stderr
        assert proc.stdout == result.text(), dump


def test_what_each_mode_stores(tmp_path):
    _, full = checked_step(tmp_path, "full")
    _, failing = checked_step(tmp_path, "failing")
    _, stats = checked_step(tmp_path, "stats")
    every = stored_tensors(full)
    assert {m for m, _, _ in every} == {"norm", "mlp", "proj", "LOSS"}
    # failing: the failing rows' pairs (mlp's outputs and gradients) and the loss; no passing
    # pair (norm, proj) has a tensor.
    kept = stored_tensors(failing)
    assert {m for m, _, _ in kept} == {"mlp", "LOSS"}
    assert ("mlp", "fwd_output", "eager") in kept and ("mlp", "fwd_output", "compiled") in kept
    assert stored_tensors(stats) == {("LOSS", "loss", "compiled")}
    # Every pair's metrics are in the dump, whatever the mode; h5py sees no tensor of a pair
    # stats did not store.
    for step_file in (full, failing, stats):
        assert len(_C.read_step(step_file)["metrics"]) == len(_C.read_step(full)["metrics"]) > 10
    with h5py.File(stats, "r") as f:
        assert "norm" not in f["tensors"] and "metrics" in f


def test_stats_store_at_most_a_percent_of_full(tmp_path):
    sizes = {dump: os.path.getsize(checked_step(tmp_path, dump, width=512, batch=512)[1])
             for dump in ("full", "stats")}
    assert sizes["stats"] <= 0.01 * sizes["full"], sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_metrics_judged_in_memory_are_the_tensors_own(tmp_path, dtype):
    result, step_file = checked_step(tmp_path, "full", width=64, batch=4096, dtype=dtype)
    dump = os.path.dirname(step_file)
    stored = _C.compare(dump, dump)
    recomputed = _C.compare(dump, dump, recompute=True)
    as_rows = lambda c: [(r["module"], r["check_type"], r["tensor_index"], r["status"], r["metrics"],
                          r["reference"]) for r in c.steps[0].rows if r["metrics"]]
    assert as_rows(stored) == as_rows(recomputed) and len(as_rows(stored)) > 10
    # Each side against the reference (bf16: every call's float32 one; float32: the failing
    # calls' float64 one): the noise rule's metrics, alike in memory and from the tensors.
    assert any(row[-1] for row in as_rows(stored))


def test_other_tolerances_need_the_tensors_the_cli_says_which(tmp_path, dynaprobe_cli):
    _, step_file = checked_step(tmp_path, "stats")
    dump = os.path.dirname(step_file)
    # mlp's failing rows cannot be judged again with other tolerances, wider or narrower.
    wider = run_cli(dynaprobe_cli, "compare", dump, "--atol", "10", "--rtol", "10")
    assert wider.returncode == 2
    assert "did not store their tensors" in wider.stderr
    narrower = run_cli(dynaprobe_cli, "compare", dump, "--atol", "1e-9")
    assert narrower.returncode == 2
    assert "did not store their tensors" in narrower.stderr and "dump=\"full\"" in narrower.stderr
    # Tolerances spelled as the report spells them (RESULT: ... atol=1e-4 rtol=1e-3).
    assert "judged at capture with atol=1e-4 rtol=1e-3, asked for atol=1e-9 " in narrower.stderr
    # failing kept the failing rows' tensors: they are judged again; the passing ones keep their
    # pass under wider tolerances. (mlp's fp64 reference, which float32 calls that fail get by
    # default, would still call it a divergence: the tolerances alone decide here.)
    _, step_file = checked_step(tmp_path, "failing")
    proc = run_cli(dynaprobe_cli, "compare", os.path.dirname(step_file), "--atol", "10",
                   "--rtol", "10", "--verdict", "tolerances")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: ALL PASS" in proc.stdout


def test_check_every_and_check_steps_choose_the_steps(tmp_path):
    def run(**schedule):
        torch.manual_seed(0)
        model = Chain()
        checker = PrecisionChecker(dump_dir=str(tmp_path / str(schedule)), **schedule)
        checker.wrap_all_children(model, depth=0)
        checker.install(model)
        results = []
        for _ in range(5):
            loss = model(torch.randn(4, 16)).sum()
            loss.backward()
            results.append(checker.collect(loss))
        checker.uninstall()
        files = sorted(f for f in os.listdir(checker.dump_dir) if f.startswith("step_"))
        return [r is not None for r in results], files

    checked, files = run(check_every=2)
    assert checked == [True, False, True, False, True]
    assert files == ["step_00000000.h5", "step_00000002.h5", "step_00000004.h5"]
    checked, files = run(check_steps=[1, 3])
    assert checked == [False, True, False, True, False]
    assert files == ["step_00000001.h5", "step_00000003.h5"]


def test_an_unchecked_step_runs_the_compiled_modules_alone(tmp_path):
    calls = []
    model = Chain()
    checker = PrecisionChecker(check_steps=[1], dump_dir=str(tmp_path / "d"))
    checker.wrap(model.mlp)
    checker.install(model)
    model.mlp.register_forward_hook(lambda *_: calls.append(1))
    loss = model(torch.randn(2, 16)).sum()
    loss.backward()
    assert checker.collect(loss) is None and calls == [1]  # no eager re-run
    checker.report(None)  # nothing to print, no error
    loss = model(torch.randn(2, 16)).sum()
    loss.backward()
    assert checker.collect(loss).all_pass
    checker.uninstall()


def test_a_run_reports_steps_before_their_files_are_committed_and_the_cli_agrees(
        tmp_path, dynaprobe_cli):
    """In a run, collect() reports a step once it is judged, from memory, and its file is
    committed while training goes on: every way to the file waits for it, and the CLI prints
    from the file the report collect() returned."""
    torch.manual_seed(0)
    model = Chain()
    checker = PrecisionChecker(backend=perturbed_gelu_backend, dump_dir=str(tmp_path / "run"))
    checker.wrap_all_children(model, depth=0)
    checker.install(model)
    results = []
    for _ in range(3):
        loss = model(torch.randn(8, 16)).square().sum()
        loss.backward()
        results.append(checker.collect(loss))
    last = results[-1]
    assert last.dump_file == str(tmp_path / "run" / "step_00000002.h5")
    assert os.path.exists(last.dump_file)  # dump_file waited for the commit
    checker.uninstall()
    assert _step_files(tmp_path / "run") == [f"step_0000000{i}.h5" for i in range(3)]
    for result in results:
        assert not result.all_pass
        proc = run_cli(dynaprobe_cli, "compare", tmp_path / "run", "--step", result.step)
        assert proc.returncode == 1, proc.stderr
        assert proc.stdout == result.text()


EXIT_AFTER_COLLECT = """
import sys
sys.path.insert(0, {tests!r})
import torch
from dynaprobe import PrecisionChecker
from test_storage import Chain

model = Chain(width=256)
checker = PrecisionChecker(dump_dir=sys.argv[1])
checker.wrap_all_children(model, depth=0)
checker.install(model)
for _ in range(3):
    loss = model(torch.randn(64, 256)).square().sum()
    loss.backward()
    checker.collect(loss)
raise SystemExit(3)  # right after the last collect(), neither uninstall() nor waiting
"""


def test_an_exit_right_after_collect_still_commits_the_step(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(EXIT_AFTER_COLLECT.format(tests=os.path.dirname(__file__)))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "dump")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert _step_files(tmp_path / "dump") == [f"step_0000000{i}.h5" for i in range(3)]
    with h5py.File(tmp_path / "dump" / "step_00000002.h5") as f:
        assert "index" in f


def test_the_disk_budget_keeps_the_newest_steps(tmp_path, capsys):
    def train(budget, steps=5):
        model = Chain()
        checker = PrecisionChecker(dump_dir=str(tmp_path / str(budget)), disk_budget_bytes=budget)
        checker.wrap_all_children(model, depth=0)
        checker.install(model)
        for _ in range(steps):
            loss = model(torch.randn(4, 16)).sum()
            loss.backward()
            checker.collect(loss)
        checker.uninstall()
        return _step_files(checker.dump_dir), checker

    files, checker = train(10 ** 9)
    # Steps after the first hold no graphs (compiled once): they all have one size.
    step_size = os.path.getsize(os.path.join(checker.dump_dir, files[-1]))
    first_size = os.path.getsize(os.path.join(checker.dump_dir, files[0]))
    # Sizes in the CLI's binary units (dynaprobe ls, runs), from the one C++ formatter.
    said = f"dynaprobe: step 0 wrote {_C.format_bytes(first_size)} to "
    assert re.search(r"\d (B|KiB|MiB) to $", said) and said in capsys.readouterr().err
    files, _ = train(int(2.5 * step_size))
    assert files == ["step_00000003.h5", "step_00000004.h5"]
    with pytest.warns(UserWarning, match="larger than the disk budget"):
        files, _ = train(step_size // 2)
    assert files == ["step_00000004.h5"]  # never the step just written


def test_the_disk_budget_removes_only_committed_step_files(tmp_path):
    """Step files are told by the name the writer gives them (the extension's
    step_of_file_name): a step in progress, a file named by hand and other files stay."""
    from dynaprobe._mechanics import storage as _storage

    folder = tmp_path / "dump"
    folder.mkdir()
    names = ["step_00000000.h5", "step_00000001.h5", "step_00000002.h5", "step_00000003.h5.partial",
             "step_x.h5", "step_-1.h5", "notes.h5"]
    for name in names:
        (folder / name).write_bytes(bytes(1000))
    assert [step for step, _, _ in _storage.committed_steps(str(folder))] == [0, 1, 2]
    removed = _storage.enforce_budget(str(folder), 1500, keep=str(folder / "step_00000002.h5"))
    assert [os.path.basename(path) for path in removed] == ["step_00000000.h5", "step_00000001.h5"]
    assert sorted(os.listdir(folder)) == sorted(names[2:])


def test_two_pass_over_the_memory_budget_stores_what_it_cannot_hold(tmp_path):
    # Two-pass holds the whole eager side until the compiled side comes: with a budget far below
    # it, the oldest records are stored whole, and the report is still the full one.
    full, _ = checked_step(tmp_path, "full", single_pass=False, width=64, batch=64)
    stats, step_file = checked_step(tmp_path, "stats", single_pass=False, width=64, batch=64,
                                    memory_budget_bytes=64 << 10)
    assert rows(stats) == rows(full)
    assert len(stored_tensors(step_file)) > 1  # spilled pairs


@pytest.mark.parametrize("kwargs, message", [
    (dict(dump="some"), "dump must be one of 'full', 'failing', 'stats'"),
    (dict(check_every=0), "check_every must be a positive integer"),
    (dict(check_steps=[-1]), "check_steps must hold step indices >= 0"),
    (dict(disk_budget_bytes=0), "disk_budget_bytes must be a positive integer"),
])
def test_storage_arguments_are_checked(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        PrecisionChecker(**kwargs)


def test_a_one_sided_capture_keeps_full_tensors(tmp_path):
    model = Chain()
    checker = PrecisionChecker(dump="stats", dump_dir=str(tmp_path / "eager"))
    checker.wrap_all_children(model, depth=0)
    step_file = checker.capture(lambda m: m(torch.randn(2, 16)).sum(), model, side="eager")
    info = _C.read_step(step_file)
    assert all(r["stored"] for r in info["records"]) and info["metrics"] == []


def _rewrite_metrics(step_file, change):
    """Rewrites /metrics as another writer version would: `change` maps the structured array read
    by h5py to the new one; the checksum (XXH3, format 2.0) covers the new bytes as stored."""
    import numpy as np
    from dump_checksum import xxh3

    with h5py.File(step_file, "r+") as f:
        old = f["metrics"][()]
        new = change(old, np)
        del f["metrics"]
        f.create_dataset("metrics", data=new)
        f["metrics"].attrs.create("checksum", xxh3(new.tobytes()), dtype="<u8")


def test_metrics_of_a_newer_or_older_writer_are_read_by_column(tmp_path, dynaprobe_cli):
    # A newer writer adds a metric, an older one lacks one: the table is checked as stored and
    # read by column name, so the report (which shows neither) is unchanged.
    result, step_file = checked_step(tmp_path, "stats")
    dump = os.path.dirname(step_file)

    def add_column(old, np):
        new = np.zeros(old.shape, dtype=old.dtype.descr + [("future_metric", "<f8")])
        for name in old.dtype.names:
            new[name] = old[name]
        new["future_metric"] = 42.0
        return new

    _rewrite_metrics(step_file, add_column)
    proc = run_cli(dynaprobe_cli, "compare", dump)
    assert proc.returncode == 1 and proc.stdout == result.text(), proc.stderr

    def drop_cosine(old, np):
        kept = [name for name in old.dtype.names if name != "cosine"]
        return np.array([tuple(row[name] for name in kept) for row in old],
                        dtype=[(name, old.dtype[name]) for name in kept])

    _rewrite_metrics(step_file, drop_cosine)
    proc = run_cli(dynaprobe_cli, "compare", dump)
    assert proc.returncode == 1 and proc.stdout == result.text(), proc.stderr

    with h5py.File(step_file, "r+") as f:  # a flipped byte in the table is damage
        table = f["metrics"][()]
        table["max_abs"][0] += 1.0
        f["metrics"][...] = table
    proc = run_cli(dynaprobe_cli, "compare", dump)
    assert proc.returncode == 3 and "/metrics: damaged" in proc.stderr
