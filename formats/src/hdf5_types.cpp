#include "hdf5_types.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <type_traits>

#include "dynaprobe/formats/filters.h"
#include "dynaprobe/formats/schema.h"

namespace dynaprobe::formats {
namespace {
constexpr std::string_view kWhere = "HDF5 datatype";

h5::Handle copy_type(hid_t type) { return h5::type_handle(H5Tcopy(type), "copying", kWhere); }

h5::Handle bfloat16_type() {
  // bfloat16 is the upper half of an IEEE float32: sign bit 15, 8 exponent bits, 7 mantissa bits.
  h5::Handle type = copy_type(H5T_IEEE_F32LE);
  const hid_t id = type.get();
  h5::check(H5Tset_fields(id, 15, 7, 8, 0, 7), "defining bfloat16", kWhere);
  h5::check(H5Tset_offset(id, 0), "defining bfloat16", kWhere);
  h5::check(H5Tset_precision(id, 16), "defining bfloat16", kWhere);
  h5::check(H5Tset_size(id, 2), "defining bfloat16", kWhere);
  h5::check(H5Tset_ebias(id, 127), "defining bfloat16", kWhere);
  return type;
}

h5::Handle bool_type() {
  h5::Handle type = h5::type_handle(H5Tenum_create(H5T_NATIVE_INT8), "defining bool", kWhere);
  const std::int8_t no = 0, yes = 1;
  h5::check(H5Tenum_insert(type.get(), "FALSE", &no), "defining bool", kWhere);
  h5::check(H5Tenum_insert(type.get(), "TRUE", &yes), "defining bool", kWhere);
  return type;
}

// h5py's complex: a compound {r, i} of two IEEE floats of the part's size (complex32: float16
// parts, which h5py reads as a compound of two float16).
h5::Handle complex_type(DType dtype) {
  const DType part = complex_part(dtype);
  h5::Handle part_type = stored_type(part);
  const std::size_t size = dtype_size(part);
  h5::Handle type = h5::type_handle(H5Tcreate(H5T_COMPOUND, 2 * size), "defining complex", kWhere);
  h5::check(H5Tinsert(type.get(), "r", 0, part_type.get()), "defining complex", kWhere);
  h5::check(H5Tinsert(type.get(), "i", size, part_type.get()), "defining complex", kWhere);
  return type;
}

}  // namespace

h5::Handle stored_type(DType dtype) {
  h5::Lock lock(h5::hdf5_mutex());
  switch (dtype) {
    case DType::kFloat64:
      return copy_type(H5T_IEEE_F64LE);
    case DType::kFloat32:
      return copy_type(H5T_IEEE_F32LE);
    case DType::kFloat16: {
      h5::Handle type = copy_type(H5T_IEEE_F32LE);  // IEEE half: 1 + 5 + 10 bits, bias 15
      h5::check(H5Tset_fields(type.get(), 15, 10, 5, 0, 10), "defining float16", kWhere);
      h5::check(H5Tset_offset(type.get(), 0), "defining float16", kWhere);
      h5::check(H5Tset_precision(type.get(), 16), "defining float16", kWhere);
      h5::check(H5Tset_size(type.get(), 2), "defining float16", kWhere);
      h5::check(H5Tset_ebias(type.get(), 15), "defining float16", kWhere);
      return type;
    }
    case DType::kBFloat16:
      return bfloat16_type();
    case DType::kInt8:
      return copy_type(H5T_STD_I8LE);
    case DType::kInt16:
      return copy_type(H5T_STD_I16LE);
    case DType::kInt32:
      return copy_type(H5T_STD_I32LE);
    case DType::kInt64:
      return copy_type(H5T_STD_I64LE);
    case DType::kUInt16:
      return copy_type(H5T_STD_U16LE);
    case DType::kUInt32:
      return copy_type(H5T_STD_U32LE);
    case DType::kUInt64:
      return copy_type(H5T_STD_U64LE);
    case DType::kBool:
      return bool_type();
    case DType::kComplex32:
    case DType::kComplex64:
    case DType::kComplex128:
      return complex_type(dtype);
    case DType::kUInt8:
    default:  // float8 variants: raw bytes, named by the dtype attribute
      return copy_type(H5T_STD_U8LE);
  }
}

DType dtype_of_hdf5_type(hid_t type, std::string_view where) {
  h5::Lock lock(h5::hdf5_mutex());
  const std::size_t size = H5Tget_size(type);
  switch (H5Tget_class(type)) {
    case H5T_FLOAT: {
      if (size == 8) return DType::kFloat64;
      if (size == 4) return DType::kFloat32;
      if (size == 2) {
        std::size_t spos, epos, esize, mpos, msize;
        H5Tget_fields(type, &spos, &epos, &esize, &mpos, &msize);
        return esize == 8 ? DType::kBFloat16 : DType::kFloat16;
      }
      break;
    }
    case H5T_INTEGER: {
      const bool is_signed = H5Tget_sign(type) == H5T_SGN_2;
      if (size == 1) return is_signed ? DType::kInt8 : DType::kUInt8;
      if (size == 2) return is_signed ? DType::kInt16 : DType::kUInt16;
      if (size == 4) return is_signed ? DType::kInt32 : DType::kUInt32;
      if (size == 8) return is_signed ? DType::kInt64 : DType::kUInt64;
      break;
    }
    case H5T_ENUM:
      if (size == 1) return DType::kBool;
      break;
    case H5T_COMPOUND: {  // complex: {r, i} of two floats of one size
      if (H5Tget_nmembers(type) != 2 || H5Tget_member_index(type, "r") != 0 ||
          H5Tget_member_index(type, "i") != 1 || H5Tget_member_offset(type, 0) != 0 ||
          H5Tget_member_offset(type, 1) != size / 2) {
        break;
      }
      h5::Handle real = h5::type_handle(H5Tget_member_type(type, 0), "reading", where);
      h5::Handle imaginary = h5::type_handle(H5Tget_member_type(type, 1), "reading", where);
      if (H5Tget_class(real.get()) != H5T_FLOAT || H5Tequal(real.get(), imaginary.get()) <= 0) {
        break;
      }
      if (size == 16) return DType::kComplex128;
      if (size == 8) return DType::kComplex64;
      if (size == 4) return DType::kComplex32;
      break;
    }
    default:
      break;
  }
  throw FormatError(std::string(where) +
                    ": expected a numeric dataset (float, complex, integer or bool), but received "
                    "an HDF5 "
                    "type of class " +
                    std::to_string(H5Tget_class(type)) + " and size " + std::to_string(size));
}

h5::Handle index_row_type(bool with_chunk_location, bool with_chunk_hashes) {
  h5::Lock lock(h5::hdf5_mutex());
  h5::Handle row = h5::type_handle(H5Tcreate(H5T_COMPOUND, sizeof(IndexRow)), "defining", kWhere);
  const hid_t text = h5::string_type(kWhere);
  h5::Handle shape = h5::type_handle(H5Tvlen_create(H5T_NATIVE_INT64), "defining", kWhere);
  auto field = [&](std::string_view name, std::size_t offset, hid_t type) {
    h5::check(H5Tinsert(row.get(), std::string(name).c_str(), offset, type), "defining /index",
              kWhere);
  };
  field(schema::kIndexModule, offsetof(IndexRow, module), text);
  field(schema::kIndexCall, offsetof(IndexRow, call), H5T_NATIVE_UINT32);
  field(schema::kIndexKind, offsetof(IndexRow, kind), text);
  field(schema::kIndexTensorIndex, offsetof(IndexRow, tensor_index), H5T_NATIVE_UINT32);
  field(schema::kIndexSide, offsetof(IndexRow, side), text);
  field(schema::kIndexLabel, offsetof(IndexRow, label), text);
  field(schema::kIndexDtype, offsetof(IndexRow, dtype), text);
  field(schema::kIndexShape, offsetof(IndexRow, shape), shape.get());
  field(schema::kIndexStoredBytes, offsetof(IndexRow, stored_bytes), H5T_NATIVE_UINT64);
  if (with_chunk_location) {
    field(schema::kIndexChunkOffset, offsetof(IndexRow, chunk_offset), H5T_NATIVE_UINT64);
    field(schema::kIndexChunkFilterMask, offsetof(IndexRow, chunk_filter_mask), H5T_NATIVE_UINT32);
    field(schema::kIndexChunkHash, offsetof(IndexRow, chunk_hash), H5T_NATIVE_UINT64);
  }
  if (with_chunk_hashes) {
    field(schema::kIndexChunkHashesFirst, offsetof(IndexRow, chunk_hashes_first),
          H5T_NATIVE_UINT64);
    field(schema::kIndexChunkCount, offsetof(IndexRow, chunk_count), H5T_NATIVE_UINT64);
  }
  return row;
}

namespace {

template <typename T>
void append_int(std::string& out, T value) {
  static_assert(std::is_integral_v<T>);
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    out += static_cast<char>((static_cast<std::uint64_t>(value) >> (8 * i)) & 0xff);
  }
}

void append_text(std::string& out, std::string_view text) {
  append_int<std::uint64_t>(out, text.size());
  out.append(text);
}
void append_text(std::string& out, const char* text) {
  append_text(out, std::string_view(text ? text : ""));
}

// What the index checksums put after the rows: the chunk hashes, the step, the provenance.
void append_index_tail(std::string& out, const std::vector<std::uint64_t>& chunk_hashes,
                       std::int64_t step, const std::map<std::string, std::string>& provenance) {
  append_int<std::uint64_t>(out, chunk_hashes.size());
  for (std::uint64_t hash : chunk_hashes) append_int(out, hash);
  append_int(out, step);
  append_int<std::uint64_t>(out, provenance.size());
  for (const auto& [key, value] : provenance) {
    append_text(out, key.c_str());
    append_text(out, value.c_str());
  }
}

}  // namespace

