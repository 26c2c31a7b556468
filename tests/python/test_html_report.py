"""The HTML report in a real browser (headless Chromium over the DevTools protocol, browser.py),
and the one report model behind the JSON report and Python's rows.

The report of a real training step with a compiler fault (GELU made 1% larger in stage1) must
open offline without an error, plot one point per tensor row along execution order, and show,
when a user clicks the failing row's point, its metrics, histogram and the graph code the
compiler made of the module; several ranks get a rank x module heat map, several steps a chart
across steps.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess

import numpy as np
import pytest
import torch
from browser import Browser, chromium_path
from dynaprobe import _C, PrecisionChecker
from models import FORWARD_FAULT, Chain


def capture(dump_dir: pathlib.Path, steps: int = 1, seed: int = 0):
    """Training steps of models.Chain, whose stage1 GELU the backend makes 1% larger in the
    forward; the checker and the result of the last step."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = Chain()
    checker = PrecisionChecker(backend=FORWARD_FAULT, dump_dir=str(dump_dir))
    checker.wrap_all_children(model, depth=0)
    x = torch.randn(4, 8)

    def step(m):
        m.zero_grad()
        loss = m(x)
        loss.backward()
        return loss

    for _ in range(steps):
        result = checker.compare(step, model)
    return checker, result


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder of two ranks, two steps each."""
    root = tmp_path_factory.mktemp("html") / "job"
    for rank in (0, 1):
        capture(root / f"rank{rank}", steps=2, seed=rank)
    return root


@pytest.fixture(scope="module")
def browser():
    if chromium_path() is None:
        pytest.fail("chromium is not installed: run scripts/setup.sh (it installs it)")
    with Browser() as b:
        yield b


def cli_reports(dynaprobe_cli, dump, folder: pathlib.Path, *options):
    proc = subprocess.run([dynaprobe_cli, "compare", str(dump), "--html", str(folder / "r.html"),
                           "--json", str(folder / "r.json"), *options],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 1, proc.stderr  # the fault makes rows FAIL
    assert f"HTML report saved to: {folder / 'r.html'}" in proc.stdout
    return folder / "r.html", json.loads((folder / "r.json").read_text())


def open_report(browser, path, hash=""):
    browser.exceptions.clear()
    browser.console.clear()
    browser.requests.clear()
    browser.open(path.resolve().as_uri() + hash)
    browser.wait_until("document.body.dataset.ready === 'true'")


def tensor_rows(step):
    return [row for row in step["rows"] if row["check_type"] != "note"]


def test_html_report_opens_offline_and_plots_one_point_per_row(run, dynaprobe_cli, tmp_path,
                                                               browser):
    html, report = cli_reports(dynaprobe_cli, run / "rank0", tmp_path, "--step", "1")
    assert html.stat().st_size < 500_000  # Chart.js is about 200 kB of it
    open_report(browser, html)
    assert browser.errors() == []
    assert browser.requests == [html.resolve().as_uri()]  # nothing fetched from elsewhere
    step = report["ranks"][0]["steps"][0]
    points = browser.evaluate(
        "Chart.getChart('error-chart').data.datasets.filter(d => d.rows)"
        ".reduce((n, d) => n + d.data.length, 0)")
    assert points == len(tensor_rows(step)) > 0
    assert browser.evaluate("document.getElementById('error-chart').dataset.points") == str(points)
    # Forward rows come before backward rows along the x axis (execution order).
    xs = browser.evaluate(
        "Object.fromEntries(Chart.getChart('error-chart').data.datasets.filter(d => d.rows)"
        ".map(d => [d.label, d.data.map(p => p.x)]))")
    assert max(xs["forward"]) < min(xs["backward"])
    # The tolerance is drawn: rtol for max_rel, atol for max_abs; 1 - cosine has none.
    tolerance = ("Chart.getChart('error-chart').data.datasets.filter(d => !d.rows)"
                 ".map(d => [d.label, d.data[0].y])")
    assert browser.evaluate(tolerance) == [["rtol=0.001", 0.001]]
    browser.evaluate("document.getElementById('metric-max_abs').click()")
    assert browser.evaluate(tolerance) == [["atol=0.0001", 0.0001]]
    ys = browser.evaluate("Chart.getChart('error-chart').data.datasets.filter(d => d.rows)"
                          ".flatMap(d => d.data.map(p => [p.index, p.y]))")
    assert len(ys) == len(tensor_rows(step))
    for index, y in ys:
        assert y == max(step["rows"][index]["metrics"]["max_abs"], 1e-12)  # all compared here
    browser.evaluate("document.getElementById('metric-cosine').click()")
    assert browser.evaluate(tolerance) == []
    assert browser.evaluate("document.getElementById('verdict').textContent") == "FAILED"
    root = browser.evaluate("document.getElementById('root-cause').textContent")
    assert "stage1" in root and "local" in root


def test_clicking_the_failing_rows_point_shows_its_metrics_histogram_and_graph_code(
        run, dynaprobe_cli, tmp_path, browser):
    html, report = cli_reports(dynaprobe_cli, run / "rank0", tmp_path, "--step", "0")
    step = report["ranks"][0]["steps"][0]
    index = next(i for i, row in enumerate(step["rows"])
                 if row["module"] == "stage1" and row["check_type"] == "fwd_output")
    row = step["rows"][index]
    assert row["status"] == "FAIL"
    open_report(browser, html)
    assert browser.evaluate("document.getElementById('detail').hidden") is True
    x, y = browser.evaluate(f"""(() => {{
        const chart = Chart.getChart('error-chart');
        for (const [k, d] of chart.data.datasets.entries()) {{
          const j = d.data.findIndex(p => p.index === {index});
          if (d.rows && j >= 0) {{
            const point = chart.getDatasetMeta(k).data[j];
            const box = chart.canvas.getBoundingClientRect();
            return [box.left + point.x, box.top + point.y];
          }}
        }}
      }})()""")
    browser.click(x, y)  # the mouse moves there first: the tooltip shows the row's numbers
    tooltip = browser.wait_until(
        "Chart.getChart('error-chart').tooltip.body?.flatMap(b => b.lines).join(' ')")
    assert "stage1.fwd_output" in tooltip and "max_abs=" in tooltip and "max_rel=" in tooltip
    # Chart.js handles the click on the next animation frame.
    assert browser.wait_until("location.hash") == f"#row=0/0/{index}"
    browser.wait_until(f"document.getElementById('detail').dataset.row === '{index}'")
    assert browser.evaluate("document.getElementById('detail').hidden") is False
    detail = browser.evaluate("document.getElementById('detail').innerText")
    assert "stage1.fwd_output" in detail and "FAIL" in detail
    worst = row["metrics"]["worst"]
    assert f"flat {worst['flat_index']}" in detail
    # The graphs of stage1's compiled functions, as the dump holds them.
    functions = step["modules"]["stage1"]["compiled_functions"].split(",")
    shown = browser.evaluate(
        "[...document.querySelectorAll('#detail details')].map(d => "
        "[d.querySelector('summary').textContent, d.querySelector('pre.graph-code').textContent])")
    assert shown, "no graph code shown"
    names = [name for name, _ in shown]
    assert all(any(name.startswith(f + ".") for f in functions) for name in names)
    assert any(".Captured_Graph." in name for name in names)
    assert any(".Forward_Graph." in name for name in names)
    # Function by function, each as Dynamo captured it, then AOTAutograd's forward and backward.
    order = ["Captured_Graph", "Forward_Graph", "Backward_Graph"]
    keys = [(name.split(".")[0], order.index(name.split(".")[1])) for name in names]
    assert keys == sorted(keys, key=lambda k: (int(k[0].rsplit("_", 1)[1]), k[1]))
    written = tmp_path / "graphs"
    subprocess.run([dynaprobe_cli, "graphs", str(run / "rank0"), "-o", str(written)], check=True,
                   capture_output=True)
    for name, text in shown:
        assert (written / f"{name}.py").read_text() == text
    assert any("gelu" in text for _, text in shown)
    # The histogram holds every element of the tensor.
    counts = browser.evaluate("Chart.getChart('histogram-chart').data.datasets[0].data")
    assert sum(counts) == row["metrics"]["elements"] == sum(row["metrics"]["histogram"])
    assert browser.errors() == []


def test_a_row_link_opens_the_row(run, dynaprobe_cli, tmp_path):
    """#row=RANK/STEP/ROW opens a row on load: the view a user links to, also for a plain
    `chromium --dump-dom`, without a debugging protocol (the virtual time budget lets the page
    unpack its data before the DOM is dumped)."""
    html, report = cli_reports(dynaprobe_cli, run / "rank0", tmp_path, "--step", "0")
    index = next(i for i, row in enumerate(report["ranks"][0]["steps"][0]["rows"])
                 if row["module"] == "stage1" and row["check_type"] == "fwd_output")
    url = html.resolve().as_uri() + f"#row=0/0/{index}"
    dom = subprocess.run([chromium_path(), "--headless", "--no-sandbox", "--disable-gpu",
                          "--virtual-time-budget=10000", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert f'<div id="detail" data-row="{index}">' in dom
    assert '<pre class="graph-code">' in dom


def test_ranks_get_a_heat_map_and_steps_a_chart(run, dynaprobe_cli, tmp_path, browser):
    html, report = cli_reports(dynaprobe_cli, run, tmp_path)
    open_report(browser, html)
    assert browser.errors() == []
    modules = {row["module"] for row in report["ranks"][0]["steps"][0]["rows"]}
    cells = browser.evaluate("[...document.querySelectorAll('#heatmap-table tr')]"
                             ".map(tr => tr.querySelectorAll('td.heat-cell').length)")
    assert cells == [0, len(modules), len(modules)]  # a header, then one row per rank
    steps = browser.evaluate("Chart.getChart('steps-chart').data.datasets.map(d => d.data.length)")
    assert steps == [2, 2, 2, 2]  # forward and backward of each rank, two steps each
    assert browser.evaluate("document.getElementById('step-select').options.length") == 2
    assert browser.evaluate("document.getElementById('rank-select').options.length") == 2


def test_checker_report_writes_the_html_the_cli_writes(tmp_path, dynaprobe_cli, capsys):
    checker, result = capture(tmp_path / "dump")
    checker.report(result, html_path=str(tmp_path / "py.html"))
    assert f"HTML report saved to: {tmp_path / 'py.html'}" in capsys.readouterr().out
    subprocess.run([dynaprobe_cli, "compare", str(tmp_path / "dump"), "--step",
                    str(result.step), "--html", str(tmp_path / "cli.html")], capture_output=True,
                   check=False)  # exit 1: the fault
    assert (tmp_path / "py.html").read_bytes() == (tmp_path / "cli.html").read_bytes()
    with pytest.raises(TypeError, match="html_path"):
        checker.report(result, pdf_path="x.pdf")


def _rounded(value):
    """JSON spells non-finite numbers as strings and prints 9 significant digits."""
    if isinstance(value, dict):
        return {key: _rounded(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return float(f"{value:.9g}")
    return value


def test_json_rows_and_python_rows_are_the_same_model(tmp_path, dynaprobe_cli):
    _, result = capture(tmp_path / "dump")
    _, report = cli_reports(dynaprobe_cli, tmp_path / "dump", tmp_path)
    step = report["ranks"][0]["steps"][0]
    engine = _C.compare(str(tmp_path / "dump"), str(tmp_path / "dump")).steps[0]
    assert _rounded(engine.rows) == _rounded(step["rows"])
    assert engine.counts == step["result"]
    assert engine.root_cause == step["root_cause"] == result.root_cause
    # Row.metrics is that dict; the flat worst_* keys of earlier versions still read.
    row = next(r for r in result.rows if r.status == "FAIL" and r.metrics)
    assert row.metrics["worst_index"] == row.metrics["worst"]["flat_index"]
    assert row.metrics["worst_compiled"] == row.metrics["worst"]["compiled"]
    assert "worst_index" not in row.metrics
    assert sum(row.metrics["histogram"]) == row.metrics["elements"]


def test_a_report_of_1000_modules_with_their_graphs_stays_small(tmp_path, dynaprobe_cli, browser):
    """1,000 modules, 6 rows each, 3 graphs of 40 lines each: a page of about 1 MB (17 MB before
    its data was compressed) that opens without an error and plots every row."""
    rng = np.random.default_rng(0)
    records, graphs, modules = [], [], []
    for i in range(1000):
        module = f"model.layers.{i}.mlp"
        for side in ("eager", "compiled"):
            for kind in ("fwd_input", "fwd_output", "grad_input", "grad_output"):
                x = rng.standard_normal(256).astype(np.float32)
                records.append((module, 0, kind, 0, side, "", "float32",
                                x if side == "eager" else x + np.float32(1e-7 * i)))
            for index, label in enumerate(("weight", "bias")):
                records.append((module, 0, "param_grad", index, side, label, "float32",
                                rng.standard_normal(64).astype(np.float32)))
        for kind in ("Captured", "Forward", "Backward"):
            body = "".join(f"    v{j + 1} = torch.ops.aten.linear.default(v{j}, self.w{i}, "
                           f"self.b{i});  # [4, 1024]\n" for j in range(40))
            graphs.append((f"__compiled_fn_{i}.{kind}_Graph.{i:08x}", kind.lower(),
                           f"def forward(self, v0):\n{body}    return v40\n", {"module": module}))
        modules.append((module, {"role": "wrapped", "compiled_functions": f"__compiled_fn_{i}"}))
    _C.write_step(str(tmp_path / "dump"), 0, {"mode": "two_pass", "atol": "0.0001",
                                              "rtol": "0.001"}, records, graphs, modules=modules)
    html = tmp_path / "big.html"
    subprocess.run([dynaprobe_cli, "compare", str(tmp_path / "dump"), "--html", str(html)],
                   capture_output=True, check=False)
    assert html.stat().st_size < 2_000_000
    open_report(browser, html)
    assert browser.errors() == []
    assert browser.evaluate("document.getElementById('error-chart').dataset.points") == "6000"
