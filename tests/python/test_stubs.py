"""The type stubs of dynaprobe._C, generated at build time (capture/CMakeLists.txt), match the
module: they are what pybind11-stubgen writes of the imported module now, byte for byte (a binding
whose signature or docstring changed without regenerating them fails), and mypy's stubtest finds
every name of the module in them and nothing else (it cannot read pybind11 signatures itself)."""

import os
import subprocess
import sys

import pytest

import dynaprobe
from dynaprobe import _C


def pybind11_artefact(error: str) -> bool:
    """Whether a line of stubtest's output (--concise) is a difference every pybind11 module has
    from the stubs pybind11-stubgen writes, rather than a stale stub."""
    name, _, message = error.partition(" ")
    path = name.split(".")[2:]  # dynaprobe._C.<path>
    if message == "is not present at runtime" and path[-1:] == ["__all__"]:
        return True  # stubgen lists the module's names in __all__, which the module does not set
    if len(path) == 1 and message == "is inconsistent, metaclass differs":
        # Every bound class has pybind11's metaclass, which stubs do not declare.
        return type(getattr(_C, path[0])).__name__ == "pybind11_type"
    if len(path) == 2 and path[1] == "__init__" and "does not have *args" in message:
        # A class bound without a constructor (Python never makes one) has pybind11's
        # __init__(self, *args, **kwargs), which raises; its stub rightly declares none.
        with pytest.raises(TypeError, match="No constructor defined"):
            getattr(_C, path[0])()
        return True
    return False


PACKAGE = os.path.dirname(os.path.abspath(dynaprobe.__file__))
STUBS = os.path.join(PACKAGE, "_C")
STUB_FILES = ("__init__.pyi", "vocabulary.pyi")
REBUILD = "rebuild and install the package to regenerate them (scripts/setup.sh)"


def test_the_stubs_are_what_the_module_gives_now(tmp_path):
    assert os.path.isfile(os.path.join(PACKAGE, "py.typed"))
    result = subprocess.run(
        [sys.executable, "-m", "pybind11_stubgen", "--exit-code", "-o", str(tmp_path),
         "dynaprobe._C"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in STUB_FILES:
        installed = os.path.join(STUBS, name)
        assert os.path.isfile(installed), f"{installed} is missing: {REBUILD}"
        with open(installed) as f, open(tmp_path / "dynaprobe" / "_C" / name) as g:
            assert f.read() == g.read(), f"{installed} is stale: {REBUILD}"


def test_the_extension_module_matches_its_stubs(tmp_path):
    # mypy sees the stubs alone, under a stub package of their own: not the package's Python
    # modules, and torch only by name (analysing torch would take minutes).
    root = tmp_path / "stubs" / "dynaprobe"
    root.mkdir(parents=True)
    (root / "__init__.pyi").write_text("")
    os.symlink(STUBS, root / "_C")
    config = tmp_path / "mypy.ini"
    config.write_text(f"[mypy]\ncache_dir = {tmp_path / 'cache'}\n"
                      "[mypy-torch.*]\nfollow_imports = skip\n")
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "dynaprobe._C", "--concise",
         "--mypy-config-file", str(config)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, MYPYPATH=str(tmp_path / "stubs")))
    errors = [line for line in result.stdout.splitlines() if not pybind11_artefact(line)]
    assert result.returncode in (0, 1) and not result.stderr.strip() and not errors, (
        f"dynaprobe._C does not match its stubs in {STUBS}: {REBUILD}\n" + "\n".join(errors)
        + result.stderr)