std::uint64_t index_checksum(const std::vector<IndexRow>& rows,
                             const std::vector<std::uint64_t>& chunk_hashes, std::int64_t step,
                             const std::map<std::string, std::string>& provenance) {
  std::string bytes;
  bytes.reserve(rows.size() * 128 + chunk_hashes.size() * 8);
  append_int<std::uint64_t>(bytes, rows.size());
  for (const IndexRow& row : rows) {
    append_text(bytes, row.module);
    append_int(bytes, row.call);
    append_text(bytes, row.kind);
    append_int(bytes, row.tensor_index);
    append_text(bytes, row.side);
    append_text(bytes, row.label);
    append_text(bytes, row.dtype);
    append_int<std::uint64_t>(bytes, row.shape.len);
    const auto* dims = static_cast<const std::int64_t*>(row.shape.p);
    for (std::size_t i = 0; i < row.shape.len; ++i) append_int(bytes, dims[i]);
    append_int(bytes, row.stored_bytes);
    append_int(bytes, row.chunk_offset);
    append_int(bytes, row.chunk_filter_mask);
    append_int(bytes, row.chunk_hash);
    append_int(bytes, row.chunk_hashes_first);
    append_int(bytes, row.chunk_count);
  }
  append_index_tail(bytes, chunk_hashes, step, provenance);
  return xxh64(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size());
}

