#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs all tests: GoogleTest through ctest, and pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
cd "$repo"
ctest --test-dir build --output-on-failure -j 2
"$repo/.venv/bin/python" -m pytest -q tests/python
