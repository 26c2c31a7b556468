"""`dynaprobe ls`, `graphs`, help, exit codes and errors naming the file, and the progress bar."""

import os

import h5py
import numpy as np
import pytest
import torch
from analyze_dumps import Rec, randn, run_cli, same, single_pass, two_pass, write_dump
from dump_checksum import group_checksum, set_text_attribute


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