std::uint64_t index_checksum_v2(const std::vector<std::byte>& index_bytes,
                                const std::vector<std::uint64_t>& chunk_hashes, std::int64_t step,
                                const std::map<std::string, std::string>& provenance) {
  std::string bytes(reinterpret_cast<const char*>(index_bytes.data()), index_bytes.size());
  append_index_tail(bytes, chunk_hashes, step, provenance);
  return xxh3(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size());
}

std::uint64_t group_checksum(const std::vector<NamedAttributes>& entries, bool with_text) {
  std::string bytes;
  append_int<std::uint64_t>(bytes, entries.size());
  for (const NamedAttributes& entry : entries) {
    append_text(bytes, entry.name);
    if (with_text) append_text(bytes, entry.text);
    append_int<std::uint64_t>(bytes, entry.attributes.size());
    for (const auto& [key, value] : entry.attributes) {
      append_text(bytes, key);
      append_text(bytes, value);
    }
  }
  return xxh3(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size());
}

namespace {

// The fields of format 2.0's /index, in stored order.
enum class FieldType { kText, kU32, kU64, kShape };
struct IndexField {
  std::string_view name;
  FieldType type;
};
constexpr IndexField kIndexFields[] = {
    {schema::kIndexModule, FieldType::kText},     {schema::kIndexCall, FieldType::kU32},
    {schema::kIndexKind, FieldType::kText},       {schema::kIndexTensorIndex, FieldType::kU32},
    {schema::kIndexSide, FieldType::kText},       {schema::kIndexLabel, FieldType::kText},
    {schema::kIndexDtype, FieldType::kText},      {schema::kIndexRank, FieldType::kU32},
    {schema::kIndexShape, FieldType::kShape},     {schema::kIndexStoredBytes, FieldType::kU64},
    {schema::kIndexChunkOffset, FieldType::kU64}, {schema::kIndexChunkFilterMask, FieldType::kU32},
    {schema::kIndexChunkHash, FieldType::kU64},   {schema::kIndexChunkHashesFirst, FieldType::kU64},
    {schema::kIndexChunkCount, FieldType::kU64},
};
constexpr std::size_t kTextFields = 5;
constexpr std::size_t kMaxIndexRank = 64;  // above HDF5's 32: room to say "damaged" clearly

const char* text_of(const IndexRow& row, std::string_view field) {
  const char* text = field == schema::kIndexModule  ? row.module
                     : field == schema::kIndexKind  ? row.kind
                     : field == schema::kIndexSide  ? row.side
                     : field == schema::kIndexLabel ? row.label
                                                    : row.dtype;
  return text ? text : "";
}

std::uint64_t number_of(const IndexRow& row, std::string_view field) {
  if (field == schema::kIndexCall) return row.call;
  if (field == schema::kIndexTensorIndex) return row.tensor_index;
  if (field == schema::kIndexRank) return row.shape.len;
  if (field == schema::kIndexStoredBytes) return row.stored_bytes;
  if (field == schema::kIndexChunkOffset) return row.chunk_offset;
  if (field == schema::kIndexChunkFilterMask) return row.chunk_filter_mask;
  if (field == schema::kIndexChunkHash) return row.chunk_hash;
  if (field == schema::kIndexChunkHashesFirst) return row.chunk_hashes_first;
  return row.chunk_count;
}

}  // namespace

