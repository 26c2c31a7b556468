"""Shared pytest fixtures."""

import os
import sys

# Tests import the installed package (scripts/setup.sh installs it into .venv); fail clearly if not.
try:
    import dynaprobe  # noqa: F401
except ImportError as error:  # pragma: no cover - set-up problem, not a test result
    sys.exit(f"cannot import dynaprobe ({error}); run `bash scripts/test.sh` to build and install it")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
