#!/usr/bin/env bash
# Prepares, on this Debian 12 machine (as root), what a bare GPU machine lacks to build and check
# dynaprobe there (scripts/gpu_check.sh), into the ignored folder .gpu/ that travels with the tree:
#   .gpu/prefix/   Debian 12 packages unpacked with `dpkg -x` (never into /): the headers and
#                  libraries of HDF5, zstd, xxHash, oneTBB, CLI11, zlib, Chart.js and pkgconf, and
#                  every shared library they load that is not glibc's or GCC's own (libhdf5 loads
#                  libcurl, OpenSSL, libsz, ...: found with readelf, owner packages with dpkg -S);
#                  docs, manuals and static archives pruned, .pc files made relocatable
#   .gpu/pylib/    pure-Python packages the build needs (pybind11-stubgen, for dynaprobe._C's stubs)
#   .gpu/python3.12-include/  CPython 3.12's headers, used only where the GPU machine's Python has
#                  none (pyenv's 3.12 here, if present)
# and, not travelling (build-gpu-torch211/, ignored): torch 2.11.0's include/ from its PyPI wheel,
# for the compile-only check of `gpu_check.sh --dry-run` against the GPU machine's torch version.
# Idempotent: what is there is kept. Prints the size of .gpu/ at the end.
#   bash scripts/gpu_prepare.sh [--no-torch-headers]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
gpu="$repo/.gpu"
prefix="$gpu/prefix"
torch_headers="$repo/build-gpu-torch211"
want_torch_headers=1
for arg in "$@"; do
  case "$arg" in
    --no-torch-headers) want_torch_headers=0 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_prepare: unknown argument $arg" >&2; exit 2 ;;
  esac
done
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"

# The packages named here; their runtime closure is added below.
packages=(libhdf5-dev libhdf5-103-1 libsz2 libaec0 libzstd-dev libzstd1 libxxhash-dev libxxhash0
          libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 libcli11-dev zlib1g-dev zlib1g libjs-chart.js pkgconf-bin libpkgconf3)
# Libraries every glibc machine with a C++ compiler has (never shipped: they must match the
# machine's own loader).
base_libs=" libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1 libresolv.so.2 libutil.so.1
  ld-linux-x86-64.so.2 libgcc_s.so.1 libstdc++.so.6 "
multiarch=usr/lib/x86_64-linux-gnu

debs="$repo/build-gpu-debs"  # the downloaded .debs: ignored, never carried
mkdir -p "$debs" "$prefix/.unpacked"
apt-cache show libhdf5-dev >/dev/null 2>&1 || apt-get update -qq

fetch_and_unpack() {  # package names: download (if not yet) and unpack into the prefix
  local package deb
  for package in "$@"; do
    deb=$(ls "$debs/${package}_"*.deb 2>/dev/null | head -n1 || true)
    if [ -z "$deb" ]; then
      (cd "$debs" && apt-get download -qq -o APT::Sandbox::User=root "$package")
      deb=$(ls "$debs/${package}_"*.deb | head -n1)
    fi
    if [ ! -e "$prefix/.unpacked/$package" ]; then
      dpkg -x "$deb" "$prefix"
      touch "$prefix/.unpacked/$package"
    fi
  done
}

fetch_and_unpack "${packages[@]}"