PackedIndex pack_index(const std::vector<IndexRow>& rows) {
  h5::Lock lock(h5::hdf5_mutex());
  std::map<std::string_view, std::size_t> text_size;
  std::size_t rank = 1;
  for (const IndexField& field : kIndexFields) {
    if (field.type == FieldType::kText) text_size[field.name] = 1;
  }
  for (const IndexRow& row : rows) {
    for (auto& [name, size] : text_size) size = std::max(size, std::strlen(text_of(row, name)));
    rank = std::max<std::size_t>(rank, row.shape.len);
  }
  std::vector<std::size_t> offsets;
  std::vector<h5::Handle> types;
  std::size_t row_size = 0;
  for (const IndexField& field : kIndexFields) {
    switch (field.type) {
      case FieldType::kText:
        types.push_back(h5::fixed_string_type(text_size[field.name], kWhere));
        break;
      case FieldType::kU32:
        types.push_back(copy_type(H5T_STD_U32LE));
        break;
      case FieldType::kU64:
        types.push_back(copy_type(H5T_STD_U64LE));
        break;
      case FieldType::kShape: {
        const hsize_t dims = rank;
        types.push_back(
            h5::type_handle(H5Tarray_create2(H5T_STD_I64LE, 1, &dims), "defining", kWhere));
        break;
      }
    }
    offsets.push_back(row_size);
    row_size += H5Tget_size(types.back().get());
  }
  PackedIndex packed;
  packed.type = h5::type_handle(H5Tcreate(H5T_COMPOUND, row_size), "defining /index", kWhere);
  for (std::size_t f = 0; f < std::size(kIndexFields); ++f) {
    h5::check(H5Tinsert(packed.type.get(), std::string(kIndexFields[f].name).c_str(), offsets[f],
                        types[f].get()),
              "defining /index", kWhere);
  }
  packed.bytes.assign(rows.size() * row_size, std::byte{0});
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::byte* out = packed.bytes.data() + r * row_size;
    for (std::size_t f = 0; f < std::size(kIndexFields); ++f) {
      const IndexField& field = kIndexFields[f];
      std::byte* at = out + offsets[f];
      if (field.type == FieldType::kText) {
        const char* text = text_of(rows[r], field.name);
        std::memcpy(at, text, std::strlen(text));
      } else if (field.type == FieldType::kShape) {
        std::memcpy(at, rows[r].shape.p, rows[r].shape.len * sizeof(std::int64_t));
      } else if (field.type == FieldType::kU32) {
        const auto value = static_cast<std::uint32_t>(number_of(rows[r], field.name));
        std::memcpy(at, &value, sizeof(value));  // little-endian hosts, as the type says
      } else {
        const std::uint64_t value = number_of(rows[r], field.name);
        std::memcpy(at, &value, sizeof(value));
      }
    }
  }
  return packed;
}

