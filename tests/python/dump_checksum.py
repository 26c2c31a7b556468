"""Helpers for tests that craft step files: an independent implementation of the /index checksum
of format 1.2 (XXH64 and its canonical byte string, written from docs/dump-format.md)."""

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


def index_checksum(f):
    """The /index checksum of an open step file, as docs/dump-format.md defines it."""
    def u(value, size=8, signed=False):
        return int(value).to_bytes(size, "little", signed=signed)

    def text(value):
        value = value if isinstance(value, bytes) else str(value).encode()
        return u(len(value)) + value

    rows, hashes = f["index"][()], f["chunk_hashes"][()]
    out = [u(len(rows))]
    for row in rows:
        out += [text(row["module"]), u(row["call"], 4), text(row["kind"]), u(row["tensor_index"], 4),
                text(row["side"]), text(row["label"]), text(row["dtype"]), u(len(row["shape"]))]
        out += [u(d, signed=True) for d in row["shape"]]
        out += [u(row["stored_bytes"]), u(row["chunk_offset"]), u(row["chunk_filter_mask"], 4),
                u(row["chunk_hash"]), u(row["chunk_hashes_first"]), u(row["chunk_count"])]
    out += [u(len(hashes))] + [u(h) for h in hashes]
    out.append(u(int(f.attrs["step"]), signed=True))
    provenance = {k.encode(): v for k, v in f.attrs.items() if k not in ("dynaprobe_format_version", "step")}
    out.append(u(len(provenance)))
    for key in sorted(provenance):
        out += [text(key), text(provenance[key])]
    return xxh64(b"".join(out))


