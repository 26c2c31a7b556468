"""``assert_precision``: a CompareResult as a test assertion (the pytest plugin's helper)."""

from __future__ import annotations

import math
import os
from typing import Optional

from dynaprobe._C import vocabulary


def _section(text: str, title: str) -> str:
    """The text report's section ``title`` (its heading to the next ``====`` rule or the end)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == title), None)
    if start is None:
        return ""
    out = []
    for line in lines[start:]:
        if line.strip().startswith("====="):
            break
        out.append(line)
    return "\n".join(out).rstrip()


def _number(value: float) -> str:
    return "nan" if value is None or math.isnan(value) else f"{value:.3e}"


def assert_precision(result, html_path: Optional[str] = None, max_rows: int = 20) -> None:
    """Raises AssertionError unless ``result`` (a ``CompareResult``) passes.

    The message holds the report's RESULT line, its ROOT CAUSE section, the rows that FAIL or
    WARN (module, call, check, index, max_abs; at most ``max_rows``) and the path of the HTML
    report, written first to ``html_path`` (default: ``<dump_dir>-step<N>.html``, beside the
    dump folder). A result of None (collect() on a step that was not checked) is a TypeError.
    """
    __tracebackhide__ = True  # pytest shows the test's line, not this helper's
    if result is None:
        raise TypeError("assert_precision() needs a CompareResult, not None (collect() returns "
                        "None on steps that are not checked)")
    if result.all_pass:
        return
    text = result.text()
    result_line = next((line.strip() for line in text.splitlines() if "RESULT:" in line),
                       f"RESULT: {vocabulary.VERDICT_FAILED}")
    parts = [f"dynaprobe: {result_line}"]
    root_cause = _section(text, "ROOT CAUSE")
    if root_cause:
        parts.append(root_cause)
    failures = result.failures
    if failures:
        rows = ["  failing rows (status, module, call, check[index], max_abs, note):"]
        for row in failures[:max_rows]:
            note = f"  {row.note}" if row.note else ""
            rows.append(f"  {row.status:<4}  {row.module} call={row.call} {row.check_type}"
                        f"[{row.tensor_index}] max_abs={_number(row.max_abs)}{note}")
        if len(failures) > max_rows:
            rows.append(f"  ... and {len(failures) - max_rows} more")
        parts.append("\n".join(rows))
    if html_path is None:
        html_path = f"{os.path.normpath(result.dump_dir)}-step{result.step}.html"
    try:
        html = result.render("html")
        with open(html_path, "w", encoding="utf-8") as file:
            file.write(html)
        parts.append(f"  HTML report: {html_path}")
    except Exception as error:  # the assertion's message matters more than the report file
        parts.append(f"  HTML report not written: {type(error).__name__}: {error}")
    if result.dump_file:
        parts.append(f"  dump: dynaprobe compare {result.dump_dir} --step {result.step}")
    raise AssertionError("\n".join(parts))
