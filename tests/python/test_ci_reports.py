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
