#!/usr/bin/env bash
# The GPU path, run for real (issue 56): on a bare GPU machine with the prepared .gpu/ beside the
# checkout (scripts/gpu_prepare.sh), builds dynaprobe against that machine's own torch from the
# prepared prefix only, installs the package into the build folder (never into the system), runs
# the GPU checks (pytest -m gpu tests/python/test_gpu.py) and the capture-cost figures in bf16 and
# float32 (bench/gpu_capture_cost.py), and writes a log and the figures into the out folder.
#
#   bash scripts/gpu_check.sh --out DIR            on the GPU machine (python3 with CUDA torch)
#   bash scripts/gpu_check.sh --dry-run --out DIR  here, on the CPU: the same build from the prefix
#        alone against the .venv's torch (ldd/readelf prove HDF5 etc. come from the prefix), the same
#        tests (the GPU ones on the CPU where they can), and a compile-only check of the torch-facing
#        translation units against torch 2.11's headers (build-gpu-torch211/, gpu_prepare.sh)
# Options: --prefix DIR (default .gpu/prefix)  --jobs N  --python PATH  --keep-build
# Files in DIR (flat): gpu_check.log, gpu_pytest.xml, gpu_capture_cost.json (bf16),
#   gpu_capture_cost_float32.json, main_job.txt.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

dry_run=0; out=""; prefix="$repo/.gpu/prefix"; jobs=""; python=""; keep_build=0
usage() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; }  # the comment block above
while (($#)); do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --out) out="$2"; shift ;;
    --out=*) out="${1#--out=}" ;;
    --prefix) prefix="$2"; shift ;;
    --prefix=*) prefix="${1#--prefix=}" ;;
    --jobs) jobs="$2"; shift ;;
    --python) python="$2"; shift ;;
    --keep-build) keep_build=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$out" ] || { echo "gpu_check: --out DIR is required (see --help)" >&2; exit 2; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
prefix="$(realpath -m "$prefix")"
gpu="$(dirname "$prefix")"
log="$out/gpu_check.log"
# Everything from here on is in the log as it happens, also when a time limit ends the run.
exec > >(tee "$log") 2>&1
tee_pid=$!
# At the end, the log's last lines are written before the script returns.
trap 'exec >&- 2>&-; wait "$tee_pid" 2>/dev/null || true' EXIT
set -o pipefail
start=$SECONDS
step() { echo; echo "=== gpu_check [$((SECONDS - start)) s] $*"; }
mode=$([ "$dry_run" = 1 ] && echo "dry run (CPU)" || echo "GPU")
step "$mode: $(uname -srm), $(nproc) cores, out $out"

# ------------------------------------------------------------------ preflight (seconds)
missing=()
# The prefix's links, made again where the transfer lost them (gpu_prepare.sh lists them).
if [ -f "$gpu/symlinks.tsv" ] && [ -d "$prefix" ]; then
  restored=0
  while IFS=$'\t' read -r path target; do
    if [ ! -e "$prefix/$path" ] && [ ! -L "$prefix/$path" ]; then
      mkdir -p "$(dirname "$prefix/$path")"; ln -s "$target" "$prefix/$path"; restored=$((restored + 1))
    fi
  done < "$gpu/symlinks.tsv"
  ((restored == 0)) || echo "  made $restored links of the prefix again (from $gpu/symlinks.tsv)"
fi
multiarch="$prefix/usr/lib/x86_64-linux-gnu"
for file in usr/lib/x86_64-linux-gnu/hdf5/serial/include/hdf5.h usr/lib/x86_64-linux-gnu/hdf5/serial/libhdf5.so \
            usr/lib/x86_64-linux-gnu/cmake/TBB/TBBConfig.cmake usr/share/cmake/CLI11/CLI11Config.cmake \
            usr/include/zstd.h usr/include/xxhash.h usr/include/zlib.h \
            usr/share/javascript/chart.js/chart.min.js bin/pkg-config; do
  [ -e "$prefix/$file" ] || { missing+=("the prepared prefix ($prefix/$file; run scripts/gpu_prepare.sh here and carry .gpu)"); break; }
