"""The Python package's rooms import downward only, and training never loads offline diagnosis.

``capture/python/dynaprobe/``, top to bottom (docs/design.md draws it):

- the public modules: ``__init__`` (the API), ``pytest_plugin``, and the commands ``repro``,
  ``bisect``, ``remedy``, ``bundle`` (thin, over ``_offline``);
- ``_checking``: the façade (``PrecisionChecker``), its options, and confirming a remedy;
- ``_offline``: replays, op localisation, repro folders, bisection, remedies, bundles;
- ``_modes``: single-pass, whole-model, two-pass;
- ``_steps``: the session, the step, planning, compiling;
- ``_results``: compared rows, runs, reports, assertions;
- ``_mechanics``: probes, isolation, the reference, graphs, replay data, the dump folder's
  committed steps, distributed facts;
- the base: the extension ``_C`` (and its ``vocabulary``, the names from C++).

A module may import its own room and the rooms below it, at module level or inside a function.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "capture" / "python" / "dynaprobe"
ROOMS = ["", "_checking", "_offline", "_modes", "_steps", "_results", "_mechanics", "_base"]
BASE = {"_C"}
TRAINING = ["_modes", "_steps", "_results", "_mechanics"]


def _room(module: str) -> str:
    """The room of ``dynaprobe.<module>`` (dotted, without the package name)."""
    first = module.split(".")[0]
    if first in BASE:
        return "_base"
    return first if first in ROOMS else ""


def _imports(path: pathlib.Path):
    """The dynaprobe modules ``path`` imports (relative to the package), with their lines."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module == "dynaprobe" or node.module.startswith("dynaprobe.")):
            base = node.module[len("dynaprobe."):] if node.module != "dynaprobe" else ""
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dynaprobe."):
                    yield node.lineno, alias.name[len("dynaprobe."):]


def test_the_rooms_import_downward_only():
    upward = []
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 30
    for path in modules:
        relative = path.relative_to(PACKAGE).with_suffix("")
        own = _room(".".join(relative.parts))
        for line, imported in _imports(path):
            room = _room(imported)
            if ROOMS.index(room) < ROOMS.index(own):
                upward.append(f"{path.relative_to(PACKAGE)}:{line} ({own or 'public'}) imports "
                              f"dynaprobe.{imported} ({room or 'public'})")
    assert not upward, "\n".join(upward)
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(ROOMS) - {"", "_base"}, rooms


def test_a_checked_training_step_loads_nothing_of_offline_diagnosis():
    """The rooms used while training stay below ``_offline``, and at run time a checked step
    (single-pass, replay data kept for failing calls) imports none of it."""
    for room in TRAINING:
        assert ROOMS.index(room) > ROOMS.index("_offline")
    script = textwrap.dedent("""
        import sys, tempfile
        import torch, torch.nn as nn
        from dynaprobe import PrecisionChecker
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        checker = PrecisionChecker(backend="aot_eager", dump_dir=tempfile.mkdtemp(),
                                   replay="failing")
        checker.wrap_all_children(model, depth=0)
        checker.install(model)
        loss = model(torch.randn(2, 4)).square().mean()
        loss.backward()
        assert checker.collect(loss).all_pass
        checker.uninstall()
        print(sorted(m for m in sys.modules if m.startswith("dynaprobe.")))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    loaded = done.stdout.strip().splitlines()[-1]
    assert "dynaprobe._modes.single_pass" in loaded, loaded
    for offline in ("dynaprobe._offline", "dynaprobe.repro", "dynaprobe.bisect",
                    "dynaprobe.bundle"):
        assert f"'{offline}" not in loaded, loaded


def test_no_module_is_over_500_lines():
    """A module that grows past 500 lines holds more than one thing: split it by what its parts
    are for."""
    long = {str(path.relative_to(PACKAGE)): lines for path in sorted(PACKAGE.rglob("*.py"))
            if (lines := len(path.read_text().splitlines())) > 500}
    assert not long, long


def test_the_folder_layout_is_named_by_cpp_alone():
    """The rank folders of a run and the default folder of runs are formats/schema.h's names,
    read as dynaprobe._C.vocabulary.RANK_DIR_PREFIX and RUNS_DIR: no Python code (docstrings
    aside) spells "dynaprobe_runs" or a "rank<R>" folder name itself."""
    import re

    from dynaprobe._C.vocabulary import RANK_DIR_PREFIX, RUNS_DIR

    assert (RANK_DIR_PREFIX, RUNS_DIR) == ("rank", "dynaprobe_runs")
    spelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                           ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings
                    and re.search(r"dynaprobe_runs|(^|/)rank(\d|$)", node.value)):
                spelled.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    assert not spelled, spelled


def test_each_installed_mode_is_an_installation(tmp_path):
    """What PrecisionChecker and StepSession.collect ask of an installed mode is one contract
    (``Installation``), which single-pass and whole-model mode both fulfil, member for member."""
    import inspect

    import torch
    import torch.nn as nn

    from dynaprobe import PrecisionChecker
    from dynaprobe._steps.session import Installation

    kinds = set()
    for whole in (False, True):
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        checker = PrecisionChecker(dump_dir=str(tmp_path / f"whole_{whole}"))
        checker.wrap(model[0])
        checker.install(torch.compile(model, backend="aot_eager") if whole else model)
        installation = checker._installation
        kinds.add(type(installation).__name__)
        assert isinstance(installation, Installation)
        for name in ("finish", "conclude", "remove"):
            assert (inspect.signature(getattr(type(installation), name))
                    == inspect.signature(getattr(Installation, name))), name
        assert installation.session is not None and len(installation.targets) == 1
        checker.uninstall()
    assert kinds == {"SinglePass", "WholeModel"}