void refuse_variable_length(hid_t type, const std::string& where) {
  h5::Lock lock(h5::hdf5_mutex());
  const H5T_class_t type_class = H5Tget_class(type);
  if (type_class == H5T_VLEN || (type_class == H5T_STRING && H5Tis_variable_str(type) > 0)) {
    throw FormatError(where + ": damaged: holds variable-length data, which format 2.0 never has");
  }
  if (type_class == H5T_COMPOUND) {
    const int members = H5Tget_nmembers(type);
    for (int m = 0; m < members; ++m) {
      h5::Handle member = h5::type_handle(H5Tget_member_type(type, static_cast<unsigned>(m)),
                                          "reading a field type", where);
      refuse_variable_length(member.get(), where);
    }
  } else if (type_class == H5T_ARRAY) {
    h5::Handle base = h5::type_handle(H5Tget_super(type), "reading an array type", where);
    refuse_variable_length(base.get(), where);
  }
}

UnpackedIndex::UnpackedIndex(hid_t type, const std::vector<std::byte>& bytes,
                             const std::string& where) {
  h5::Lock lock(h5::hdf5_mutex());
  const std::string context = where + ": damaged /index";
  const std::size_t row_size = H5Tget_size(type);
  if (H5Tget_class(type) != H5T_COMPOUND || row_size == 0 || bytes.size() % row_size != 0) {
    throw FormatError(context + ": expected a table of fixed-size rows");
  }
  refuse_variable_length(type, where + " /index");
  struct Located {
    std::size_t offset = 0, size = 0, rank = 0;
  };
  std::vector<Located> at;
  for (const IndexField& field : kIndexFields) {
    const std::string name(field.name);
    const int member = H5Tget_member_index(type, name.c_str());
    if (member < 0) throw FormatError(context + ": no field '" + name + "'");
    h5::Handle stored = h5::type_handle(H5Tget_member_type(type, static_cast<unsigned>(member)),
                                        "reading the index type", where);
    Located located{H5Tget_member_offset(type, static_cast<unsigned>(member)),
                    H5Tget_size(stored.get()), 0};
    bool expected = false;
    switch (field.type) {
      case FieldType::kText:
        expected = H5Tget_class(stored.get()) == H5T_STRING;
        break;
      case FieldType::kU32:
        expected = H5Tequal(stored.get(), H5T_STD_U32LE) > 0;
        break;
      case FieldType::kU64:
        expected = H5Tequal(stored.get(), H5T_STD_U64LE) > 0;
        break;
      case FieldType::kShape: {
        hsize_t dims = 0;
        if (H5Tget_class(stored.get()) == H5T_ARRAY && H5Tget_array_ndims(stored.get()) == 1 &&
            H5Tget_array_dims2(stored.get(), &dims) == 1) {
          h5::Handle base = h5::type_handle(H5Tget_super(stored.get()), "reading", where);
          expected = H5Tequal(base.get(), H5T_STD_I64LE) > 0 && dims >= 1 && dims <= kMaxIndexRank;
          located.rank = dims;
        }
        break;
      }
    }
    if (!expected || located.offset + located.size > row_size) {
      throw FormatError(context + ": field '" + name + "' is not of the type format 2.0 gives it");
    }
    at.push_back(located);
  }
  const std::size_t count = bytes.size() / row_size;
  text_.reserve(count * kTextFields);
  std::size_t max_rank = 0;
  for (std::size_t f = 0; f < std::size(kIndexFields); ++f) {
    if (kIndexFields[f].type == FieldType::kShape) max_rank = at[f].rank;
  }
  dims_.reserve(count * max_rank);
  rows_.resize(count);
  for (std::size_t r = 0; r < count; ++r) {
    const std::byte* in = bytes.data() + r * row_size;
    IndexRow& row = rows_[r];
    std::uint32_t rank = 0;
    for (std::size_t f = 0; f < std::size(kIndexFields); ++f) {
      const IndexField& field = kIndexFields[f];
      const std::byte* p = in + at[f].offset;
      if (field.type == FieldType::kText) {
        text_.push_back(h5::fixed_string(reinterpret_cast<const char*>(p), at[f].size));
        const char* text = text_.back().c_str();
        if (field.name == schema::kIndexModule) row.module = text;
        if (field.name == schema::kIndexKind) row.kind = text;
        if (field.name == schema::kIndexSide) row.side = text;
        if (field.name == schema::kIndexLabel) row.label = text;
        if (field.name == schema::kIndexDtype) row.dtype = text;
      } else if (field.type == FieldType::kShape) {
        if (rank > at[f].rank) {
          throw FormatError(context + ": row " + std::to_string(r) + " has rank " +
                            std::to_string(rank) + ", more than its shape field holds (" +
                            std::to_string(at[f].rank) + ")");
        }
        const std::size_t first = dims_.size();
        for (std::size_t d = 0; d < rank; ++d) {
          std::int64_t dim = 0;
          std::memcpy(&dim, p + d * sizeof(dim), sizeof(dim));
          dims_.push_back(dim);
        }
        row.shape = hvl_t{rank, dims_.data() + first};
      } else if (field.type == FieldType::kU32) {
        std::uint32_t value = 0;
        std::memcpy(&value, p, sizeof(value));
        if (field.name == schema::kIndexCall) row.call = value;
        if (field.name == schema::kIndexTensorIndex) row.tensor_index = value;
        if (field.name == schema::kIndexRank) rank = value;
        if (field.name == schema::kIndexChunkFilterMask) row.chunk_filter_mask = value;
      } else {
        std::uint64_t value = 0;
        std::memcpy(&value, p, sizeof(value));
        if (field.name == schema::kIndexStoredBytes) row.stored_bytes = value;
        if (field.name == schema::kIndexChunkOffset) row.chunk_offset = value;
        if (field.name == schema::kIndexChunkHash) row.chunk_hash = value;
        if (field.name == schema::kIndexChunkHashesFirst) row.chunk_hashes_first = value;
        if (field.name == schema::kIndexChunkCount) row.chunk_count = value;
      }
    }
  }
}

