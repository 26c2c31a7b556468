#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs all tests: GoogleTest through ctest, and pytest.
# Arguments go to pytest: `bash scripts/test.sh -m "not slow"` leaves out the slow real-model
# cases (inductor on transformers models) for a quick run while you work.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
cd "$repo"
ctest --test-dir build --output-on-failure -j 2
"$repo/.venv/bin/python" -m pytest -q tests/python "$@"
