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
    default:
      break;
  }
  throw FormatError(std::string(where) +
                    ": expected a numeric dataset (float, integer or bool), but received an HDF5 "
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

void append_text(std::string& out, const char* text) {
  const std::string_view view = text ? text : "";
  append_int<std::uint64_t>(out, view.size());
  out.append(view);
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
  append_int<std::uint64_t>(bytes, chunk_hashes.size());
  for (std::uint64_t hash : chunk_hashes) append_int(bytes, hash);
  append_int(bytes, step);
  append_int<std::uint64_t>(bytes, provenance.size());
  for (const auto& [key, value] : provenance) {
    append_text(bytes, key.c_str());
    append_text(bytes, value.c_str());
  }
  return xxh64(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size());
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