done
if [ -z "$python" ]; then
  if command -v python3 >/dev/null && python3 -c "import torch" 2>/dev/null; then
    python="$(command -v python3)"
  elif ((dry_run)) && [ -x "$repo/.venv/bin/python" ]; then
    python="$repo/.venv/bin/python"
  else
    python="$(command -v python3 || echo python3)"
  fi
fi
probe=$("$python" - <<'EOF' 2>&1
import importlib.util, os, sys, sysconfig
try:
    import torch
except Exception as error:
    print(f"MISSING torch in {sys.executable} ({error})"); sys.exit()
print("TORCH", torch.__version__, torch.version.cuda, torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("TORCH_PREFIX", torch.utils.cmake_prefix_path)
for module in ("pytest", "numpy"):
    if importlib.util.find_spec(module) is None:
        print(f"MISSING python module {module} in {sys.executable}")
print("PYINC", sysconfig.get_paths()["include"])
for module in ("cmake", "ninja"):
    try:
        mod = __import__(module)
        print(f"PYBIN_{module}", getattr(mod, "CMAKE_BIN_DIR", None) or getattr(mod, "BIN_DIR", ""))
    except Exception:
        pass
EOF
) || true
echo "$probe" | sed 's/^/  /'
grep -q '^TORCH ' <<<"$probe" || missing+=("python3 with torch ($python: $(grep -m1 MISSING <<<"$probe" || echo cannot run))")
while IFS= read -r line; do missing+=("${line#MISSING }"); done < <(grep '^MISSING python module' <<<"$probe")
if ((!dry_run)) && grep -q '^TORCH ' <<<"$probe" && ! grep -q '^TORCH .* True ' <<<"$probe"; then
  missing+=("CUDA visible to torch (torch.cuda.is_available() is False in $python)")
fi
torch_prefix=$(sed -n 's/^TORCH_PREFIX //p' <<<"$probe")
pyinc=$(sed -n 's/^PYINC //p' <<<"$probe")
find_tool() {  # a program on PATH, else from the Python package of the same name
  local found
  found=$(command -v "$1" 2>/dev/null) && { echo "$found"; return; }
  found=$(sed -n "s/^PYBIN_$1 //p" <<<"$probe")
  [ -n "$found" ] && [ -x "$found/$1" ] && echo "$found/$1"
}
cmake_bin=$(find_tool cmake) || missing+=("cmake (on PATH or as the cmake Python package)")
ninja_bin=$(find_tool ninja) || missing+=("ninja (on PATH or as the ninja Python package)")
cxx=$(command -v c++ || command -v g++ || true)
[ -n "$cxx" ] || missing+=("a C++ compiler (c++ or g++)")
cc=$(command -v cc || command -v gcc || true)
[ -n "$cc" ] || missing+=("a C compiler (cc or gcc)")
python_include_define=()
if [ -n "$pyinc" ] && [ ! -e "$pyinc/Python.h" ]; then
  if [ -e "$gpu/python3.12-include/Python.h" ] && "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    echo "  $pyinc has no Python.h: using the prepared $gpu/python3.12-include"
    python_include_define=(-DPython3_INCLUDE_DIR="$gpu/python3.12-include")
  else
    missing+=("Python's headers (Python.h in $pyinc)")
  fi
fi
if ! "$python" -c "import pybind11_stubgen" 2>/dev/null && [ ! -d "$gpu/pylib/pybind11_stubgen" ]; then
  missing+=("pybind11-stubgen (in $python or $gpu/pylib: scripts/gpu_prepare.sh)")
fi
if ((${#missing[@]})); then
  echo "gpu_check: FAILED before building: missing:" >&2
  printf '  - %s\n' "${missing[@]}" >&2
  exit 3
fi
echo "  python $python; cmake $cmake_bin ($("$cmake_bin" --version | head -n1)); ninja $ninja_bin; c++ $cxx"

# ------------------------------------------------------------------ build from the prefix only
build="$repo/$([ "$dry_run" = 1 ] && echo build-gpu-dry || echo build-gpu)"
site="$build/site"
jobs="${jobs:-$([ "$dry_run" = 1 ] && echo 2 || nproc)}"
step "building into $build with $jobs jobs"
((keep_build)) || rm -rf "$build"
libdirs="$multiarch:$multiarch/hdf5/serial"
linker_flags="-Wl,--disable-new-dtags -Wl,-rpath,$libdirs -Wl,-rpath-link,$libdirs"
export PYTHONPATH="$gpu/pylib${PYTHONPATH:+:$PYTHONPATH}"
build_start=$SECONDS
"$cmake_bin" -S "$repo" -B "$build/cmake" -G Ninja -DCMAKE_MAKE_PROGRAM="$ninja_bin" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
  -DDYNAPROBE_BUILD_TESTS=OFF -DDYNAPROBE_BUILD_BENCH=OFF -DDYNAPROBE_BUILD_EXAMPLES=OFF \
  -DDYNAPROBE_BUILD_PYTHON=ON -DDYNAPROBE_TORCH_FROM_PYTHON=ON \
  -DPython3_EXECUTABLE="$python" "${python_include_define[@]}" \
  -DCMAKE_PREFIX_PATH="$prefix/usr;$torch_prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
  -DHDF5_ROOT="$multiarch/hdf5/serial" -DHDF5_NO_FIND_PACKAGE_CONFIG_FILE=ON \
  -DTBB_DIR="$multiarch/cmake/TBB" -DCLI11_DIR="$prefix/usr/share/cmake/CLI11" \
  -DZLIB_ROOT="$prefix/usr" -DPKG_CONFIG_EXECUTABLE="$prefix/bin/pkg-config" \
  -DDYNAPROBE_CHART_JS="$prefix/usr/share/javascript/chart.js/chart.min.js" \
  -DCMAKE_EXE_LINKER_FLAGS="$linker_flags" -DCMAKE_SHARED_LINKER_FLAGS="$linker_flags" \
  -DCMAKE_MODULE_LINKER_FLAGS="$linker_flags" -DCMAKE_INSTALL_PREFIX="$site"
"$cmake_bin" --build "$build/cmake" -j "$jobs"
"$cmake_bin" --install "$build/cmake" >/dev/null
cli="$build/cmake/analyze/dynaprobe"
build_s=$((SECONDS - build_start))
step "built and installed in $build_s s"

# ------------------------------------------------------------------ where the libraries come from
step "libraries: HDF5, zstd, xxHash, oneTBB must resolve into $prefix"
extension=$(ls "$site"/dynaprobe/_C*.so)
bad=0
for binary in "$extension" "$cli"; do
  echo "  $binary: $(readelf -d "$binary" | sed -n 's/.*(RPATH).*\[\(.*\)\]/RPATH \1/p')"
  resolved=$(ldd "$binary" 2>&1 | grep -E 'libhdf5|libzstd|libxxhash|libtbb|libsz|libcurl' || true)
  echo "$resolved" | sed 's/^\s*/    /'
  if grep -v "=> $prefix/" <<<"$resolved" | grep -q .; then
    echo "  gpu_check: $binary resolves a dependency outside $prefix" >&2; bad=1
  fi
  if ldd "$binary" 2>&1 | grep 'not found' | grep -v -E 'libtorch|libc10|libshm|libcuda|libnv|libcu' ; then
    echo "  gpu_check: $binary has an unresolved dependency" >&2; bad=1
  fi
done
((!bad)) || exit 4

status=0
export PYTHONPATH="$site:$PYTHONPATH" DYNAPROBE_CLI="$cli" DYNAPROBE_GPU_OUT="$out"
# ------------------------------------------------------------------ torch 2.11's headers (dry run)
if ((dry_run)); then
  headers="$repo/build-gpu-torch211/torch/include"
  step "compile-only check of the torch-facing translation units against torch 2.11's headers"
  if [ ! -e "$headers/torch/extension.h" ]; then
    echo "  gpu_check: $headers is missing (bash scripts/gpu_prepare.sh downloads it)" >&2
    status=1
  else
    mine=$("$python" -c "import torch, os; print(os.path.dirname(torch.__file__))")
    "$python" - "$build/cmake/compile_commands.json" "$mine/include" "$headers" "$jobs" <<'EOF' || status=1
import concurrent.futures, json, re, shlex, subprocess, sys
commands, mine, theirs, jobs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
entries = [e for e in json.load(open(commands)) if mine in e["command"]]
version_h = open(f"{theirs}/torch/headeronly/version.h").read()
version = ".".join(re.search(rf"#define TORCH_VERSION_{part} (\d+)", version_h).group(1)
                   for part in ("MAJOR", "MINOR", "PATCH"))
print(f"  headers of torch {version}: {theirs}")
def check(entry):
    args, skip = [], False
    for arg in shlex.split(entry["command"].replace(mine, theirs)):
        if skip:
            skip = False
        elif arg in ("-o", "-MT", "-MF"):
            skip = True
        elif arg not in ("-MD", "-MMD"):
            args.append(arg)
    args.append("-fsyntax-only")
    proc = subprocess.run(args, cwd=entry["directory"], capture_output=True, text=True)
    return entry["file"], proc.returncode, proc.stderr
failed = 0
with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for file, rc, err in pool.map(check, entries):
        print(f"  {'ok  ' if rc == 0 else 'FAIL'} {file}")
        if rc:
            failed += 1
            print(err[-4000:])
print(f"  torch 2.11 headers: {len(entries) - failed}/{len(entries)} translation units compile")
sys.exit(1 if failed or not entries else 0)
EOF
  fi
fi

# ------------------------------------------------------------------ the checks
cd "$out"  # the tests' and the main job's side files land in the out folder's tmp, never in the tree
tmp="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
if ((dry_run)); then
  # The GPU tests skip without CUDA: their CPU variant runs instead (the main job included).
  export DYNAPROBE_TEST_DEVICE=cpu
  select=()
  pytest_cap=900; bench_args=(--device cpu --layers 2 --width 128 --seq 64 --steps 2 --profile)
  bench_cap=600; fp32_cap=300
else
  # Within one device command's 600 s: the build took 44-51 s, pytest 80-90 s, on 2026-12-04.
  select=()
  pytest_cap=200; bench_args=(--profile); bench_cap=180; fp32_cap=110
fi
step "pytest -m gpu tests/python/test_gpu.py ${select[*]} (at most $pytest_cap s)"
timeout -k 10 "$pytest_cap" "$python" -m pytest -m gpu -p no:cacheprovider -v -rs --durations=0 \
  --basetemp="$tmp/pytest" --junitxml="$out/gpu_pytest.xml" "$repo/tests/python/test_gpu.py" \
  "${select[@]}" || status=1
step "bench/gpu_capture_cost.py ${bench_args[*]} (at most $bench_cap s)"
timeout -k 10 "$bench_cap" "$python" "$repo/bench/gpu_capture_cost.py" "${bench_args[@]}" \
  --dump-dir "$tmp/bench" --json "$out/gpu_capture_cost.json" || status=1
# float32: the reference only for failing calls, decided on the host when the backward ends.
step "bench/gpu_capture_cost.py --dtype float32 ${bench_args[*]} (at most $fp32_cap s)"
timeout -k 10 "$fp32_cap" "$python" "$repo/bench/gpu_capture_cost.py" --dtype float32 \
  "${bench_args[@]}" --dump-dir "$tmp/bench32" --json "$out/gpu_capture_cost_float32.json" || status=1
rm -rf "$tmp"
step "$mode: $([ "$status" = 0 ] && echo PASSED || echo FAILED) (build $build_s s, total $((SECONDS - start)) s); files in $out: $(ls "$out" | tr '\n' ' ')"
exit "$status"