# The runtime closure: every NEEDED library of a shipped shared object that is neither shipped
# nor in base_libs comes from the package that owns it on this machine.
for _ in 1 2 3 4 5 6 7 8; do
  missing=()
  while IFS= read -r soname; do
    case "$base_libs" in *" $soname "*) continue ;; esac
    [ -e "$prefix/$multiarch/$soname" ] || [ -e "$prefix/lib/x86_64-linux-gnu/$soname" ] \
      || missing+=("$soname")
  done < <(find "$prefix" -type f \( -name '*.so*' -o -path '*/bin/*' \) -print0 \
             | xargs -0 -r readelf -d 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u)
  ((${#missing[@]})) || break
  owners=()
  for soname in "${missing[@]}"; do
    path=$(ldconfig -p | awk -v s="$soname" '$1 == s && /x86-64/ {print $NF; exit}')
    [ -n "$path" ] || { echo "gpu_prepare: $soname is needed but not installed here" >&2; exit 1; }
    owner=$(dpkg -S "$(readlink -f "$path")" 2>/dev/null | head -n1 | cut -d: -f1) \
      || owner=$(dpkg -S "$path" | head -n1 | cut -d: -f1)
    owners+=("$owner")
  done
  mapfile -t owners < <(printf '%s\n' "${owners[@]}" | sort -u)
  echo "gpu_prepare: runtime libraries from ${owners[*]}"
  fetch_and_unpack "${owners[@]}"
done

# Pruning: documentation, manuals, static archives, HDF5's C++/Fortran/HL links (unused, dangling).
rm -rf "$prefix/usr/share/doc" "$prefix/usr/share/man" "$prefix/usr/share/lintian" \
       "$prefix/usr/share/info" "$prefix/usr/share/locale" "$prefix/usr/share/bug" \
       "$prefix/etc" "$prefix/usr/share/aclocal"
find "$prefix" -name '*.a' -delete
# Chart.js: only the UMD build the HTML report embeds. OpenSSL's engines and providers: never loaded.
find "$prefix/usr/share/javascript/chart.js" -mindepth 1 ! -name chart.min.js -exec rm -rf {} +
rm -rf "$prefix/$multiarch/engines-3" "$prefix/$multiarch/ossl-modules"
# Absolute links made relative (they pointed into / of the packaging machine), dangling ones gone.
while IFS= read -r link; do
  target=$(readlink "$link")
  case "$target" in
    /*) ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$prefix$target")" "$link" ;;
  esac
done < <(find "$prefix" -type l)
find "$prefix" -xtype l -delete
# No directory links (a copy that follows links would loop on HDF5's `lib -> .`): the headers move
# to where HDF5's include link was; `lib -> .` goes (FindHDF5 looks in the folder itself too).
while IFS= read -r link; do
  target=$(readlink -f "$link")
  rm "$link"
  if [ "$target" != "$(readlink -f "$(dirname "$link")")" ]; then mv "$target" "$link"; fi
done < <(find "$prefix" -type l -xtype d)
# The file links, listed so that gpu_check.sh can make them again where the transfer lost them.
(cd "$prefix" && find . -type l -printf '%P\t%l\n' | sort) > "$gpu/symlinks.tsv"
# Relocatable .pc files: the prefix is wherever the folder lies.
for pc in "$prefix/$multiarch/pkgconfig/"*.pc "$prefix/usr/share/pkgconfig/"*.pc; do
  [ -e "$pc" ] || continue
  case "$pc" in
    */share/pkgconfig/*) up='${pcfiledir}/../..' ;;
    *) up='${pcfiledir}/../../..' ;;
  esac
  sed -i "s|^prefix=.*|prefix=$up|" "$pc"
done
# pkg-config for the GPU machine, which may have none: pkgconf from the prefix, reading only the
# prefix's .pc files.
mkdir -p "$prefix/bin"
cat > "$prefix/bin/pkg-config" <<'EOF'
#!/bin/sh
# pkgconf from this prefix, reading only this prefix's .pc files (scripts/gpu_prepare.sh).
here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
lib="$here/usr/lib/x86_64-linux-gnu"
PKG_CONFIG_LIBDIR="$lib/pkgconfig:$here/usr/share/pkgconfig" PKG_CONFIG_PATH= \
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/usr/bin/pkgconf" "$@"
EOF
chmod +x "$prefix/bin/pkg-config"
"$prefix/bin/pkg-config" --cflags --libs libzstd libxxhash >/dev/null

# Pure-Python build requirements the GPU machine lacks.
if [ ! -d "$gpu/pylib/pybind11_stubgen" ]; then
  "$python" -m pip install -q --no-deps --no-compile --target "$gpu/pylib" pybind11-stubgen==3.0.0
fi
# CPython 3.12's headers, for a GPU machine whose Python has none.
if [ ! -e "$gpu/python3.12-include/Python.h" ]; then
  for candidate in /root/.pyenv/versions/3.12*/include/python3.12 /usr/include/python3.12; do
    if [ -e "$candidate/Python.h" ]; then
      rm -rf "$gpu/python3.12-include"; cp -r "$candidate" "$gpu/python3.12-include"; break
    fi
  done
fi


# torch 2.11.0's headers, for the dry run's compile-only check (never carried to the GPU machine).
if ((want_torch_headers)) && [ ! -e "$torch_headers/torch/include/torch/extension.h" ]; then
  mkdir -p "$torch_headers/wheel"
  "$python" -m pip download -q --no-deps torch==2.11.0 --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$torch_headers/wheel"
  wheel=$(ls "$torch_headers/wheel/"torch-2.11.0-*.whl | head -n1)
  "$python" - "$wheel" "$torch_headers" <<'EOF'
import sys, zipfile
wheel, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    z.extractall(out, [n for n in z.namelist()
                       if n.startswith(("torch/include/", "torch/share/cmake/", "torch/version.py"))])
EOF
  rm -rf "$torch_headers/wheel"
fi

echo "gpu_prepare: prefix $prefix"
echo "gpu_prepare: .gpu/ is $(du -sh "$gpu" | cut -f1) ($(du -sb "$gpu" | cut -f1) bytes), what travels with carry [\".gpu\"]"
