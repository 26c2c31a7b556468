"""scripts/gpu_check.sh and scripts/gpu_prepare.sh stay runnable without a GPU or the network: the
check says at once, before building anything, what the machine lacks (issue 56). The real run is
`bash scripts/gpu_prepare.sh && bash scripts/gpu_check.sh --dry-run --out DIR` here and
`bash scripts/gpu_check.sh --out DIR` on the GPU machine."""

import os
import subprocess
import sys

from conftest import REPO

SCRIPTS = os.path.join(REPO, "scripts")


def run(script, *args, cwd=REPO):
    return subprocess.run(["bash", os.path.join(SCRIPTS, script), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_help_of_both_scripts():
    check = run("gpu_check.sh", "--help")
    assert check.returncode == 0, check.stderr
    assert "--dry-run" in check.stdout and "--out DIR" in check.stdout
    prepare = run("gpu_prepare.sh", "--help")
    assert prepare.returncode == 0, prepare.stderr
    assert ".gpu/prefix/" in prepare.stdout


def test_a_missing_prefix_fails_at_once_naming_it(tmp_path):
    missing = tmp_path / "no-such-prefix"
    proc = run("gpu_check.sh", "--dry-run", "--python", sys.executable, "--prefix", missing,
               "--out", tmp_path / "out")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "FAILED before building: missing:" in proc.stdout + proc.stderr
    assert f"the prepared prefix ({missing}/" in proc.stdout + proc.stderr
    assert "gpu_prepare.sh" in proc.stdout + proc.stderr
    assert "building into" not in proc.stdout
    # The log is in the out folder, and nothing else.
    assert os.listdir(tmp_path / "out") == ["gpu_check.log"]
    assert "the prepared prefix" in (tmp_path / "out" / "gpu_check.log").read_text()


def test_an_unknown_argument_and_a_missing_out_folder_are_refused(tmp_path):
    proc = run("gpu_check.sh", "--frobnicate")
    assert proc.returncode == 2 and "unknown argument: --frobnicate" in proc.stderr
    proc = run("gpu_check.sh", "--dry-run")
    assert proc.returncode == 2 and "--out DIR is required" in proc.stderr
