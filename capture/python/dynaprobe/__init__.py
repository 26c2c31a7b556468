"""dynaprobe: find where torch.compile changes a PyTorch model's numbers.

The C++ core lives in ``dynaprobe._C``; this package is its thin Python front end.
"""

from __future__ import annotations

import os

from dynaprobe._C import DumpIOError, FormatError, format_version

__all__ = ["DumpIOError", "FormatError", "format_version", "hdf5_plugin_dir"]


def hdf5_plugin_dir() -> str:
    """Returns the folder holding dynaprobe's zstd HDF5 filter plugin.

    Point ``HDF5_PLUGIN_PATH`` at it so that ``h5dump`` and other HDF5 programs read dumps.
    """
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins")
