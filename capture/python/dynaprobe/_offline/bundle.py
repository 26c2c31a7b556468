"""``dynaprobe bundle DUMP -o report.tar.gz`` (``python -m dynaprobe.bundle``): one archive to
attach to an issue (docs/guide/bug-reports.md).

It holds the reports of the dump's failing steps (text, HTML, JSON), where the dump was captured
(provenance, environment, the inductor config set away from its defaults), the graphs Dynamo and
AOTAutograd made of each failing module, and a repro folder for the first few failing modules in
root-cause order, each replaying the captured graph with torch alone (``dynaprobe repro``). It
takes only the records those repros need and stays under a size limit (25 MB by default, GitHub's
attachment limit), leaving out what does not fit and saying so in its README.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from dynaprobe import _C
from dynaprobe._C import vocabulary
from dynaprobe._mechanics.environment import environment
from dynaprobe._offline.replay import (
    chosen_dump,
    failing_modules,
    replay_attributes,
    step_files,
    step_result,
)
from dynaprobe._offline.repro import needs, write_repro
from dynaprobe._offline.stored_call import BACKEND_HELP, ReplayError, named_backend
from dynaprobe._results.result import CompareResult

LIMIT_MB = 25.0  # GitHub's limit for a file attached to an issue
REPROS = 3
BISECT_SECONDS = 1800  # CompilerBisector on one repro: it compiles many times


@dataclass
class Bundle:
    """What a bundle holds: its path, the modules with a repro, and what was left out (why)."""

    path: str
    repros: List[str] = field(default_factory=list)
    left_out: List[str] = field(default_factory=list)
    size: int = 0


def write_bundle(dump: str, output: str, repros: int = REPROS, limit_mb: float = LIMIT_MB,
                 step: Optional[int] = None, backend: Optional[str] = None,
                 bisect: bool = False) -> Bundle:
    """Writes the bundle of a dump folder (or step file) to ``output`` (a .tar.gz).

    Args:
        dump: the dump folder of one process (or one step file).
        output: the archive to write.
        repros: how many failing modules get a repro folder, in root-cause order.
        limit_mb: the archive's size limit in MB; what does not fit is left out and said.
        step: the step to report (default: every step with a failing row; the first step when
            none fails).
        backend: the backend the repros compile with instead of the recorded one (a
            registered name or ``module:attribute``: ``--backend``).
        bisect: run each repro's ``--bisect`` (torch._inductor.compiler_bisector on its
            test_fn; compiles many times: slow) and carry its table and replay line.
    """
    if backend is not None:
        named_backend(backend)  # found here, or the error naming it
    results = []
    for index, path in step_files(dump, step):
        results.append((index, path, step_result(index, path)))
    chosen = [r for r in results if not r[2].all_pass] or results[:1]
    with tempfile.TemporaryDirectory(prefix="dynaprobe-bundle-") as staging:
        parts: List[tuple] = []  # (priority, archive path, file on disk, what it is)
        failing: List[tuple] = []  # (step, module, step file, its replay attribute or None)
        provenance: Dict[str, str] = {}
        for index, path, result in chosen:
            info = _C.read_step(path)
            provenance = dict(info["provenance"])
            name = f"step_{index}"
            for kind, text in (("txt", result.text()), ("json", result.render("json")),
                               ("html", result.render("html"))):
                parts.append((0 if kind != "html" else 2, f"reports/{name}.{kind}",
                              _staged(staging, f"{name}.{kind}", text), f"{name} {kind} report"))
            modules = failing_modules(result)
            replays = replay_attributes(info)
            failing += [(index, m, path, replays.get(m)) for m in modules]
            parts += _graph_parts(staging, info, modules, name)
        environment_text = json.dumps({
            "captured": provenance,
            "inductor_config": _inductor_config(failing),
            "bundled_on": {vocabulary.PROVENANCE_TORCH_VERSION: torch.__version__, **environment()},
        }, indent=1, sort_keys=True)
        parts.append((0, "environment.json", _staged(staging, "environment.json",
                                                     environment_text), "environment"))
        parts.append((0, "collect_env.txt", _staged(staging, "collect_env.txt", _collect_env()),
                      "environment"))
        issue = suggested_issue(chosen[0][2], provenance, _inductor_config(failing))
        made, skipped, needed = [], [], {}  # needed: repro folder -> what it needs, in words
        bisected: Dict[str, List[str]] = {}  # repro folder -> CompilerBisector's finding
        for index, module, path, replay in failing:
            if len(made) >= repros:
                break
            if replay is None:
                skipped.append(f"repro of {module} (step {index}): the dump keeps no replay data "
                               "of it")
                continue
            folder = os.path.join(staging, "repros", _safe(f"{module}.step{index}"))
            try:
                write_repro(path, module, folder, step=index, backend=backend)
            except (ReplayError, OSError, ValueError) as error:
                skipped.append(f"repro of {module} (step {index}): {error}")
                continue
            made.append(module)
            needed[os.path.basename(folder)] = needs(replay, backend)
            if bisect:
                bisected[os.path.basename(folder)] = _compiler_bisector(folder)
            for file in sorted(os.listdir(folder)):
                parts.append((1 + len(made), f"repros/{os.path.basename(folder)}/{file}",
                              os.path.join(folder, file), f"repro of {module} (step {index})"))
        return _archive(output, parts, made, skipped, int(limit_mb * 1e6), provenance, needed,
                        issue, bisected)


# What a kind of row is, in an issue title.
_ROW_WORDS = {vocabulary.KIND_FWD_OUTPUT: "forward output",
              vocabulary.KIND_GRAD_INPUT: "input gradient",
              vocabulary.KIND_PARAM_GRAD: "parameter gradient"}


def suggested_issue(result: CompareResult, provenance: Dict[str, str],
                    inductor_config: Dict[str, object]) -> Tuple[str, List[str]]:
    """A title for the upstream issue, from the step's root cause, and the labels PyTorch's
    compiler team triages numerics reports by."""
    backend = provenance.get(vocabulary.PROVENANCE_BACKEND, "?")
    root = result.root_cause or {}
    finding = root.get("forward") or root.get("backward")
    title = f"torch.compile(backend=\"{backend}\") changes the numbers of a training step"
    if finding:
        row = next((r for r in result.rows if r.module == finding["module"]
                    and r.check_type == finding["check_type"]
                    and r.tensor_index == finding["tensor_index"]), None)
        what = _ROW_WORDS.get(finding["check_type"], finding["check_type"])
        title = (f"torch.compile(backend=\"{backend}\") changes the {what} of "
                 f"{finding['module']}" + (f" (max_rel {row.max_rel:.3g}, max_abs "
                                           f"{row.max_abs:.3g} against eager)" if row else ""))
    labels = ["module: pt2 accuracy", "oncall: pt2"]
    if backend == "inductor" or inductor_config:
        labels.append("module: inductor")
    return title, labels


BISECTOR_LOG = "compiler_bisector.txt"


def _compiler_bisector(folder: str) -> List[str]:
    """Runs ``repro.py --bisect`` in a repro folder, where this process finds its modules (the
    user's backend, say), keeps its output beside the repro and returns its finding: the
    first-to-differ and replay lines, or why it did not run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        run = subprocess.run([sys.executable, "repro.py", "--bisect"], cwd=folder, env=env,
                             capture_output=True, text=True, timeout=BISECT_SECONDS)
    except subprocess.TimeoutExpired:
        return [f"CompilerBisector did not finish in {BISECT_SECONDS} s"]
    with open(os.path.join(folder, BISECTOR_LOG), "w", encoding="utf-8") as log:
        log.write(run.stdout + run.stderr)
    found = [line for line in run.stdout.splitlines()
             if line.startswith(("first to differ:", "replay:", "no backend or subsystem"))]
    return found or [f"CompilerBisector failed (exit {run.returncode}): see {BISECTOR_LOG}"]


def _collect_env() -> str:
    """What ``python -m torch.utils.collect_env`` prints, on the machine making the bundle."""
    from torch.utils import collect_env  # noqa: PLC0415 - runs pip and others: only here

    try:
        return collect_env.get_pretty_env_info() + "\n"
    except Exception as error:  # an odd machine: said, the bundle is still written
        return f"torch.utils.collect_env failed here: {type(error).__name__}: {error}\n"


def _graph_parts(staging: str, info: dict, modules: List[str], step: str) -> List[tuple]:
    """The stored graphs of the failing modules' compiled functions, as .py files."""
    functions = {}
    for module, attributes in info.get("modules", []):
        if module in modules:
            for function in attributes.get("compiled_functions", "").split(","):
                if function:
                    functions[function] = module
    parts = []
    for name, kind, text, _ in info.get("graphs", []):
        function = name.split(".")[0]
        if function in functions:
            file = f"{_safe(name)}.py"
            body = f"# {name}: {kind} graph of {functions[function]}\n{text}"
            parts.append((1, f"graphs/{step}/{file}", _staged(staging, f"{step}.{file}", body),
                          f"graph {name}"))
    return parts


def _inductor_config(failing: List[tuple]) -> Dict[str, object]:
    """The inductor config the first failing module with replay data was compiled with."""
    for *_, replay in failing:
        if replay and "inductor_config" in replay:
            return replay["inductor_config"]
    return {}


def _staged(staging: str, name: str, text: str) -> str:
    path = os.path.join(staging, "files", name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]", "_", name)[:120]


def _archive(output: str, parts: List[tuple], made: List[str], skipped: List[str], limit: int,
             provenance: Dict[str, str], needed: Dict[str, str],
             issue: Tuple[str, List[str]], bisected: Dict[str, List[str]]) -> Bundle:
    """Writes the archive, leaving out the least important parts (the later repros, then the
    HTML reports, then the graphs) until it fits ``limit`` bytes."""
    bundle = Bundle(output, list(made))
    kept = sorted(parts, key=lambda part: part[0])
    while True:
        data = _tar(kept, _readme(kept, bundle, skipped, provenance, limit, needed, issue,
                                  bisected))
        if len(data) <= limit or len(kept) <= 1:
            break
        worst = max(part[0] for part in kept)
        dropped = [part for part in kept if part[0] == worst]
        kept = [part for part in kept if part[0] != worst]
        whats = sorted({part[3] for part in dropped})
        bundle.left_out += [f"{what}: the bundle would pass {limit / 1e6:g} MB" for what in whats]
        bundle.repros = [m for m in bundle.repros if not any(
            what.startswith(f"repro of {m} ") for what in whats)]
    with open(output, "wb") as f:
        f.write(data)
    bundle.left_out += skipped
    bundle.size = len(data)
    return bundle


def _tar(parts: List[tuple], readme: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for _, name, path, _ in [(0, "README.md", None, "")] + parts:
            if path is None:
                payload = readme.encode()
                entry = tarfile.TarInfo(f"dynaprobe_bundle/{name}")
                entry.size = len(payload)
                entry.mode = 0o644
                tar.addfile(entry, io.BytesIO(payload))
            else:
                tar.add(path, arcname=f"dynaprobe_bundle/{name}", recursive=False)
    return buffer.getvalue()


def _readme(parts: List[tuple], bundle: Bundle, skipped: List[str],
            provenance: Dict[str, str], limit: int, needed: Dict[str, str],
            issue: Tuple[str, List[str]], bisected: Dict[str, List[str]]) -> str:
    repro_folders = sorted({name.split("/")[1] for _, name, _, _ in parts
                            if name.startswith("repros/")})
    machine = ", ".join(provenance[key] for key in ("os", "cpu", "gpu") if provenance.get(key))
    lines = ["# dynaprobe bundle", "",
             f"Captured with torch {provenance.get('torch_version', '?')}, backend "
             f"{provenance.get('backend', '?')}" + (f", on {machine}" if machine else "") + ".",
             "",
             f"Suggested issue title: {issue[0]}", "",
             f"Labels: {', '.join(f'`{label}`' for label in issue[1])}", "",
             "- `reports/`: the dump's report of each failing step (`.txt` as printed, `.json` "
             "every row and metric, `.html` to open in a browser).",
             "- `environment.json`: where it was captured (the dump's provenance), the inductor "
             "config set away from its defaults, and where this bundle was made.",
             "- `collect_env.txt`: `python -m torch.utils.collect_env` on the machine that made "
             "this bundle, as PyTorch's issue template asks for it.",
             "- `graphs/`: the graphs Dynamo captured and AOTAutograd derived for each failing "
             "module, as PyTorch names them.",
             "- `repros/`: one folder per failing module, in root-cause order: the call "
             "replayed from Dynamo's captured graph, eagerly and compiled."]
    if repro_folders:
        lines += ["", "## Running a repro", "",
                  "None needs model code or dynaprobe; each says below what it needs:", "",
                  "```bash"]
        lines += [f"python repros/{folder}/repro.py   # {needed.get(folder, 'needs only torch')}"
                  for folder in repro_folders]
        lines += ["```", "",
                  "It prints the metrics the dump recorded, then the replayed ones, and "
                  "`torch._dynamo.utils.same` of compiled against eager with a float64 replay as "
                  "the reference (PyTorch's accuracy check); it exits 1 when a replayed tensor "
                  "differs beyond the dump's tolerances. `import repro; repro.test_fn()` returns "
                  "that same() verdict: True when the compiled call matches. A custom backend is "
                  "imported from where it was defined; if it cannot be, pass a registered one "
                  "(`python repro.py --backend inductor`) or set `BACKEND` in the script."]
        lines += ["", "## CompilerBisector", ""]
        if bisected:
            for folder in repro_folders:
                lines += [f"`repros/{folder}` (its full output: `repros/{folder}/{BISECTOR_LOG}`):",
                          "", "```"] + bisected.get(folder, ["not run"]) + ["```", ""]
        else:
            lines.append("`python repro.py --bisect` in a repro folder runs "
                         "`torch._inductor.compiler_bisector` on its `test_fn()` and prints "
                         "what it tried, the backend, subsystem and application that make the "
                         "call differ, and the `TORCH_BISECT_*` line that replays it "
                         "(`dynaprobe bundle --bisect` runs it for every repro).")
    left = bundle.left_out + skipped
    if left:
        lines += ["", f"## Left out (limit {limit / 1e6:g} MB)", ""]
        lines += [f"- {what}" for what in left]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynaprobe.bundle",
        description="Writes one archive to attach to a bug report: the reports, the environment, "
                    "the failing modules' graphs and repros that run with torch alone.")
    parser.add_argument("dump", help="dump folder of one process (or one step file)")
    parser.add_argument("-o", "--output", required=True, help="the archive to write (.tar.gz)")
    parser.add_argument("--step", type=int, default=None, help="the step to report (default: "
                        "every step with a failing row)")
    parser.add_argument("--repros", type=int, default=REPROS, help="failing modules given a "
                        f"repro, in root-cause order (default {REPROS})")
    parser.add_argument("--max-mb", type=float, default=LIMIT_MB, help="size limit; what does "
                        f"not fit is left out and said (default {LIMIT_MB:g}, GitHub's limit)")
    parser.add_argument("--backend", default=None, metavar="MODULE:ATTRIBUTE",
                        help=BACKEND_HELP + " The repros import it where they run.")
    parser.add_argument("--bisect", action="store_true",
                        help="run torch._inductor.compiler_bisector on each repro's test_fn() "
                             "and carry its findings and TORCH_BISECT_* replay line (slow)")
    args = parser.parse_args(argv)
    try:
        bundle = write_bundle(chosen_dump("bundle", args.dump), args.output, args.repros,
                              args.max_mb, args.step, args.backend, args.bisect)
    except (ReplayError, OSError, ValueError, _C.FormatError) as error:
        print(f"dynaprobe bundle: {error}", file=sys.stderr)
        return 2
    print(f"Bundle written to: {bundle.path} ({_C.format_bytes(bundle.size)}; repros of "
          f"{', '.join(bundle.repros) or 'no module'})")
    for what in bundle.left_out:
        print(f"  left out: {what}")
    return 0

