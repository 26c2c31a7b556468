#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), lints, then runs all tests: GoogleTest through ctest,
# and pytest.
# Arguments go to pytest: `bash scripts/test.sh -m "not slow"` leaves out the slow real-model
# cases (inductor on transformers models) for a quick run while you work.
# pytest runs in two worker processes (pytest-xdist), a test file per worker at a time so that a
# file's shared fixtures are built once: Dynamo's tracing and the tests' child processes are mostly
# single-threaded, so two workers take about half the time on two cores. `-n 0` runs in one.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
cd "$repo"
# Lint first, it takes seconds: ruff over the Python ([tool.ruff] in pyproject.toml: pyflakes and
# sorted imports), clang-format over the C++ (.clang-format).
"$repo/.venv/bin/ruff" check capture/python tests bench examples scripts
git ls-files -z '*.cpp' '*.h' | xargs -0 -r clang-format --dry-run --Werror
ctest --test-dir build --output-on-failure -j 2
"$repo/.venv/bin/python" -m pytest -q -n 2 --dist loadfile --durations=15 tests/python "$@"
