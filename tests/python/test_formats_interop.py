"""Dumps written by dynaprobe read back with independent tools (h5py + hdf5plugin, h5dump), and
files written by h5py read by dynaprobe. Format 2.0 stores strings fixed-length (nothing in
HDF5's global heap): h5py reads them as bytes."""

import os
import shutil
import subprocess

import h5py
import hdf5plugin
import numpy as np
import pytest
from dump_checksum import group_checksum, index_checksum, rewrite_index, set_text_attribute, widened

import dynaprobe
from dynaprobe import _C

FORMAT_1_4 = os.path.join(os.path.dirname(__file__), "..", "data", "format_1.4", "step_00000000.h5")

RNG = np.random.default_rng(1234)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as torch stores them."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def sample_tensors():
    """(module, dtype name, array) covering every dtype and the awkward shapes."""
    floats = RNG.standard_normal((37, 129))
    floats[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    fp8_bytes = RNG.integers(0, 256, (13, 17), dtype=np.uint8)
    tensors = [
        ("f64", "float64", floats.astype(np.float64)),
        ("f32", "float32", floats.astype(np.float32)),
        ("f16", "float16", floats.astype(np.float16)),
        ("bf16", "bfloat16", bf16_bits(floats)),
        ("i8", "int8", RNG.integers(-128, 128, (5, 7), dtype=np.int8)),
        ("i16", "int16", RNG.integers(-(2**15), 2**15, (5, 7), dtype=np.int16)),
        ("i32", "int32", RNG.integers(-(2**31), 2**31, (5, 7), dtype=np.int32)),
        ("i64", "int64", RNG.integers(-(2**62), 2**62, (5, 7), dtype=np.int64)),
        ("u8", "uint8", RNG.integers(0, 256, (5, 7), dtype=np.uint8)),
        ("u16", "uint16", RNG.integers(0, 2**16, (5, 7), dtype=np.uint16)),
        ("u32", "uint32", RNG.integers(0, 2**32, (5, 7), dtype=np.uint32)),
        ("u64", "uint64", RNG.integers(0, 2**63, (5, 7), dtype=np.uint64)),
        ("flags", "bool", RNG.integers(0, 2, (9, 3)).astype(np.bool_)),
        ("scalar", "float32", np.array(0.333408, dtype=np.float32)),
        ("empty", "float32", np.zeros((4, 0), dtype=np.float32)),
        ("odd", "float32", RNG.standard_normal((3, 1001, 7)).astype(np.float32)),
        ("c64", "complex64", (floats + 1j * floats[::-1]).astype(np.complex64)),
        ("c128", "complex128", (floats[:5] - 2j * floats[:5]).astype(np.complex128)),
    ]
    for name in ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"]:
        tensors.append((name.replace("float8_", "fp8_"), name, fp8_bytes))
    return tensors


def dataset_name(module, kind="fwd_output", side="eager", call=0, index=0):
    return f"/tensors/{module}/{kind}.{side}.{call}.{index}"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One step written by dynaprobe with 4 KiB chunks, so most tensors span several chunks."""
    dump = tmp_path_factory.mktemp("dump")
    tensors = sample_tensors()
    records = [(module, 0, "fwd_output", 0, "eager", "", dtype, array) for module, dtype, array in tensors]
    graphs = [("__compiled_fn_0.Captured_Graph.1a2b3c4d", "captured", "def forward(x):\n    return (x,)\n", {"modules": "f32"})]
    path = _C.write_step(str(dump), 0, {"torch_version": "2.13.0", "backend": "aot_eager"}, records, graphs, chunk_bytes=4096)
    return path, tensors


def expected_as_h5py_reads_it(dtype, array):
    if dtype == "bfloat16":  # a custom 2-byte HDF5 float: h5py converts it to float32
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


def assert_same_values(got, want, what):
    """Bit for bit, except that any NaN equals any NaN (HDF5's float conversion of bfloat16 does
    not keep NaN payloads)."""
    if got.dtype.kind == "f":
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), what
        got, want = got[~nan], want[~nan]
    assert got.tobytes() == want.tobytes(), what


def test_h5py_reads_every_value_bit_for_bit(written):
    path, tensors = written
    with h5py.File(path, "r") as f:
        assert f.attrs["dynaprobe_format_version"] == b"2.0"
        assert f.attrs["backend"] == b"aot_eager"
        for module, dtype, array in tensors:
            dataset = f[dataset_name(module)]
            assert dataset.attrs["dtype"] == dtype.encode()
            got = dataset[()]
            want = expected_as_h5py_reads_it(dtype, array)
            assert got.shape == want.shape, module
            if dtype == "bool":
                assert got.dtype == np.bool_
            assert_same_values(got, want.astype(got.dtype), module)


def test_chunks_are_shuffled_zstd_with_registered_filter_ids(written):
    path, _ = written
    with h5py.File(path, "r") as f:
        dataset = f[dataset_name("odd")]
        assert dataset.chunks is not None and dataset.chunks[0] == 1  # (1, k, 7): contiguous runs
        plist = dataset.id.get_create_plist()
        filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        assert filters == [2, 32015]  # shuffle, then zstd


def test_h5py_reads_the_index_and_graphs(written):
    path, tensors = written
    with h5py.File(path, "r") as f:
        index = f["index"][()]
        modules = sorted(row["module"].decode() for row in index)
        assert modules == sorted(module for module, _, _ in tensors)
        odd = next(row for row in index if row["module"] == b"odd")
        assert tuple(odd["shape"]) == (3, 1001, 7)
        assert odd["dtype"] == b"float32" and odd["kind"] == b"fwd_output" and odd["side"] == b"eager"
        graph = f["graphs/__compiled_fn_0.Captured_Graph.1a2b3c4d"]
        assert graph[()].decode() == "def forward(x):\n    return (x,)\n"
        assert graph.attrs["kind"] == b"captured"


def test_dynaprobe_reads_back_what_it_wrote(written):
    path, tensors = written
    info = _C.read_step(path)
    assert info["step"] == 0 and info["format_version"] == "2.0"
    assert info["provenance"]["torch_version"] == "2.13.0"
    assert_every_record_reads_back(path, tensors)


def assert_every_record_reads_back(path, tensors):
    for module, dtype, array in tensors:
        got_dtype, shape, data = _C.read_record(path, module, 0, "fwd_output", 0, "eager")
        assert got_dtype == dtype and shape == array.shape
        assert data == np.ascontiguousarray(array).tobytes(), module


def located_records(path):
    """{module: (chunk_offset, stored_bytes, chunk_filter_mask)} of the index rows that locate
    their only chunk."""
    with h5py.File(path, "r") as f:
        return {row["module"].decode(): (int(row["chunk_offset"]), int(row["stored_bytes"]), int(row["chunk_filter_mask"]))
                for row in f["index"][()] if row["chunk_offset"]}


def test_index_locates_single_chunk_records_where_hdf5_has_them(written):
    """The dump contract readers rely on to skip opening datasets: /index gives the file offset,
    size and filter mask of every record stored as one chunk, as HDF5 itself reports them."""
    path, tensors = written
    located = located_records(path)
    with h5py.File(path, "r") as f:
        for module, _, array in tensors:
            dataset = f[dataset_name(module)]
            one_chunk = dataset.chunks is not None and array.size > 0 and dataset.id.get_num_chunks() == 1
            assert (module in located) == one_chunk, module
            if one_chunk:
                info = dataset.id.get_chunk_info(0)
                assert located[module] == (info.byte_offset, info.size, info.filter_mask), module
    assert {"i8", "u64", "flags"} <= located.keys() and "odd" not in located


def records_of(path):
    """{record key: (dtype, shape, bytes)} of every stored record of a step file, read by dynaprobe."""
    out = {}
    for r in _C.read_step(path)["records"]:
        key = (r["module"], r["call"], r["kind"], r["tensor_index"], r["side"])
        out[key] = _C.read_record(path, *key)
    return out


def repack(path, tmp_path):
    repacked = str(tmp_path / "repacked" / "step_00000000.h5")
    os.makedirs(os.path.dirname(repacked))
    env = dict(os.environ, HDF5_PLUGIN_PATH=dynaprobe.hdf5_plugin_dir())
    subprocess.run([shutil.which("h5repack"), path, repacked], env=env, check=True)
    assert located_records(repacked) == located_records(path)  # the index came along unchanged
    return repacked


def test_files_of_format_1_rewritten_by_h5repack_read_through_their_datasets(tmp_path):
    """h5repack moves every chunk and copies /index as it is: the offsets it keeps are stale, and
    dynaprobe must notice (the bytes there no longer match their hash) and read the datasets."""
    repacked = repack(FORMAT_1_4, tmp_path)
    module, (offset, _, _) = next(iter(located_records(FORMAT_1_4).items()))
    with h5py.File(repacked, "r") as f:
        dataset = next(f[f"tensors/{module}"][name] for name in f[f"tensors/{module}"])
        assert dataset.id.get_chunk_info(0).byte_offset != offset
    assert records_of(repacked) == records_of(FORMAT_1_4)


def test_files_of_format_2_rewritten_by_h5repack_are_refused_as_rewritten(written, tmp_path):
    """Format 2.0 checks every chunk against the hash written with it: a file another tool
    rewrote is not what dynaprobe wrote, and reading it says so instead of trusting other bytes."""
    path, tensors = written
    repacked = repack(path, tmp_path)
    with pytest.raises(dynaprobe.FormatError, match="rewritten by another tool"):
        _C.read_record(repacked, "i8", 0, "fwd_output", 0, "eager")


def test_records_with_the_same_bytes_are_one_dataset_under_two_names(tmp_path):
    data = RNG.standard_normal((64, 64)).astype(np.float32)
    path = _C.write_step(str(tmp_path), 0, {}, [
        ("a", 0, "fwd_output", 0, "eager", "", "float32", data),
        ("a", 0, "fwd_output", 0, "compiled", "", "float32", data),
        ("b", 0, "fwd_output", 0, "eager", "", "float32", data + 1)])
    with h5py.File(path, "r") as f:
        eager, compiled, other = f[dataset_name("a")], f[dataset_name("a", side="compiled")], f[dataset_name("b")]
        assert eager == compiled and eager != other  # h5py compares HDF5 objects
        np.testing.assert_array_equal(compiled[()], data)
        np.testing.assert_array_equal(other[()], data + 1)
    for side, want in [("eager", data), ("compiled", data)]:
        assert _C.read_record(path, "a", 0, "fwd_output", 0, side)[2] == want.tobytes()


def test_format_1_0_files_without_chunk_locations_still_read(tmp_path):
    """A file of format 1.0 (no chunk locations, hashes or index checksum), made from the 1.4
    file of tests/data (written by dynaprobe before format 2.0) by dropping those fields."""
    old = str(tmp_path / "step_00000000.h5")
    shutil.copy(FORMAT_1_4, old)
    with h5py.File(old, "r+") as f:
        index = f["index"][()]
        fields = [name for name in index.dtype.names if not name.startswith("chunk_")]
        del f["index"]
        f.create_dataset("index", data=np.array(index[fields].tolist(), dtype=[(n, index.dtype[n]) for n in fields]))
        del f["chunk_hashes"]
        f.attrs["dynaprobe_format_version"] = "1.0"
    assert _C.read_step(old)["format_version"] == "1.0"
    assert records_of(old) == records_of(FORMAT_1_4)


def test_format_1_4_files_read_as_before(tmp_path, dynaprobe_cli):
    info = _C.read_step(FORMAT_1_4)
    assert info["format_version"] == "1.4" and len(info["records"]) == 10
    with h5py.File(FORMAT_1_4) as f:  # the documented 1.2 checksum still holds
        assert int(f["index"].attrs["checksum"]) == index_checksum(f)
    folder = tmp_path / "dump"
    folder.mkdir()
    shutil.copy(FORMAT_1_4, folder / "step_00000000.h5")
    out = subprocess.run([dynaprobe_cli, "compare", str(folder)], capture_output=True, text=True)
    assert out.returncode == 0 and "RESULT: ALL PASS" in out.stdout, out.stderr


def test_format_2_files_hold_nothing_variable_length(written):
    """No variable-length string or sequence anywhere (h5dump prints every type of the file):
    nothing of a step lives in HDF5's global heap, which carries no checksum."""
    path, _ = written
    env = dict(os.environ, HDF5_PLUGIN_PATH=dynaprobe.hdf5_plugin_dir())
    header = subprocess.run([shutil.which("h5dump"), "-H", "-A", path], env=env, capture_output=True,
                            text=True, check=True).stdout
    assert "H5T_VARIABLE" not in header and "H5T_VLEN" not in header
    assert "H5T_STRING" in header and 'DATASET "index"' in header
    assert b"GCOL" not in open(path, "rb").read()  # no global heap collection at all


def test_format_2_checksums_are_the_documented_ones(written):
    path, _ = written
    with h5py.File(path, "r") as f:
        assert int(f["index"].attrs["checksum"]) == index_checksum(f)
        assert int(f["modules"].attrs["checksum"]) == group_checksum(f["modules"], with_text=False)
        assert int(f["graphs"].attrs["checksum"]) == group_checksum(f["graphs"], with_text=True)
        rows = f["index"][()]
        assert list(rows.dtype.names)[:9] == ["module", "call", "kind", "tensor_index", "side", "label",
                                              "dtype", "rank", "shape"]
        # Every chunk of every chunked record has its hash: /chunk_hashes, rows point into it.
        hashes = f["chunk_hashes"][()]
        for row in rows:
            if row["rank"] > 0 and row["stored_bytes"] > 0:
                name = dataset_name(row["module"].decode())
                assert row["chunk_count"] == f[name].id.get_num_chunks() > 0
                assert row["chunk_hashes_first"] + row["chunk_count"] <= len(hashes)


def test_h5py_reads_complex_records_as_complex(written):
    path, tensors = written
    with h5py.File(path, "r") as f:
        for module in ("c64", "c128"):
            want = next(a for m, _, a in tensors if m == module)
            got = f[dataset_name(module)][()]
            assert got.dtype == want.dtype and got.shape == want.shape, module
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("plugin_dir", ["dynaprobe", "hdf5plugin"])
def test_h5dump_prints_real_data(written, plugin_dir):
    """h5dump, a separate program, reads our chunks through an HDF5 zstd plugin: ours, or the
    independent one shipped by hdf5plugin."""
    path, tensors = written
    h5dump = shutil.which("h5dump")
    assert h5dump, "h5dump is missing: scripts/setup.sh installs Debian's hdf5-tools"
    env = dict(os.environ, HDF5_PLUGIN_PATH=dynaprobe.hdf5_plugin_dir() if plugin_dir == "dynaprobe" else hdf5plugin.PLUGIN_PATH)
    out = subprocess.run([h5dump, "-w", "0", "-d", dataset_name("i32"), path], env=env, capture_output=True, text=True, check=True).stdout
    assert "DATA {" in out and "DATA {\n   }" not in out
    first_row = [int(v) for v in next(a for m, _, a in tensors if m == "i32")[0]]
    printed = out.split("(0,0):", 1)[1].split("\n", 1)[0]
    assert [int(v) for v in printed.replace(",", " ").split()[: len(first_row)]] == first_row


def test_dynaprobe_reads_files_written_by_h5py_with_zstd(tmp_path):
    path = str(tmp_path / "h5py.h5")
    data = RNG.standard_normal((300, 50)).astype(np.float32)
    ints = RNG.integers(0, 1000, (64, 64), dtype=np.int64)
    with h5py.File(path, "w") as f:
        # dynaprobe's own chunk form (rows x full trailing dims): read with H5Dread_chunk and
        # decoded by dynaprobe, from frames written by hdf5plugin's zstd.
        f.create_dataset("rows", data=data, chunks=(64, 50), shuffle=True, **hdf5plugin.Zstd(clevel=3))
        # any other chunk shape and filter go through HDF5's own pipeline
        f.create_dataset("tiles", data=data, chunks=(7, 9), **hdf5plugin.Zstd(clevel=-2))
        f.create_dataset("gzip", data=ints, chunks=(16, 16), compression="gzip")
        f.create_dataset("plain", data=ints)
    for name, want in [("rows", data), ("tiles", data), ("gzip", ints), ("plain", ints)]:
        dtype, shape, raw = _C.read_dataset(path, name)
        assert dtype == str(want.dtype) and shape == want.shape
        assert raw == want.tobytes(), name


def test_negative_zstd_levels_interoperate(tmp_path):
    data = RNG.standard_normal((1000, 33)).astype(np.float32)
    path = _C.write_step(str(tmp_path), 0, {}, [("x", 0, "fwd_input", 0, "eager", "", "float32", data)], zstd_level=-3, chunk_bytes=8192)
    with h5py.File(path, "r") as f:
        dataset = f[dataset_name("x", kind="fwd_input")]
        assert dataset.id.get_create_plist().get_filter(1)[2] == (2**32 - 3,)  # two's complement
        np.testing.assert_array_equal(dataset[()], data)


def test_errors_are_python_exceptions_naming_the_file(tmp_path):
    bogus = tmp_path / "step_00000000.h5"
    bogus.write_bytes(b"not hdf5 at all" * 100)
    with pytest.raises(dynaprobe.FormatError, match="step_00000000.h5.*not an HDF5 file"):
        _C.read_step(str(bogus))
    with pytest.raises(dynaprobe.DumpIOError, match="no such file"):
        _C.read_step(str(tmp_path / "missing.h5"))
    assert issubclass(dynaprobe.FormatError, ValueError) and issubclass(dynaprobe.DumpIOError, OSError)


def test_rows_of_a_kind_from_a_newer_minor_version_are_skipped_not_fatal(tmp_path, dynaprobe_cli):
    data = np.arange(6, dtype=np.float32)
    path = _C.write_step(str(tmp_path), 0, {"mode": "single_pass"}, [
        ("a", 0, "fwd_output", 0, "eager", "", "float32", data),
        ("a", 0, "fwd_output", 0, "compiled", "", "float32", data),
        ("b", 0, "fwd_output", 0, "eager", "", "float32", data)])
    with h5py.File(path, "r+") as f:
        index = widened(f["index"][()], kind=32)
        index[2]["kind"] = b"buffer_after_step"  # a kind this reader does not know
        set_text_attribute(f, "dynaprobe_format_version", "2.9")  # written by a newer minor version
        rewrite_index(f, index)
    info = _C.read_step(path)
    assert [r["module"] for r in info["records"]] == ["a", "a"]
    out = subprocess.run([dynaprobe_cli, "compare", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "unknown kind 'buffer_after_step', written by a newer dynaprobe (format 2.9); skipped" in out.stderr
    # The same row in a file of this reader's own version can only be damage.
    with h5py.File(path, "r+") as f:
        set_text_attribute(f, "dynaprobe_format_version", "2.0")
    with pytest.raises(dynaprobe.FormatError, match="damaged /index: index row 2 .*unknown kind 'buffer_after_step'"):
        _C.read_step(path)
