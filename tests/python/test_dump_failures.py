"""The checker never stops the training: a dump that cannot be written costs the dump, not the
run (PrecisionChecker(strict_io=False), the default). Every case trains to the end as a script
would, in a process of its own, and checks what the user sees: results judged in memory and
marked not stored, one message on stderr, and the steps written before intact and readable by
the CLI. Cases: a disk that fills up (a real 8 MiB tmpfs), two processes on one dump_dir, the
folder removed or made read-only during the run, a step larger than the memory budget, a tensor
that cannot be copied, and a writer that fails mid-step (a file-size limit); strict_io=True
raises as it always did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

# One training script for every case: a small MLP (about 3 MB of dump per step), its two Linear
# layers wrapped, STEPS steps with an optimizer; CASE says what happens to the dump meanwhile.
# It prints one JSON line: per step whether collect() returned a result and whether it was
# stored, and the losses.
SCRIPT = textwrap.dedent("""
    import json, os, resource, shutil, signal, subprocess, sys, time
    import torch
    import torch.nn as nn
    from dynaprobe import PrecisionChecker

    dump_dir, case, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # aot_eager: what is checked here is the dump, not the compiler (inductor's C++ builds would
    # take most of each case's time)
    options = {"backend": "aot_eager", **(json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})}
    torch.manual_seed(0)

    class WithMeta(nn.Module):  # returns a tensor without data besides its real output
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(1024, 256)

        def forward(self, x):
            return self.lin(x), torch.empty(3, device="meta")

    first = nn.Linear(256, 1024)
    last = WithMeta() if case == "meta" else nn.Linear(1024, 256)
    model = nn.Sequential(first, nn.ReLU(), last)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    checker = PrecisionChecker(dump_dir=dump_dir, **options)
    checker.wrap_by_policy(model, (nn.Linear, WithMeta))
    checker.install(model)
    if case == "file_size_limit":  # every write past 1 MB fails (EFBIG) in the writer thread
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    x = torch.randn(64, 256)
    out = {"results": [], "stored": [], "losses": [], "rows_warn": []}
    for step in range(steps):
        if case == "remove_folder" and step == 2:
            shutil.rmtree(dump_dir)
        if case == "read_only" and step == 2:  # a read-only bind mount over the folder
            subprocess.run(["mount", "--bind", dump_dir, dump_dir], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", dump_dir], check=True)
        if case == "slow":
            time.sleep(0.3)
        if case == "hold" and step == 1:  # keeps the folder until the test creates "release"
            release = os.path.join(os.path.dirname(dump_dir), "release")
            deadline = time.time() + 300
            while not os.path.exists(release) and time.time() < deadline:
                time.sleep(0.05)
        y = model(x)
        loss = (y[0] if isinstance(y, tuple) else y).square().mean()
        loss.backward()
        result = checker.collect(loss)
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
        out["results"].append(result is not None)
        out["stored"].append(result is not None and result.stored)
        if result is not None:
            out["rows_warn"].append([[r.module, r.note, r.reason] for r in result.rows
                                     if r.status == "WARN"])
        if step == 0:
            print("STEP0", flush=True, file=sys.stderr)
    checker.uninstall()
    if result is not None and not result.stored:
        out["last_text"] = result.text()
    print(json.dumps(out))
""")


def _run(tmp_path, dump_dir, case, steps=6, options=None, wait=True):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = [sys.executable, str(script), str(dump_dir), case, str(steps),
            json.dumps(options or {})]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=tmp_path)
    return _finish(process) if wait else process


def _finish(process, timeout=600):
    stdout, stderr = process.communicate(timeout=timeout)
    out = json.loads(stdout.strip().splitlines()[-1]) if process.returncode == 0 else None
    return process.returncode, out, stderr


def _unchecked_losses(steps):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs, as a filesystem that fills up (needs root, as CI and this project's
    machines have; elsewhere the tests that need it are skipped, saying why)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def _readable(dynaprobe_cli, dump_dir):
    """The committed steps as the CLI reads them: `ls` and `compare` exit with a verdict (0 or
    1), not with an error about the dump (2, 3); every step's report (--all-steps)."""
    listed = subprocess.run([dynaprobe_cli, "ls", str(dump_dir)], capture_output=True, text=True)
    compared = subprocess.run([dynaprobe_cli, "compare", str(dump_dir), "--all-steps"],
                              capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert compared.returncode in (0, 1), compared.stderr
    return compared.stdout


def _step_files(dump_dir):
    return sorted(p for p in os.listdir(dump_dir) if p.startswith("step_"))


def test_a_full_disk_never_stops_training(tmp_path, small_disk, dynaprobe_cli):
    steps = 20
    code, out, stderr = _run(tmp_path, small_disk / "dump", "full_disk", steps)
    assert code == 0, stderr
    assert out["results"] == [True] * steps  # every step checked, judged in memory
    assert out["losses"] == pytest.approx(_unchecked_losses(steps), rel=0, abs=0)
    stored = out["stored"]
    assert stored[0] and not all(stored), stored
    first_lost = stored.index(False)
    assert not any(stored[first_lost:]), stored  # the disk never has room again
    assert stderr.count("was not stored in") == 1, stderr  # said once, with what to do
    assert "No space left on device" in stderr and "strict_io=True" in stderr
    assert "NOT STORED" in out["last_text"]
    # What was committed before the disk filled stays whole; no partial file is left.
    files = _step_files(small_disk / "dump")
    assert files == [f"step_{i:08d}.h5" for i in range(first_lost)], files
    assert "RESULT: ALL PASS" in _readable(dynaprobe_cli, small_disk / "dump")


def test_strict_io_raises_as_before(tmp_path, small_disk):
    code, out, stderr = _run(tmp_path, small_disk / "dump", "full_disk", 20,
                             {"strict_io": True})
    assert code != 0 and out is None
    assert "DumpIOError" in stderr and "No space left on device" in stderr


def test_writing_resumes_when_the_disk_has_room_again(tmp_path, small_disk):
    """The checker tries every checked step: once space is freed, steps are stored again."""
    process = _run(tmp_path, small_disk / "dump", "slow", 16, {"disk_budget_bytes": 4 << 20},
                   wait=False)
    # Fill the disk while it runs, then free it.
    filler = small_disk / "filler"
    while not (small_disk / "dump" / "step_00000000.h5").exists():
        time.sleep(0.05)
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * (8 << 20))
        except OSError:
            pass
    time.sleep(2.0)
    filler.unlink()
    code, out, stderr = _finish(process)
    assert code == 0, stderr
    stored = out["stored"]
    assert stored[0] and False in stored and stored[-1], stored
    assert "writing works again" in stderr


def test_two_processes_on_one_dump_dir_both_train_and_the_first_loses_nothing(
        tmp_path, dynaprobe_cli):
    dump_dir = tmp_path / "shared"
    first = _run(tmp_path, dump_dir, "hold", 10, wait=False)
    while not (dump_dir / "step_00000000.h5").exists():  # the first holds the folder
        assert first.poll() is None, first.communicate()
        time.sleep(0.05)
    second_code, second, second_err = _run(tmp_path, dump_dir, "plain", 4)
    (tmp_path / "release").touch()  # the first trains on only once the second is done
    first_code, first_out, first_err = _finish(first)
    assert first_code == 0 and second_code == 0, first_err + second_err
    assert first_out["stored"] == [True] * 10
    assert second["results"] == [True] * 4 and second["stored"] == [False] * 4
    # The second names the folder and who holds it, and wrote, renamed or removed nothing.
    assert f"{dump_dir} is being written by another process" in second_err
    assert f"pid {first.pid}" in second_err
    assert _step_files(dump_dir) == [f"step_{i:08d}.h5" for i in range(10)]
    assert "RESULT: ALL PASS" in _readable(dynaprobe_cli, dump_dir)


def test_a_second_run_into_a_finished_runs_folder_keeps_training(tmp_path):
    """The first run is over (its lock is free) and its steps are committed: the second run's
    steps cannot be written there, and it trains to the end all the same."""
    dump_dir = tmp_path / "shared"
    first_code, first, first_err = _run(tmp_path, dump_dir, "plain", 3)
    assert first_code == 0 and first["stored"] == [True] * 3, first_err
    second_code, second, second_err = _run(tmp_path, dump_dir, "plain", 3)
    assert second_code == 0, second_err
    assert second["results"] == [True] * 3 and second["stored"] == [False] * 3
    assert "already exists" in second_err and "never overwrites a committed step" in second_err
    assert _step_files(dump_dir) == [f"step_{i:08d}.h5" for i in range(3)]


def test_the_folder_removed_during_the_run(tmp_path):
    code, out, stderr = _run(tmp_path, tmp_path / "dump", "remove_folder")
    assert code == 0, stderr
    assert out["results"] == [True] * 6
    assert out["stored"] == [True, True, False, False, False, False]
    assert stderr.count("was not stored in") == 1
    assert not (tmp_path / "dump").exists()  # not made again behind the user's back


def test_the_folder_made_read_only_during_the_run(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root (root ignores file permissions)")
    dump_dir = tmp_path / "dump"
    try:
        code, out, stderr = _run(tmp_path, dump_dir, "read_only")
    finally:
        subprocess.run(["umount", "-l", str(dump_dir)], capture_output=True)
    if code != 0 and "mount" in stderr and "permission denied" in stderr.lower():
        pytest.skip(f"cannot bind-mount here: {stderr.strip().splitlines()[-1]}")
    assert code == 0, stderr
    assert out["stored"] == [True, True, False, False, False, False]
    assert "Read-only file system" in stderr
    assert _step_files(dump_dir) == ["step_00000000.h5", "step_00000001.h5"]


def test_a_step_larger_than_the_memory_budget(tmp_path, dynaprobe_cli):
    """A 64 KiB budget for ~3 MB steps: the training thread waits for the writer, nothing is
    dropped, every step is stored."""
    code, out, stderr = _run(tmp_path, tmp_path / "dump", "budget", 3,
                             {"memory_budget_bytes": 64 << 10})
    assert code == 0, stderr
    assert out["stored"] == [True] * 3
    assert "RESULT: ALL PASS" in _readable(dynaprobe_cli, tmp_path / "dump")


def test_a_tensor_that_cannot_be_copied_is_a_hook_error_row(tmp_path):
    code, out, stderr = _run(tmp_path, tmp_path / "dump", "meta", 3)
    assert code == 0, stderr
    assert out["stored"] == [True] * 3
    for warned in out["rows_warn"]:
        assert any(module == "2" and note == "HOOK_ERROR" and "meta" in reason
                   for module, note, reason in warned), warned


def test_a_writer_that_fails_mid_step(tmp_path):
    """Every write past 1 MB fails in the background writer (a file-size limit: EFBIG)."""
    code, out, stderr = _run(tmp_path, tmp_path / "dump", "file_size_limit", 4)
    assert code == 0, stderr
    assert out["results"] == [True] * 4 and out["stored"] == [False] * 4
    assert "File too large" in stderr
    assert _step_files(tmp_path / "dump") == []  # each lost step's partial file removed
