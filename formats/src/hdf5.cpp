#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "direct_driver.h"
#include "dynaprobe/formats/filters.h"
#include "h5.h"

namespace dynaprobe::formats::h5 {

std::recursive_mutex& hdf5_mutex() {
  static std::recursive_mutex mutex;
  return mutex;
}

Lock::Lock(std::recursive_mutex& mutex) : guard_(mutex) {
  // No H5close at exit. In HDF5 < 1.14.1 a file whose H5Fclose fails (its final flush hits a
  // full disk or a file-size limit) is freed but stays in the ID table, and the exit-time
  // H5_term_library then closes it again and crashes
  // (https://github.com/HDFGroup/hdf5/issues/2257, fixed by #2291): a training process whose
  // capture failed would still segfault at exit. Every file dynaprobe opens is closed by its RAII
  // handle, so the exit-time cleanup has nothing to do. Must precede every other HDF5 call, so it
  // is done by the first Lock (every HDF5 call holds one); otherwise a no-op.
  static const bool no_atexit = [] {
    H5dont_atexit();
    return true;
  }();
  (void)no_atexit;
  thread_local bool silenced = false;
  if (!silenced) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    silenced = true;
  }
}

void init() {
  static std::once_flag once;
  std::call_once(once, [] {
    Lock lock(hdf5_mutex());
    H5open();
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    register_zstd_filter();
  });
}

std::string error_stack() {
  std::string text;
  auto walk = [](unsigned, const H5E_error2_t* error, void* data) -> herr_t {
    auto& out = *static_cast<std::string*>(data);
    char minor[256] = "";
    H5Eget_msg(error->min_num, nullptr, minor, sizeof(minor));
    if (!out.empty()) out += "; ";
    out += std::string(error->func_name) + "(): " + (error->desc ? error->desc : "") +
           (minor[0] ? std::string(" [") + minor + "]" : std::string());
    return 0;
  };
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, walk, &text);
  return text.empty() ? "no HDF5 error stack" : text;
}

Handle& Handle::operator=(Handle&& other) noexcept {
  if (this != &other) {
    reset();
    id_ = other.id_;
    closer_ = other.closer_;
    other.id_ = -1;
  }
  return *this;
}

void Handle::reset() {
  if (id_ >= 0) {
    Lock lock(hdf5_mutex());
    closer_(id_);
    id_ = -1;
  }
}

void Handle::close(std::string_view where) {
  if (id_ < 0) return;
  Lock lock(hdf5_mutex());
  const hid_t id = id_;
  id_ = -1;
  check(closer_(id), "closing", where);
}

Handle file_handle(hid_t id, std::string_view what, std::string_view where) {
  return Handle(check(id, what, where), H5Fclose);
}
Handle group_handle(hid_t id, std::string_view what, std::string_view where) {
  return Handle(check(id, what, where), H5Gclose);
}
Handle dataset_handle(hid_t id, std::string_view what, std::string_view where) {
  return Handle(check(id, what, where), H5Dclose);
}
Handle space_handle(hid_t id, std::string_view what, std::string_view where) {
  return Handle(check(id, what, where), H5Sclose);
}
Handle type_handle(hid_t id, std::string_view what, std::string_view where) {
  return Handle(check(id, what, where), H5Tclose);
}
Handle plist_handle(hid_t id, std::string_view what, std::string_view where) {
  return Handle(check(id, what, where), H5Pclose);
}
Handle attribute_handle(hid_t id, std::string_view what, std::string_view where) {
  return Handle(check(id, what, where), H5Aclose);
}

// Made once: attributes are read for every dataset a comparison opens.
hid_t string_type(std::string_view where) {
  static const Handle type = [&] {
    Handle made = type_handle(H5Tcopy(H5T_C_S1), "creating a string type", where);
    check(H5Tset_size(made.get(), H5T_VARIABLE), "creating a string type", where);
    check(H5Tset_cset(made.get(), H5T_CSET_UTF8), "creating a string type", where);
    return made;
  }();
  return type.get();
}

std::optional<Handle> open_group_if_present(hid_t file, const std::string& path,
                                            std::string_view where) {
  Lock lock(hdf5_mutex());
  if (H5Lexists(file, path.c_str(), H5P_DEFAULT) <= 0) return std::nullopt;
  return group_handle(H5Gopen2(file, path.c_str(), H5P_DEFAULT), "opening " + path, where);
}

