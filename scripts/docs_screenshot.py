"""Makes docs/images/html-report.png: the HTML report of a real training run, as a browser shows
it. Run from the repository root with the project's Python after scripts/setup.sh:

    .venv/bin/python scripts/docs_screenshot.py

A small language model (tests/python/models.py's TinyTransformer, 4 blocks) trains 3 steps
under a backend that makes GELU 1% larger (a fake compiler bug), with every block's sub-modules
wrapped; the report is drilled into the first failing row, as a click on its point does.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "python"))

from browser import Browser
from models import TinyTransformer, perturbed_gelu_backend

from dynaprobe import PrecisionChecker


def main() -> None:
    work = pathlib.Path(tempfile.mkdtemp(prefix="dynaprobe-screenshot-"))
    torch.manual_seed(0)
    model = TinyTransformer(layers=4)
    checker = PrecisionChecker(backend=perturbed_gelu_backend, dump_dir=str(work / "run"))
    checker.wrap_all_children(model, depth=1)
    ids = torch.randint(0, 50, (2, 16))

    def step(m):
        m.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        return loss

    for _ in range(3):
        checker.compare(step, model)
    cli = os.environ.get("DYNAPROBE_CLI") or os.path.join(os.path.dirname(sys.executable),
                                                          "dynaprobe")
    html, report = work / "report.html", work / "report.json"
    # Exit 1: the fault makes rows FAIL, which is what the screenshot shows.
    subprocess.run([cli, "compare", str(work / "run"), "--html", str(html), "--json", str(report)],
                   capture_output=True, check=False)
    cause = json.loads(report.read_text())["ranks"][0]["steps"][0]["root_cause"]["forward"]
    rows = json.loads(report.read_text())["ranks"][0]["steps"][0]["rows"]
    index = next(i for i, r in enumerate(rows) if r["module"] == cause["module"]
                 and r["check_type"] == cause["check_type"] and r["call"] == cause["call"])
    with Browser(width=1280, height=1600) as browser:
        browser.open(html.as_uri() + f"#row=0/0/{index}")
        browser.wait_until("document.body.dataset.ready === 'true'")
        assert browser.errors() == [], browser.errors()
        browser.evaluate("window.scrollTo(0, 0)")
        browser.screenshot(str(REPO / "docs" / "images" / "html-report.png"))
    print(REPO / "docs" / "images" / "html-report.png")


if __name__ == "__main__":
    main()
