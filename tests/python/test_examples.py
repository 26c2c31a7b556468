"""Every example in examples/ runs as a user runs it and does what its docstring says.

Python examples run with this Python (the project's .venv) in a fresh working folder, as
`python examples/X.py [OUT_DIR]`; the C++ examples run from the CMake build folder (built by
scripts/setup.sh). A missing build is a failure, never a skip: the examples are part of the product.
"""

import csv
import glob
import io
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

import dynaprobe

EXAMPLES = os.path.join(REPO, "examples")
CSV_HEADER = "module_name,check_type,tensor_index,status,max_abs_diff,mean_abs_diff,max_rel_diff,shape,note"

# Examples whose run lives in another test, and why; every other example must have a test here.
TESTED_ELSEWHERE = {
    "fsdp2_multirank.py": "tests/python/test_fsdp.py (needs several processes)",
    "main_job.py": "the main job, run by scripts/main.sh",
}
TESTED_HERE = {
    "train_single_pass.py", "inference_two_pass.py", "autocast_bf16.py", "graph_dump.py",
    "cross_machine.py", "format_roundtrip.cpp", "record_tensors.cpp",
}


def run_example(name, *args, cwd):
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    return proc


def only(pattern):
    matches = glob.glob(str(pattern))
    assert len(matches) == 1, f"expected one match for {pattern}, found {matches}"
    return matches[0]


def build_program(name):
    """A C++ example from the build folder scripts/setup.sh makes; fails when it is not built."""
    path = os.path.join(REPO, "build", "examples", name)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"{path} is missing: build the examples with `bash scripts/setup.sh` "
                    "(DYNAPROBE_BUILD_EXAMPLES=ON)")
    return path


def cli_path():
    return os.path.join(os.path.dirname(sys.executable), "dynaprobe")


def assert_report(out, sections, result="ALL PASS"):
    """The stdout report's frame: a Loss line, the sections in order, the RESULT line."""
    assert re.search(r"^  Loss  eager=\S+  compiled=\S+  diff=\S+", out, re.M), out
    positions = [out.index(f"\n  {section}\n") for section in sections]
    assert positions == sorted(positions), out
    for section in {"FORWARD INPUT", "FORWARD OUTPUT", "BACKWARD"} - set(sections):
        assert f"\n  {section}\n" not in out, f"unexpected {section} section:\n{out}"
    # A FAILED line says why before the rule that decided: the tolerances, or the reference
    # (docs/report-format.md).
    reasons = r"\d+ FAIL, \d+ WARN[^;]*; " if result == "FAILED" else r"([^;]*; )?"
    assert re.search(rf"^  RESULT: {result}  \({reasons}(atol=|reference: noise within 2x)", out,
                     re.M), out


def test_every_example_has_a_test():
    present = {os.path.basename(p) for p in glob.glob(os.path.join(EXAMPLES, "*.py"))
               + glob.glob(os.path.join(EXAMPLES, "*.cpp"))}
    untested = present - TESTED_HERE - set(TESTED_ELSEWHERE)
    assert not untested, f"examples without a test: {sorted(untested)}; add one to {__file__}"
    assert TESTED_HERE <= present, f"missing examples: {sorted(TESTED_HERE - present)}"


