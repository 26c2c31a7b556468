"""Where a dump was captured, for whoever reads it elsewhere (a bug report's bundle): Python,
operating system, CPU, and the accelerator with its CUDA version and driver where there is one.
Written into every step's provenance (docs/dump-format.md)."""

from __future__ import annotations

import functools
import platform
from typing import Dict

import torch

from dynaprobe._C import vocabulary


@functools.lru_cache(maxsize=None)
def environment() -> Dict[str, str]:
    found = {vocabulary.PROVENANCE_PYTHON_VERSION: platform.python_version(),
             vocabulary.PROVENANCE_OS: platform.platform(), vocabulary.PROVENANCE_CPU: _cpu_name()}
    if torch.version.cuda:
        found[vocabulary.PROVENANCE_CUDA_VERSION] = torch.version.cuda
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        found[vocabulary.PROVENANCE_GPU] = ", ".join(names)
        driver = _first_line("/proc/driver/nvidia/version")
        if driver:
            found[vocabulary.PROVENANCE_GPU_DRIVER] = driver
    return found


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _first_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip()
    except OSError:
        return ""
