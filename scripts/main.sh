#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the main job: one training step of a small
# transformer compiled by inductor, checked by dynaprobe (examples/main_job.py), with its report.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
cd "$repo"
"$repo/.venv/bin/python" examples/main_job.py "$@"