def test_train_single_pass_checks_every_step_and_writes_to_the_default_folder(tmp_path):
    proc = run_example("train_single_pass.py", cwd=tmp_path)  # no argument: ./dynaprobe_runs
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for step in range(3):
        assert re.search(rf"^step {step}: loss \d+\.\d+, 0 failing rows$", out, re.M), out
    assert_report(out, ["FORWARD INPUT", "FORWARD OUTPUT", "BACKWARD"])
    assert re.search(r"^  Loss  eager=nan  compiled=\d", out, re.M)  # single-pass: no eager loss
    for row in ("pass  blocks.0 ", "pass  blocks.1 ", "pass  blocks.1.grad_input", "param=mlp.0.weight"):
        assert row in out, out
    run = only(tmp_path / "dynaprobe_runs" / "train_single_pass-*")
    # The dump's files, and the writer's lock (docs/dump-format.md).
    assert sorted(os.listdir(run)) == [".dynaprobe.lock", "report.csv", "step_00000000.h5",
                                       "step_00000001.h5", "step_00000002.h5"]
    rows = list(csv.reader(open(os.path.join(run, "report.csv"))))
    assert ",".join(rows[0]) == CSV_HEADER
    assert rows[1][:4] == ["LOSS", "loss", "0", "PASS"] and rows[1][-1] == "single_pass mode"
    # The dump re-checks offline to the very report the example printed for its last step.
    cli = subprocess.run([cli_path(), "compare", run, "--step", "2"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout in out


def test_inference_two_pass_compares_real_losses_without_backward(tmp_path):
    proc = run_example("inference_two_pass.py", tmp_path / "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert_report(out, ["FORWARD INPUT", "FORWARD OUTPUT"])  # no backward in inference
    loss = re.search(r"^  Loss  eager=(\S+)  compiled=(\S+)  diff=(\S+)$", out, re.M)
    eager, compiled = float(loss.group(1)), float(loss.group(2))
    assert eager == pytest.approx(compiled, abs=1e-5)  # two-pass: a real eager loss, not nan
    for module in ("embed", "encoder.0", "encoder.1", "encoder.2", "head"):
        assert f"pass  {module} " in out, out
    run = only(tmp_path / "out" / "inference_two_pass-*")
    assert os.path.isfile(os.path.join(run, "step_00000000.h5"))
    assert f"CSV report saved to: {os.path.join(run, 'report.csv')}" in out
    assert re.search(r"^loss_eager=-?\d+\.\d{6} loss_compiled=-?\d+\.\d{6}$", out, re.M)


def test_autocast_bf16_passes_with_bf16_tolerances(tmp_path):
    proc = run_example("autocast_bf16.py", tmp_path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert_report(out, ["FORWARD INPUT", "FORWARD OUTPUT", "BACKWARD"],
                  result="ALL PASS" if "0 failing row(s)" in out else "FAILED")
    assert re.search(r"^  Loss  eager=nan  compiled=\S+  diff=nan  cast_dtype=torch.bfloat16"
                     r"  \(single-pass: no whole-model eager run\)$", out, re.M)
    assert re.search(r"^default tolerances: \d+ failing row\(s\)$", out, re.M)
    assert "bf16 tolerances: RESULT: ALL PASS  (atol=0.01 rtol=0.016)" in out
    run = only(tmp_path / "autocast_bf16-*")
    assert os.path.isfile(os.path.join(run, "step_00000000.h5"))


def test_graph_dump_writes_captured_forward_and_backward_graphs(tmp_path):
    proc = run_example("graph_dump.py", tmp_path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert_report(out, ["FORWARD INPUT", "FORWARD OUTPUT", "BACKWARD"])
    run = only(tmp_path / "graph_dump-*")
    graphs = sorted(os.listdir(os.path.join(run, "graphs")))
    pattern = re.compile(r"^(__compiled_fn_\d+)\.(Captured|Forward|Backward)_Graph\.[0-9a-f]{8}\.py$")
    assert graphs and all(pattern.match(g) for g in graphs), graphs
    modules = {}
    for name in graphs:
        function, kind = pattern.match(name).groups()
        with open(os.path.join(run, "graphs", name)) as f:
            header = f.readline()
        module = header.rsplit(" of ", 1)[1].strip()
        modules.setdefault(module, {}).setdefault(function, set()).add(kind)
        assert f"  {name[:-3]}: {kind.lower()} graph of {module}" in out
    assert set(modules) == {"embed", "gated"}
    assert len(modules["gated"]) == 2, modules  # the graph break splits it in two functions
    for functions in modules.values():
        assert all(kinds == {"Captured", "Forward", "Backward"} for kinds in functions.values())
    assert sorted(os.listdir(os.path.join(run, "from_dump"))) == graphs
    assert f"`dynaprobe graphs` extracted {len(graphs)} graphs" in out


def test_cross_machine_captures_in_two_processes_and_compares_offline(tmp_path):
    proc = run_example("cross_machine.py", tmp_path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    run = only(tmp_path / "cross_machine-*")
    for side in ("eager", "compiled"):
        assert f"[{side}] wrote {os.path.join(run, side, 'step_00000000.h5')}" in out
    # Both captures ran here with the same settings: each side's provenance is printed, and the
    # one-sided modes (different by design) are not listed as a difference.
    assert "Eager side:    host=" in out and "Compiled side: host=" in out
    assert "  mode: eager=eager_only" not in out
    assert_report(out, ["FORWARD INPUT", "FORWARD OUTPUT", "BACKWARD"])
    loss = re.search(r"^  Loss  eager=(\d\S*)  compiled=(\S+)  diff=0.000e\+00$", out, re.M)
    assert loss and loss.group(1) == loss.group(2), out  # both processes ran the same step
    assert "dynaprobe compare exited with 0" in out
    rows = list(csv.reader(io.StringIO(open(os.path.join(run, "report.csv")).read())))
    assert ",".join(rows[0]) == CSV_HEADER
    assert rows[1][:4] == ["LOSS", "loss", "0", "PASS"]
    assert {r[0] for r in rows[2:]} == {"0", "1", "2", "3"}


def test_format_roundtrip_cpp(tmp_path):
    program = build_program("format_roundtrip")
    proc = subprocess.run([program, tmp_path / "dump"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round trip: every byte identical" in proc.stdout
    assert "graph __compiled_fn_0.Captured_Graph.00000000 (captured" in proc.stdout
    assert os.path.isfile(tmp_path / "dump" / "step_00000000.h5")
    # A single-pass layout: the CLI pairs it as one, nothing reads as missing.
    cli = subprocess.run([cli_path(), "compare", tmp_path / "dump"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "MISSING" not in cli.stdout
    # Its bf16 row has no reference (the example writes none), and the RESULT line says so.
    assert ("  RESULT: ALL PASS  (1 low-precision row(s) without a reference: judged by the "
            "tolerances; atol=1e-4 rtol=1e-3)\n") in cli.stdout, cli.stdout


def test_record_tensors_cpp_writes_a_dump_the_cli_compares(tmp_path):
    program = build_program("record_tensors")
    dump = tmp_path / "dump"
    for step in range(2):  # a second run adds a step, never overwrites the first
        proc = subprocess.run([program, dump], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (f"wrote {dump / f'step_{step:08d}.h5'} (format {dynaprobe.format_version()}, "
                f"step {step})") in proc.stdout
    lines = proc.stdout.splitlines()
    assert re.match(r"^  layer  fwd_input  eager     float32   \(4, 8\)   -2\.00000 ", lines[1])
    assert re.match(r"^  layer  fwd_output compiled  bfloat16  \(4, 8\) ", lines[4])
    assert re.match(r"^  LOSS   loss       compiled  bfloat16  \(\)  ", lines[6])
    # The bf16 "compiled" side differs from the fp32 eager side by bf16 rounding: within bf16's
    # tolerance floor by default, and found by the spec's tolerances as they are.
    default = subprocess.run([cli_path(), "compare", dump, "--step", "0"], capture_output=True,
                             text=True)
    assert default.returncode == 0, default.stdout + default.stderr
    assert "tol: atol=0.01 rtol=0.016" in default.stdout
    cli = subprocess.run([cli_path(), "compare", dump, "--step", "0", "--fixed-tolerances"],
                         capture_output=True, text=True)
    assert cli.returncode == 1, cli.stdout + cli.stderr
    assert "  pass  layer " in cli.stdout and "  FAIL  layer " in cli.stdout
    # A run without the reference says so: the bf16 rows were judged by the tolerances alone.
    assert ("RESULT: FAILED  (1 FAIL, 0 WARN, 1 low-precision row(s) without a reference: judged "
            "by the tolerances; atol=1e-4 rtol=1e-3)") in cli.stdout, cli.stdout
