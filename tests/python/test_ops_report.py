"""The op localisation in the reports: once ``bisect --ops`` has written an ops dump beside a
dump, ``dynaprobe compare DUMP`` names the first op of each aten graph that fails (text, JSON and
HTML) and where in the source it is, and the dump's other commands work as before."""

from __future__ import annotations

import inspect
import itertools
import json
import os
import subprocess

import pytest
from browser import Browser, chromium_path
from models import RMSNormMLP, rsqrt_fault_backend
from test_ops import _dump

from dynaprobe import _C
from dynaprobe._offline.ops import localise
from dynaprobe._results.result import CompareResult

# Where the faulted rsqrt stands in tests/python/models.py, as the ops report cites it.
_SOURCE, _FIRST = inspect.getsourcelines(RMSNormMLP.forward)
RSQRT_LINE = _FIRST + next(i for i, line in enumerate(_SOURCE) if "torch.rsqrt(" in line)


def _ops_dump(tmp_path):
    """A training step of RMSNormMLP whose compiled rsqrt is 5% too large, and the op
    localisation of its call: (the dump folder, the OpsResult)."""
    call = _dump(tmp_path, RMSNormMLP(), rsqrt_fault_backend)
    result = localise(call, rsqrt_fault_backend, label="aot_autograd, rsqrt 5% too large")
    return os.path.dirname(call.path), result


def _run(cli, *args):
    return subprocess.run([cli, *args], capture_output=True, text=True)


def test_compare_names_the_first_failing_op_in_text_json_and_html(tmp_path, dynaprobe_cli):
    if chromium_path() is None:
        pytest.fail("chromium is not installed: run scripts/setup.sh (it installs it)")
    dump, result = _ops_dump(tmp_path)
    finding = next(g.finding for g in result.graphs if g.kind == "forward")
    assert finding is not None and finding.node == "rsqrt", result.text()

    run = _run(dynaprobe_cli, "compare", dump, "--json", str(tmp_path / "report.json"),
               "--html", str(tmp_path / "report.html"))
    assert run.returncode == 1, run.stderr
    text = run.stdout
    start = text.index("\n  OPS  ")
    # The section's lines (a long path goes whole onto a line of its own), up to the CLI's own.
    ops = "\n" + "".join(itertools.takewhile(lambda line: line.startswith("  "),
                                              text[start + 1:].splitlines(keepends=True)))
    assert ops.startswith("\n  OPS  0 call 0 (aot_autograd, rsqrt 5% too large)\n"), text
    assert ("\n  forward   first op that fails: rsqrt (aten.rsqrt.default)  max_abs="
            f"{finding.row.max_abs:.3e}  (") in ops, ops
    assert f"models.py:{RSQRT_LINE}  norm = x * torch.rsqrt(" in ops.replace("\n            ", " ")
    assert "\n  backward  no op fails beyond fp64 noise (" in ops, ops
    assert f"\n  every op  dynaprobe compare {result.dump}\n" in ops.replace(
        "\n            ", " "), ops
    assert text.index("ROOT CAUSE") < text.index("\n  OPS  ")
    for line in ops.splitlines():  # a path longer than a line has a line of its own
        assert len(line) <= 120 or " " not in line.strip(), line

    with open(tmp_path / "report.json") as file:
        step = json.load(file)["ranks"][0]["steps"][0]
    assert len(step["ops"]) == 1
    entry = step["ops"][0]
    assert (entry["module"], entry["call"], entry["dump"], entry["error"]) == \
        ("0", 0, result.dump, None)
    assert entry["backend"] == "aot_autograd, rsqrt 5% too large"
    graphs = {g["graph"]: g for g in entry["graphs"]}
    assert list(graphs) == [g.kind for g in result.graphs]
    forward = graphs["forward"]
    assert forward["first_failing"]["node"] == "rsqrt"
    assert forward["first_failing"]["op"] == "aten.rsqrt.default"
    assert forward["first_failing"]["status"] == "FAIL"
    assert forward["first_failing"]["source"] == finding.source
    # The JSON report's numbers read back as the very doubles.
    assert forward["first_failing"]["max_abs"] == finding.row.max_abs
    assert forward["first_failing"]["mean_abs"] == finding.row.mean_abs
    for kind in result.graphs:  # the counts bisect --ops itself reports
        assert graphs[kind.kind]["ops"] == len(kind.rows)
        assert graphs[kind.kind]["failing"] == sum(r.status == "FAIL" for r in kind.rows)
    assert graphs["backward"]["first_failing"] is None
    with Browser() as browser:  # the page's Ops section, as a reader sees it
        browser.open((tmp_path / "report.html").resolve().as_uri())
        browser.wait_until("document.body.dataset.ready === 'true'")
        assert browser.errors() == []
        shown = browser.evaluate("document.getElementById('ops').innerText")
    assert "0 call 0 (aot_autograd, rsqrt 5% too large)" in shown, shown
    assert "rsqrt (aten.rsqrt.default)" in shown and f"models.py:{RSQRT_LINE}" in shown, shown
    assert f"dynaprobe compare {result.dump}" in shown, shown

    # Python's report of the dump is the same renderer's, and its step has the same model.
    comparison = _C.compare(dump, dump)
    report = comparison.steps[0]
    assert report.ops == step["ops"]
    assert report.ops[0]["graphs"][0]["first_failing"]["max_abs"] == finding.row.max_abs
    assert ops in CompareResult.from_report(report, dump, "", comparison).text()


def test_a_damaged_ops_dump_is_said_and_the_dump_s_commands_still_work(tmp_path,
                                                                       dynaprobe_cli):
    dump, result = _ops_dump(tmp_path)
    before = _run(dynaprobe_cli, "compare", dump)
    step_file = next(f for f in os.listdir(result.dump) if f.endswith(".h5"))
    with open(os.path.join(result.dump, step_file), "r+b") as file:
        file.write(b"garbage!" * 64)
    run = _run(dynaprobe_cli, "compare", dump)
    assert run.returncode == 1, run.stderr
    # The main report is whole: everything before OPS is what it was.
    assert run.stdout.split("\n  OPS  ")[0] == before.stdout.split("\n  OPS  ")[0]
    # Wrapped at 120 columns, a long path on a line of its own: compared word by word.
    assert f"ops dump {result.dump} unreadable:" in " ".join(run.stdout.split()), run.stdout
    assert "every op" not in run.stdout

    # ls, graphs and runs read the dump, not its ops folder.
    ls = _run(dynaprobe_cli, "ls", dump)
    assert ls.returncode == 0 and "records" in ls.stdout, ls.stderr
    graphs = _run(dynaprobe_cli, "graphs", dump, "--output", str(tmp_path / "graphs"))
    assert graphs.returncode == 0, graphs.stderr
    assert any(name.startswith("__compiled_fn") for name in os.listdir(tmp_path / "graphs"))
    runs = _run(dynaprobe_cli, "runs", str(tmp_path))
    assert runs.returncode == 0, runs.stderr
    assert "dump" in runs.stdout