Handle fixed_string_type(std::size_t size, std::string_view where) {
  Handle type = type_handle(H5Tcopy(H5T_C_S1), "creating a string type", where);
  check(H5Tset_size(type.get(), std::max<std::size_t>(size, 1)), "creating a string type", where);
  check(H5Tset_strpad(type.get(), H5T_STR_NULLPAD), "creating a string type", where);
  check(H5Tset_cset(type.get(), H5T_CSET_UTF8), "creating a string type", where);
  return type;
}

std::string fixed_string(const char* data, std::size_t size) {
  return std::string(data, strnlen(data, size));
}

void write_string_attribute(hid_t object, std::string_view name, std::string_view value,
                            std::string_view where) {
  Lock lock(hdf5_mutex());
  const std::string attribute_name(name);
  const std::string context = std::string(where) + " attribute " + attribute_name;
  Handle type = fixed_string_type(value.size(), context);
  Handle space = space_handle(H5Screate(H5S_SCALAR), "creating a dataspace", context);
  Handle attribute = attribute_handle(
      H5Acreate2(object, attribute_name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT),
      "creating attribute", context);
  std::string text(value);
  text.resize(std::max<std::size_t>(text.size(), 1), '\0');
  check(H5Awrite(attribute.get(), type.get(), text.data()), "writing attribute", context);
}

void write_u64_attribute(hid_t object, std::string_view name, std::uint64_t value,
                         std::string_view where) {
  Lock lock(hdf5_mutex());
  const std::string attribute_name(name);
  const std::string context = std::string(where) + " attribute " + attribute_name;
  Handle space = space_handle(H5Screate(H5S_SCALAR), "creating a dataspace", context);
  Handle attribute = attribute_handle(H5Acreate2(object, attribute_name.c_str(), H5T_STD_U64LE,
                                                 space.get(), H5P_DEFAULT, H5P_DEFAULT),
                                      "creating attribute", context);
  check(H5Awrite(attribute.get(), H5T_NATIVE_UINT64, &value), "writing attribute", context);
}

std::uint64_t read_u64_attribute(hid_t object, std::string_view name, std::string_view what,
                                 std::string_view where) {
  Lock lock(hdf5_mutex());
  const std::string attribute_name(name);
  const std::string context(where);
  if (H5Aexists(object, attribute_name.c_str()) <= 0) {
    throw FormatError(context + ": damaged " + std::string(what) + ": no '" + attribute_name +
                      "' attribute, which its format has");
  }
  Handle attribute = attribute_handle(H5Aopen(object, attribute_name.c_str(), H5P_DEFAULT),
                                      "opening attribute " + attribute_name, context);
  Handle space = space_handle(H5Aget_space(attribute.get()), "reading attribute", context);
  if (H5Sget_simple_extent_npoints(space.get()) != 1) {
    throw FormatError(context + ": damaged " + std::string(what) + ": its '" + attribute_name +
                      "' attribute is not one number");
  }
  std::uint64_t value = 0;
  check<FormatError>(H5Aread(attribute.get(), H5T_NATIVE_UINT64, &value),
                     "reading attribute " + attribute_name, context);
  return value;
}

bool has_attribute(hid_t object, std::string_view name) {
  Lock lock(hdf5_mutex());
  return H5Aexists(object, std::string(name).c_str()) > 0;
}

