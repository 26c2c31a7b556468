#!/usr/bin/env bash
# Sets up everything dynaprobe needs on a fresh Debian 12 machine, idempotently:
#   1. Debian packages (HDF5, zstd, xxHash, zlib, oneTBB, CLI11, GoogleTest, h5dump, compilers'
#      helpers, clang with libFuzzer for the fuzz test;
#      Chart.js, embedded in HTML reports, and Chromium, the browser their tests open them in);
#   2. a project-local virtual environment .venv with torch==2.13.0 (CPU) and the test tools;
#   3. one CMake build in build/ (library, CLI, tests, benchmarks, Python extension), installed
#      into .venv with pip so that `import dynaprobe` works.
# Fast when nothing changed. Source it or run it; it exits on the first error.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

apt_packages=(cmake ninja-build g++ pkg-config libhdf5-dev libzstd-dev libxxhash-dev libtbb-dev
              libcli11-dev libgtest-dev hdf5-tools zlib1g-dev libjs-chart.js chromium
              clang libclang-rt-14-dev clang-format)
missing=()
for package in "${apt_packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Python packages: torch is pinned to the CPU build; never let a range pull a CUDA build.
# pybind11-stubgen writes dynaprobe._C's type stubs at build time; mypy's stubtest checks them;
# ruff lints the Python (scripts/test.sh).
python_requirements="torch==2.13.0 numpy pytest pytest-xdist h5py hdf5plugin scikit-build-core>=0.10 transformers==5.24.0 diffusers==0.42.1 dask distributed pybind11-stubgen==3.0.0 mypy==1.20.2 ruff==0.17.6"
venv="$repo/.venv"
stamp="$venv/.dynaprobe-requirements"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$python_requirements" ]; then
  echo "setup: creating $venv with $python_requirements"
  python3 -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q $python_requirements
  echo "$python_requirements" > "$stamp"
fi

# One build tree for everything: pip drives CMake (scikit-build-core) in build/, with the
# developer targets on, and installs the package into .venv.
"$venv/bin/pip" install -q --no-build-isolation --no-deps \
  -C build-dir=build \
  -C cmake.define.DYNAPROBE_BUILD_TESTS=ON \
  -C cmake.define.DYNAPROBE_BUILD_BENCH=ON \
  -C cmake.define.DYNAPROBE_BUILD_EXAMPLES=ON \
  "$repo"
