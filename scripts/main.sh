#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the main job.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
cd "$repo"
./build/examples/format_roundtrip "${1:-$repo/dynaprobe_runs/format_roundtrip}"