std::string read_string_attribute(hid_t object, std::string_view name, std::string_view where,
                                  bool allow_variable) {
  Lock lock(hdf5_mutex());
  const std::string attribute_name(name);
  const std::string context = std::string(where) + " attribute " + attribute_name;
  const hid_t opened = H5Aopen(object, attribute_name.c_str(), H5P_DEFAULT);
  if (opened < 0 && !has_attribute(object, name)) {
    throw FormatError("missing attribute '" + attribute_name + "' on " + std::string(where));
  }
  Handle attribute = attribute_handle(opened, "opening attribute", context);
  Handle stored = type_handle(H5Aget_type(attribute.get()), "reading attribute type", context);
  if (H5Tget_class(stored.get()) != H5T_STRING) {
    throw FormatError("attribute '" + attribute_name + "' on " + std::string(where) +
                      ": expected a string, but received another HDF5 type");
  }
  Handle space = space_handle(H5Aget_space(attribute.get()), "reading attribute", context);
  if (H5Sget_simple_extent_npoints(space.get()) != 1) {
    throw FormatError("attribute '" + attribute_name + "' on " + std::string(where) +
                      ": expected one string, but it holds " +
                      std::to_string(H5Sget_simple_extent_npoints(space.get())));
  }
  if (H5Tis_variable_str(stored.get()) > 0) {
    if (!allow_variable) {
      throw FormatError("attribute '" + attribute_name + "' on " + std::string(where) +
                        ": damaged: a variable-length string, which its format (2.0) never "
                        "has");
    }
    char* pointer = nullptr;
    check<FormatError>(H5Aread(attribute.get(), string_type(context), &pointer),
                       "reading attribute", context);
    std::string value = pointer ? pointer : "";
    H5free_memory(pointer);
    return value;
  }
  // An attribute lives in its object header, which HDF5 keeps under 64 KiB unless it moves it to
  // dense storage; anything near this bound is damage, not text.
  constexpr std::size_t kMaxAttributeBytes = 64 << 20;
  const std::size_t size = H5Tget_size(stored.get());
  if (size == 0 || size > kMaxAttributeBytes) {
    throw FormatError("attribute '" + attribute_name + "' on " + std::string(where) +
                      ": damaged: a string of " + std::to_string(size) + " bytes");
  }
  std::string value(size, '\0');
  check<FormatError>(H5Aread(attribute.get(), stored.get(), value.data()), "reading attribute",
                     context);
  return fixed_string(value.data(), size);
}

std::vector<std::string> attribute_names(hid_t object, std::string_view where) {
  Lock lock(hdf5_mutex());
  std::vector<std::string> names;
  auto collect = [](hid_t, const char* name, const H5A_info_t*, void* data) -> herr_t {
    static_cast<std::vector<std::string>*>(data)->emplace_back(name);
    return 0;
  };
  check<FormatError>(H5Aiterate2(object, H5_INDEX_NAME, H5_ITER_INC, nullptr, collect, &names),
                     "listing attributes", where);
  return names;
}

std::vector<std::string> link_names(hid_t group, bool creation_order, std::string_view where) {
  Lock lock(hdf5_mutex());
  std::vector<std::string> names;
  auto collect = [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
    static_cast<std::vector<std::string>*>(data)->emplace_back(name);
    return 0;
  };
  check<FormatError>(H5Literate(group, creation_order ? H5_INDEX_CRT_ORDER : H5_INDEX_NAME,
                                H5_ITER_INC, nullptr, collect, &names),
                     "listing group", where);
  return names;
}

int file_descriptor(hid_t file) {
  Lock lock(hdf5_mutex());
  const hid_t fapl = H5Fget_access_plist(file);
  if (fapl < 0) return -1;
  const hid_t driver = H5Pget_driver(fapl);
  const bool posix = driver == H5FD_SEC2 || driver == direct_writes_driver();
  H5Pclose(fapl);
  void* handle = nullptr;
  if (!posix || H5Fget_vfd_handle(file, H5P_DEFAULT, &handle) < 0 || handle == nullptr) return -1;
  return *static_cast<int*>(handle);
}

bool read_at(int fd, std::byte* data, std::size_t size, std::uint64_t offset) {
  std::size_t done = 0;
  while (done < size) {
    const ssize_t got = ::pread(fd, data + done, size - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    done += static_cast<std::size_t>(got);
  }
  return true;
}

std::optional<ChunkLocation> first_chunk_location(hid_t dataset, std::size_t rank) {
  const std::vector<hsize_t> origin(rank, 0);
  unsigned filter_mask = 0;
  haddr_t offset = HADDR_UNDEF;
  hsize_t size = 0;
  if (H5Dget_chunk_info_by_coord(dataset, origin.data(), &filter_mask, &offset, &size) < 0 ||
      offset == HADDR_UNDEF) {
    return std::nullopt;
  }
  return ChunkLocation{offset, size, filter_mask};
}

}  // namespace dynaprobe::formats::h5
