"""The CI reports of `dynaprobe compare`: JUnit XML (--junit) read back with xml.etree, and the
GitHub Actions job summary (--markdown), from a real failing dump."""
from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET

from test_replay import checked_step  # Chain, whose GELU the backend perturbs


def test_junit_and_markdown_name_the_failing_module_and_the_root_cause(tmp_path, dynaprobe_cli):
    _, _, result = checked_step(tmp_path)
    assert not result
    failing = sorted({row.module for row in result.rows if row.status in ("FAIL", "WARN")})
    assert failing
    junit, markdown = tmp_path / "report.xml", tmp_path / "summary.md"
    proc = subprocess.run([dynaprobe_cli, "compare", str(tmp_path / "dump"), "--junit", str(junit),
                           "--markdown", str(markdown)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert f"JUnit XML report saved to: {junit}" in proc.stdout

    suites = ET.parse(junit).getroot()
    assert suites.tag == "testsuites"
    [suite] = suites.findall("testsuite")
    assert suite.get("name") == f"dynaprobe.rank0.step{result.step}"
    cases = suite.findall("testcase")
    modules = {row.module for row in result.rows}
    assert {case.get("name") for case in cases} == modules | {"(loss)"}
    failed = [case for case in cases if case.find("failure") is not None]
    skipped = [case for case in cases if case.find("skipped") is not None]
    for element in (suites, suite):
        assert int(element.get("tests")) == len(cases)
        assert int(element.get("failures")) == len(failed)
        assert int(element.get("skipped")) == len(skipped)
        assert element.get("errors") == "0"
    assert sorted(case.get("name") for case in failed if case.get("name") != "(loss)") == failing
    cause = result.root_cause["forward"]["module"]
    failure = next(case for case in failed if case.get("name") == cause).find("failure")
    assert failure.get("type") == "FAIL"
    assert "root cause of the step:" in failure.text
    assert f"forward   {cause} " in failure.text
    assert all(case.get("classname") == suite.get("name") for case in cases)

    text = markdown.read_text()
    assert text.startswith("## dynaprobe: FAILED\n")
    header = "| rank | step | module | check | status | max_abs |"
    lines = text.splitlines()
    start = lines.index(header) + 2
    table = [line.split(" | ") for line in lines[start:lines.index("", start)]]
    listed = sorted({cells[2].replace("\\_", "_") for cells in table})
    assert listed == failing
    assert all(cells[0] == "| 0" and cells[1] == str(result.step) for cells in table)
    assert "### Root cause (first seen at rank 0, step" in text


def test_a_baseline_capture_gates_a_compiler_change(tmp_path, dynaprobe_cli):
    """The torch-upgrade gate of the guide (first-check.md, "Gating a torch upgrade"): a capture of
    the compiled side kept as a baseline, compared with one made after the change."""
    import torch
    import torch.nn as nn
    from models import perturbed_gelu_backend

    from dynaprobe import PrecisionChecker

    def capture(folder, backend):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        batch = torch.randn(4, 8)
        checker = PrecisionChecker(backend=backend, dump_dir=str(tmp_path / folder))
        checker.wrap(model)
        checker.capture(lambda m: m(batch).pow(2).mean(), model, side="compiled")

    capture("baseline", "aot_eager")
    capture("same", "aot_eager")
    capture("changed", perturbed_gelu_backend)  # the "upgrade" that changes GELU
    same = subprocess.run([dynaprobe_cli, "compare", str(tmp_path / "baseline"),
                           str(tmp_path / "same")], capture_output=True, text=True)
    assert same.returncode == 0, same.stdout + same.stderr
    assert same.stdout.startswith("Baseline:      ") and "RESULT: ALL PASS" in same.stdout
    junit = tmp_path / "junit.xml"
    changed = subprocess.run([dynaprobe_cli, "compare", str(tmp_path / "baseline"),
                              str(tmp_path / "changed"), "--junit", str(junit)],
                             capture_output=True, text=True)
    assert changed.returncode == 1, changed.stdout + changed.stderr
    assert "Provenance differs between the baseline and the compiled dump:" in changed.stdout
    assert "  backend: baseline=aot_eager  compiled=" in changed.stdout
    assert "FAIL  Sequential" in changed.stdout
    failures = {case.get("name"): case.find("failure") for case in ET.parse(junit).iter("testcase")}
    assert "FAIL fwd_output[0]" in failures["Sequential"].text
