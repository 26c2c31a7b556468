"""Helpers for tests that craft step files: independent implementations of the checksums of
docs/dump-format.md: format 1.2's /index checksum (XXH64, written here, and its canonical byte
string) and format 2.0's (XXH3-64 through libxxhash's C API, not dynaprobe's), its /modules and
/graphs checksums; and writers of what format 2.0 stores (fixed-length strings)."""

import ctypes
import ctypes.util

import numpy as np

_P1, _P2, _P3, _P4, _P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                           0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
_M = (1 << 64) - 1


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & _M


def _round(acc, lane):
    return (_rotl((acc + lane * _P2) & _M, 31) * _P1) & _M


def xxh64(data, seed=0):
    n, i = len(data), 0
    if n >= 32:
        v = [(seed + _P1 + _P2) & _M, (seed + _P2) & _M, seed, (seed - _P1) & _M]
        while i + 32 <= n:
            for k in range(4):
                v[k] = _round(v[k], int.from_bytes(data[i + 8 * k:i + 8 * k + 8], "little"))
            i += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _M
        for k in range(4):
            h = ((h ^ _round(0, v[k])) * _P1 + _P4) & _M
    else:
        h = (seed + _P5) & _M
    h = (h + n) & _M
    while i + 8 <= n:
        h = (_rotl(h ^ _round(0, int.from_bytes(data[i:i + 8], "little")), 27) * _P1 + _P4) & _M
        i += 8
    if i + 4 <= n:
        h = (_rotl(h ^ (int.from_bytes(data[i:i + 4], "little") * _P1 & _M), 23) * _P2 + _P3) & _M
        i += 4
    while i < n:
        h = (_rotl(h ^ (data[i] * _P5 & _M), 11) * _P1) & _M
        i += 1
    h ^= h >> 33
    h = (h * _P2) & _M
    h ^= h >> 29
    h = (h * _P3) & _M
    return h ^ (h >> 32)


_libxxhash = ctypes.CDLL(ctypes.util.find_library("xxhash") or "libxxhash.so.0")
_libxxhash.XXH3_64bits.restype = ctypes.c_uint64
_libxxhash.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def xxh3(data):
    """XXH3-64 with seed 0."""
    data = bytes(data)
    return _libxxhash.XXH3_64bits(data, len(data))


def u(value, size=8, signed=False):
    return int(value).to_bytes(size, "little", signed=signed)


def text(value):
    value = value if isinstance(value, bytes) else str(value).encode()
    return u(len(value)) + value


def version(f):
    value = f.attrs["dynaprobe_format_version"]
    return value.decode() if isinstance(value, bytes) else value


def _tail(f, hashes):
    """What follows the rows in both index checksums: chunk hashes, step, provenance."""
    out = [u(len(hashes))] + [u(h) for h in hashes]
    out.append(u(int(f.attrs["step"]), signed=True))
    provenance = {k.encode(): v for k, v in f.attrs.items() if k not in ("dynaprobe_format_version", "step")}
    out.append(u(len(provenance)))
    for key in sorted(provenance):
        out += [text(key), text(provenance[key])]
    return out


def index_checksum(f):
    """The /index checksum of an open step file, as docs/dump-format.md defines it for its
    format: 2.0's XXH3 over the index's bytes as stored and the rest; 1.2's XXH64 otherwise."""
    if not version(f).startswith("1."):
        return xxh3(f["index"][()].tobytes() + b"".join(_tail(f, f["chunk_hashes"][()])))
    return index_checksum_1_2(f)


def group_checksum(group, with_text):
    """Format 2.0's checksum of /modules (creation order, with_text False) or /graphs (name
    order, the text and the attributes with `kind`)."""
    names = list(group) if with_text else [name for name in _creation_order(group)]
    out = [u(len(names))]
    for name in (sorted(names, key=str.encode) if with_text else names):
        item = group[name]
        out.append(text(name.encode()))
        if with_text:
            out.append(text(item[()]))
        attrs = {k.encode(): v for k, v in item.attrs.items()}
        out.append(u(len(attrs)))
        for key in sorted(attrs):
            out += [text(key), text(attrs[key])]
    return xxh3(b"".join(out))


def _creation_order(group):
    import h5py
    names = []
    group.id.links.iterate(lambda name: names.append(name.decode()), idx_type=h5py.h5.INDEX_CRT_ORDER)
    return names


def set_text_attribute(obj, name, value):
    """A string attribute as format 2.0 stores it: fixed-length (h5py writes str variable-length)."""
    value = value.encode() if isinstance(value, str) else value
    obj.attrs.create(name, np.bytes_(value or b"\0"), dtype=f"S{max(len(value), 1)}")


def rewrite_index(f, index):
    """Replaces /index of an open format 2.0 file by `index` (a numpy table, strings widened to
    fit) and reseals its checksum, as a crafted file would."""
    del f["index"]
    f.create_dataset("index", data=index)
    f["index"].attrs.create("checksum", index_checksum(f), dtype="<u8")


def widened(index, **sizes):
    """`index` with the named string fields widened to hold `sizes[name]` bytes."""
    dtype = [(name, f"S{sizes[name]}" if name in sizes else index.dtype[name]) for name in index.dtype.names]
    return np.array(index.tolist(), dtype=dtype)


def index_checksum_1_2(f):
    """Format 1.2's /index checksum (XXH64 of a canonical byte string)."""

    rows, hashes = f["index"][()], f["chunk_hashes"][()]
    out = [u(len(rows))]
    for row in rows:
        out += [text(row["module"]), u(row["call"], 4), text(row["kind"]), u(row["tensor_index"], 4),
                text(row["side"]), text(row["label"]), text(row["dtype"]), u(len(row["shape"]))]
        out += [u(d, signed=True) for d in row["shape"]]
        out += [u(row["stored_bytes"]), u(row["chunk_offset"]), u(row["chunk_filter_mask"], 4),
                u(row["chunk_hash"]), u(row["chunk_hashes_first"]), u(row["chunk_count"])]
    out += _tail(f, hashes)
    return xxh64(b"".join(out))