namespace {

hid_t native_type(MetricType type) {
  switch (type) {
    case MetricType::kFloat64:
      return H5T_NATIVE_DOUBLE;
    case MetricType::kInt64:
      return H5T_NATIVE_INT64;
    case MetricType::kBool:
      return H5T_NATIVE_UINT8;
    case MetricType::kUInt64:
    case MetricType::kHistogram:
      break;
  }
  return H5T_NATIVE_UINT64;
}

}  // namespace

h5::Handle metrics_row_type() {
  h5::Lock lock(h5::hdf5_mutex());
  h5::Handle row = h5::type_handle(H5Tcreate(H5T_COMPOUND, sizeof(MetricsRow)), "defining", kWhere);
  const auto insert = [&](std::string_view name, std::size_t offset, hid_t type) {
    h5::check(H5Tinsert(row.get(), std::string(name).c_str(), offset, type), "defining /metrics",
              kWhere);
  };
  insert("record", offsetof(MetricsRow, record), H5T_NATIVE_UINT64);
  insert("atol", offsetof(MetricsRow, tolerances) + offsetof(Tolerances, atol), H5T_NATIVE_DOUBLE);
  insert("rtol", offsetof(MetricsRow, tolerances) + offsetof(Tolerances, rtol), H5T_NATIVE_DOUBLE);
  for (const MetricField& field : kMetricFields) {
    const std::size_t offset = offsetof(MetricsRow, metrics) + field.offset;
    if (field.type == MetricType::kHistogram) {
      const hsize_t bins = kHistogramBins;
      h5::Handle array =
          h5::type_handle(H5Tarray_create2(H5T_NATIVE_UINT64, 1, &bins), "defining", kWhere);
      insert(field.name, offset, array.get());
    } else {
      insert(field.name, offset, native_type(field.type));
    }
  }
  return row;
}

}  // namespace dynaprobe::formats
