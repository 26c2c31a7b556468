"""The HTML report in a real browser (headless Chromium over the DevTools protocol, browser.py),
and the one report model behind the JSON report and Python's rows.

The report of a real training step with a compiler fault (GELU made 1% larger in stage1) must
open offline without an error, plot one point per tensor row along execution order, and show,
when a user clicks the failing row's point, its metrics, histogram and the graph code the
compiler made of the module; several ranks get a rank x step and a rank x module heat map,
several steps a chart across steps. A run of 512 ranks keeps its heat map in a bounded box in which
the one failing rank stands out and is named.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import shutil
import subprocess

import h5py
import numpy as np
import pytest
import torch
from browser import Browser, chromium_path
from dump_checksum import xxh3
from models import FORWARD_FAULT, Chain

from dynaprobe import _C, PrecisionChecker


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
    # The tolerance is drawn: 1 for the default, the error in units of the tolerance; rtol for
    # max_rel, atol for max_abs; 1 - cosine has none.
    tolerance = ("Chart.getChart('error-chart').data.datasets.filter(d => !d.rows)"
                 ".map(d => [d.label, d.data[0].y])")
    assert browser.evaluate(tolerance) == [["threshold=1", 1]]
    browser.evaluate("document.getElementById('metric-max_rel').click()")
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
    shown = re.search(r"\|diff\|/tol=(\S+)", tooltip)
    assert shown and float(shown[1]) == pytest.approx(row["metrics"]["max_tol_ratio"], rel=1e-5)
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


def test_ranks_get_heat_maps_and_steps_a_chart(run, dynaprobe_cli, tmp_path, browser):
    html, report = cli_reports(dynaprobe_cli, run, tmp_path)
    open_report(browser, html)
    assert browser.errors() == []
    modules = {row["module"] for row in report["ranks"][0]["steps"][0]["rows"]}
    shape = "[dynaprobeReport.heatmaps.{0}.spec.columns, dynaprobeReport.heatmaps.{0}.spec.rows]"
    assert browser.evaluate(shape.format("run")) == [2, 2]  # a column per rank, a row per step
    assert browser.evaluate(shape.format("modules")) == [2, len(modules)]
    # Every step of both ranks fails (the fault is in the backend): each is a link.
    links = browser.evaluate("[...document.querySelectorAll('#run-map-failing a')]"
                             ".map(a => [a.textContent, a.getAttribute('href')])")
    assert links == [["rank 0 step 0", "#step=0/0"], ["rank 0 step 1", "#step=0/1"],
                     ["rank 1 step 0", "#step=1/0"], ["rank 1 step 1", "#step=1/1"]]
    browser.evaluate("document.querySelectorAll('#run-map-failing a')[3].click()")
    browser.wait_until("dynaprobeReport.state.rank === 1 && dynaprobeReport.state.step === 1")
    assert browser.evaluate("document.getElementById('step-result').textContent").startswith(
        "Rank 1 step 1: RESULT FAILED")
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


def without_tol_ratio(step_file: pathlib.Path):
    """Rewrites a step's /metrics as a capture wrote it before max_tol_ratio existed: the same
    table without that column, under its checksum (XXH3-64 of the bytes, dump-format.md)."""
    with h5py.File(step_file, "r+") as f:
        table = f["metrics"][()]
        names = [name for name in table.dtype.names if name != "max_tol_ratio"]
        old = np.empty(len(table), dtype=[(name, table.dtype[name]) for name in names])
        for name in names:
            old[name] = table[name]
        del f["metrics"]
        f.create_dataset("metrics", data=old)
        f["metrics"].attrs.create("checksum", xxh3(old.tobytes()), dtype=np.uint64)


def test_metrics_stored_before_the_tolerance_ratio_are_drawn_with_a_lower_bound(
        run, dynaprobe_cli, tmp_path, browser):
    """A dump whose capture stored its metrics before max_tol_ratio: the JSON says -1 (not
    stored), and the chart draws the ratio at the worst element, at most the true ratio."""
    shutil.copytree(run / "rank0", tmp_path / "dump")
    _, now = cli_reports(dynaprobe_cli, tmp_path / "dump", tmp_path, "--step", "0")
    without_tol_ratio(tmp_path / "dump" / "step_00000000.h5")
    (tmp_path / "before").mkdir()
    html, before = cli_reports(dynaprobe_cli, tmp_path / "dump", tmp_path / "before", "--step", "0")
    step, true_step = before["ranks"][0]["steps"][0], now["ranks"][0]["steps"][0]
    compared = [i for i, row in enumerate(step["rows"]) if row["metrics"]]
    assert compared and all(step["rows"][i]["metrics"]["max_tol_ratio"] == -1 for i in compared)
    open_report(browser, html)
    assert browser.errors() == []
    points = dict(browser.evaluate("Chart.getChart('error-chart').data.datasets.filter(d => d.rows)"
                                   ".flatMap(d => d.data.map(p => [p.index, p.y]))"))
    failing = None
    for i in compared:
        row, m = step["rows"][i], step["rows"][i]["metrics"]
        tolerances = row["tolerances"] or step["tolerances"]
        estimate = 0.0 if not m["worst"] or m["max_abs"] == 0 else m["max_abs"] / (
            tolerances["atol"] + tolerances["rtol"] * abs(m["worst"]["compiled"]))
        assert points[i] == pytest.approx(max(estimate, 1e-12), rel=1e-6)
        assert estimate <= true_step["rows"][i]["metrics"]["max_tol_ratio"] * (1 + 1e-6)
        if row["status"] == "FAIL":
            failing = i
    browser.evaluate(f"location.hash = '#row=0/0/{failing}'")
    browser.wait_until(f"document.getElementById('detail').dataset.row === '{failing}'")
    assert "estimated at the worst element" in browser.evaluate(
        "document.getElementById('detail').innerText")


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


RANKS = 512
FAULT_RANK = 137
FAIL_RGB = [211, 47, 47]  # the heat maps' colour of a failing cell (#d32f2f)


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory, dynaprobe_cli):
    """A single-pass run of 512 ranks, step 0 on each (ranks 0 to 9 also ran a passing step 1),
    of two tiny modules: layers.0's output is 1%
    larger on rank 137 only (a fault on one rank), 1e-6 off elsewhere; layers.1's output has one
    element near zero (1e-7), twice as large compiled on every rank: max_rel near 1, hundreds of
    times rtol, yet within atol and far within fp32 noise for the tensor as a whole, so it passes.
    Returns the HTML and JSON reports and the fault rank's layers.0 pair."""
    root = tmp_path_factory.mktemp("ranks") / "job"
    rng = np.random.default_rng(512)
    fault = None
    for rank in range(RANKS):
        x = rng.standard_normal((4, 8)).astype(np.float32)
        y = x * np.float32(1.01) if rank == FAULT_RANK else x + np.float32(1e-6)
        tiny = rng.standard_normal(16).astype(np.float32)
        tiny[0] = np.float32(1e-7)
        if rank == FAULT_RANK:
            fault = (x, y)
        records = [("layers.0", 0, "fwd_output", 0, side, "", "float32", value)
                   for side, value in (("eager", x), ("compiled", y))]
        records += [("layers.1", 0, "fwd_output", 0, side, "", "float32", value)
                    for side, value in (("eager", tiny),
                                        ("compiled", np.concatenate([tiny[:1] * 2, tiny[1:]])))]
        _C.write_step(str(root / f"rank{rank}"), 0, {"mode": "single_pass"}, records, [])
        if rank < 10:
            records = [("layers.0", 0, "fwd_output", 0, side, "", "float32", value)
                       for side, value in (("eager", x), ("compiled", x + np.float32(1e-6)))]
            _C.write_step(str(root / f"rank{rank}"), 1, {"mode": "single_pass"}, records, [])
    out = root.parent
    proc = subprocess.run([dynaprobe_cli, "compare", str(root), "--html", str(out / "r.html"),
                           "--json", str(out / "r.json")], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 1, proc.stderr  # rank 137 fails
    return out / "r.html", json.loads((out / "r.json").read_text()), fault


# The colour of the heat map's canvas at the centre of cell (i, j), scrolled into view.
PIXEL = """((map, i, j) => {
  const p = map.reveal(i, j), box = map.canvas.getBoundingClientRect(), r = devicePixelRatio;
  return Array.from(map.canvas.getContext('2d').getImageData(
      Math.floor((p.x - box.left) * r), Math.floor((p.y - box.top) * r), 1, 1).data.slice(0, 3));
})"""


def test_a_run_of_512_ranks_fits_its_heat_map_in_a_bounded_box_and_names_the_failing_rank(
        ranks_run, browser):
    html, report, _ = ranks_run
    ranks = [r["rank"] for r in report["ranks"]]
    assert sorted(ranks) == list(range(RANKS))
    fault = ranks.index(FAULT_RANK)
    open_report(browser, html)
    assert browser.errors() == []
    # Every rank is a column, all in view at once on a 1280-pixel page; the box stays bounded.
    size = browser.evaluate("""(() => {
        const m = dynaprobeReport.heatmaps.run, box = m.box.getBoundingClientRect();
        return {columns: m.spec.columns, rows: m.spec.rows, cell: m.cw, width: box.width,
                height: box.height, scroll: m.box.scrollWidth - m.box.clientWidth,
                canvas: m.canvas.width, page: innerWidth, labelled: m.columnStep}; })()""")
    assert size["columns"] == RANKS and size["rows"] == 2  # steps 0 and 1
    assert size["cell"] >= 2 and size["scroll"] == 0
    assert size["width"] < size["page"] and size["height"] < 400
    assert size["canvas"] <= size["width"]
    assert size["labelled"] > 1  # rank labels thinned out to fit
    # The failing rank's cell, and it alone, is red; the others are shades of green.
    colors = browser.evaluate(f"""(() => {{ const m = dynaprobeReport.heatmaps.run;
        return Array.from({{length: {RANKS}}}, (_, i) => ({PIXEL})(m, i, 0)); }})()""")
    assert [i for i, c in enumerate(colors) if c == FAIL_RGB] == [fault]
    assert all(c[1] > c[0] for i, c in enumerate(colors) if i != fault)
    # Hovering it names the rank, the step and the verdict; the list under the map links it.
    point = browser.evaluate(f"dynaprobeReport.heatmaps.run.reveal({fault}, 0)")
    browser.hover(point["x"], point["y"])
    tooltip = browser.wait_until("!document.getElementById('heat-tooltip').hidden && "
                                 "document.getElementById('heat-tooltip').textContent")
    assert tooltip.startswith(f"rank {FAULT_RANK} step 0: FAILED (1 FAIL, 0 WARN, 2 compared)")
    assert "layers.0.fwd_output" in tooltip
    failing = browser.evaluate("document.getElementById('run-map-failing').textContent")
    assert failing == f"FAILED in 1 of {RANKS} ranks: rank {FAULT_RANK} step 0"
    # The page opened on the failing step; clicking a passing rank's cell opens that one.
    assert browser.evaluate("dynaprobeReport.state.rank") == fault
    describe = f"dynaprobeReport.heatmaps.run.spec.describe({ranks.index(20)}, 1)"
    assert browser.evaluate(describe) == "rank 20 step 1: not captured"
    # Across steps, hundreds of ranks are not hundreds of lines: the largest of all, and the
    # open rank.
    lines = browser.evaluate("Chart.getChart('steps-chart').data.datasets"
                             ".map(d => [d.label, d.data.length])")
    assert lines == [[f"largest of {RANKS} ranks, forward", 2],
                     [f"largest of {RANKS} ranks, backward", 2],
                     [f"rank {FAULT_RANK} forward", 1], [f"rank {FAULT_RANK} backward", 1]]
    other = ranks.index(5)
    point = browser.evaluate(f"dynaprobeReport.heatmaps.run.reveal({other}, 0)")
    browser.click(point["x"], point["y"])
    browser.wait_until(f"dynaprobeReport.state.rank === {other}")
    assert browser.evaluate("location.hash") == f"#step={other}/0"
    assert browser.evaluate("document.getElementById('step-result').textContent").startswith(
        "Rank 5 step 0: RESULT ALL PASS")
    # The modules of the open step on every rank: the fault rank's layers.0 is red.
    modules = browser.evaluate(
        "(m => Array.from({length: m.spec.rows}, (_, j) => m.spec.rowLabel(j)))"
        "(dynaprobeReport.heatmaps.modules)")
    assert sorted(modules) == ["layers.0", "layers.1"]
    def module_cell(module):
        return f"({PIXEL})(dynaprobeReport.heatmaps.modules, {fault}, {modules.index(module)})"

    assert browser.evaluate(module_cell("layers.0")) == FAIL_RGB
    assert browser.evaluate(module_cell("layers.1")) != FAIL_RGB
    assert browser.errors() == []


def test_the_chart_shows_the_error_relative_to_the_tolerance_with_the_threshold_at_1(
        ranks_run, browser):
    html, report, (x, y) = ranks_run
    open_report(browser, html)
    step = next(r for r in report["ranks"] if r["rank"] == FAULT_RANK)["steps"][0]
    rows = {row["module"]: row for row in step["rows"]}
    # max |diff| / (atol + rtol * |compiled|), computed here in float32 as torch.isclose does.
    tolerances = rows["layers.0"]["tolerances"] or step["tolerances"]
    allowed = np.float32(tolerances["atol"]) + np.abs(np.float32(tolerances["rtol"]) * y)
    ratio = float((np.abs(x - y) / allowed).max())
    assert rows["layers.0"]["metrics"]["max_tol_ratio"] == pytest.approx(ratio, rel=1e-6)
    assert ratio > 1 and rows["layers.0"]["status"] == "FAIL"
    assert browser.evaluate("dynaprobeReport.state.metric") == "tol_ratio"
    assert browser.evaluate("document.getElementById('metric-tol_ratio').className") == "active"
    chart = "Chart.getChart('error-chart')"
    assert browser.evaluate(f"{chart}.options.scales.y.title.text") == (
        "|diff| / (atol + rtol·|compiled|)")
    threshold = browser.evaluate(f"{chart}.data.datasets.filter(d => !d.rows)"
                                 ".map(d => [d.label, d.data.map(p => p.y)])")
    assert threshold == [["threshold=1", [1, 1]]]
    points = dict(browser.evaluate(f"{chart}.data.datasets.filter(d => d.rows)"
                                   ".flatMap(d => d.data.map(p => [p.index, p.y]))"))
    by_module = {step["rows"][index]["module"]: y for index, y in points.items()}
    assert by_module["layers.0"] == pytest.approx(ratio, rel=1e-6)
    # The near-zero output passes: far below the threshold here, far above rtol as max_rel.
    tiny = rows["layers.1"]
    assert tiny["status"] == "PASS" and by_module["layers.1"] < 0.01
    assert tiny["metrics"]["max_rel"] > 100 * step["tolerances"]["rtol"]


def test_a_heat_map_of_4096_ranks_scrolls_within_its_box(ranks_run, browser):
    """Beyond what fits the page, cells keep their smallest width and the bounded box scrolls;
    the canvas stays the size of the box, and a cell far to the right is still named."""
    html, _, _ = ranks_run
    open_report(browser, html)
    size = browser.evaluate("""(() => {
        const section = document.createElement('div');
        document.body.append(section);
        const box = document.createElement('div');
        box.className = 'heat-box';
        section.append(box);
        const failing = i => i === 4000;
        const map = new dynaprobeReport.HeatMap(box, {
          columns: 4096, rows: 8, minWidth: 2, minHeight: 4, corner: 'rank', label: 'test',
          columnLabel: i => i, rowLabel: j => `step ${j}`, failing,
          color: (i, j) => failing(i) && j === 3 ? '#d32f2f' : '#cfe8cf',
          describe: (i, j) => `rank ${i} step ${j}`, open: () => {}, current: null});
        window.bigMap = map;
        const rect = box.getBoundingClientRect();
        return {cell: map.cw, width: rect.width, height: rect.height, page: innerWidth,
                scroll: box.scrollWidth, canvas: [map.canvas.width, map.canvas.height],
                labelled: map.columnStep}; })()""")
    assert size["cell"] == 2 and size["scroll"] > 4096 * 2
    assert size["width"] < size["page"] and size["height"] < 400
    assert size["canvas"][0] <= size["width"] and size["canvas"][1] <= size["height"]
    assert size["labelled"] >= 16
    assert browser.evaluate(f"({PIXEL})(bigMap, 4000, 3)") == FAIL_RGB
    point = browser.evaluate("bigMap.reveal(4000, 3)")
    assert browser.evaluate("bigMap.box.scrollLeft") > 0
    browser.hover(point["x"], point["y"])
    assert browser.wait_until("!document.getElementById('heat-tooltip').hidden && "
                              "document.getElementById('heat-tooltip').textContent") == (
        "rank 4000 step 3")
    assert browser.errors() == []


def test_with_a_reference_the_chart_shows_the_error_in_units_of_the_noise(
        tmp_path, dynaprobe_cli, browser):
    """A step whose rows have a reference opens on the compiled error in units of the noise,
    the quantity that decided them, with the rule's factor 2 as the threshold."""
    rng = np.random.default_rng(7)
    exact = rng.standard_normal(64)
    eager = (exact + rng.standard_normal(64) * 1e-3).astype(np.float32)  # eager's own error
    records = []
    for module, compiled in (("good", exact + rng.standard_normal(64) * 1e-3),
                             ("bad", exact * 1.05)):
        for side, dtype, value in (("eager", "float32", eager),
                                   ("compiled", "float32", compiled.astype(np.float32)),
                                   ("reference", "float64", exact)):
            records.append((module, 0, "fwd_output", 0, side, "", dtype, value))
    _C.write_step(str(tmp_path / "dump"), 0, {"mode": "single_pass"}, records, [])
    html, json_path = tmp_path / "r.html", tmp_path / "r.json"
    proc = subprocess.run([dynaprobe_cli, "compare", str(tmp_path / "dump"), "--html", str(html),
                           "--json", str(json_path)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {r["module"]: r for r in json.loads(json_path.read_text())["ranks"][0]["steps"][0]["rows"]}
    units = {module: rows[module]["reference"]["noise_units"] for module in ("good", "bad")}
    assert units["good"] < 2 < units["bad"] and rows["bad"]["status"] == "FAIL"
    open_report(browser, html)
    assert browser.errors() == []
    assert browser.evaluate("dynaprobeReport.state.metric") == "noise"
    chart = "Chart.getChart('error-chart')"
    threshold = browser.evaluate(f"{chart}.data.datasets.filter(d => !d.rows)"
                                 ".map(d => [d.label, d.data.map(p => p.y)])")
    assert threshold == [["factor=2", [2, 2]]]
    points = dict(browser.evaluate(f"{chart}.data.datasets.filter(d => d.rows)"
                                   ".flatMap(d => d.data.map(p => [p.index, p.y]))"))
    step = json.loads(json_path.read_text())["ranks"][0]["steps"][0]
    by_module = {step["rows"][index]["module"]: y for index, y in points.items()}
    assert by_module == pytest.approx(units, rel=1e-6)
    # The step's RESULT names the rule that decided, as the text report's RESULT line does.
    result = browser.evaluate("document.getElementById('step-result').textContent")
    assert ("RESULT FAILED (2 compared; 1 FAIL, 0 WARN, 1 pass only within reference noise; "
            "reference: noise within 2x)") in result
    assert step["result_details"] in proc.stdout
