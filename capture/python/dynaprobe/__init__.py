"""dynaprobe: find where torch.compile changes a PyTorch model's numbers.

    from dynaprobe import PrecisionChecker

The C++ core lives in ``dynaprobe._C``; this package is its thin Python front end.
"""

from __future__ import annotations

import os

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from dynaprobe._C import DumpIOError, FormatError, format_version
from dynaprobe._checking.checker import PrecisionChecker
from dynaprobe._results.assertions import assert_precision
from dynaprobe._results.result import CompareResult, ModuleDiff, Row, TensorDiff
from dynaprobe._results.run import RunReport, analyze_run

# Keep in sync with pyproject.toml's version and CMakeLists.txt's project(VERSION), which
# `dynaprobe --version` prints (tests/python/test_cli.py checks all three).
__version__ = "0.1.0"

__all__ = [
    "CompareResult",
    "DumpIOError",
    "FormatError",
    "ModuleDiff",
    "PrecisionChecker",
    "Row",
    "RunReport",
    "TensorDiff",
    "__version__",
    "analyze_run",
    "assert_precision",
    "format_version",
    "hdf5_plugin_dir",
]


def hdf5_plugin_dir() -> str:
    """Returns the folder holding dynaprobe's zstd HDF5 filter plugin.

    Point ``HDF5_PLUGIN_PATH`` at it so that ``h5dump`` and other HDF5 programs read dumps.
    """
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins")
