// StepReader: a step file's attributes and index, its graphs and modules, and its records as
// TensorStreams, whichever dump format generation wrote it: the phases here are the same for
// every generation, and what differs is asked of the file's FormatReader (format_reader.h).
#include "dynaprobe/formats/reader.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include "dynaprobe/formats/record.h"
#include "dynaprobe/formats/schema.h"
#include "format_reader.h"
#include "h5.h"
#include "hdf5_types.h"
#include "step_index.h"
#include "tensor_stream.h"

namespace dynaprobe::formats {
namespace fs = std::filesystem;

ReadBatch::ReadBatch() : lock_(std::make_unique<h5::Lock>(h5::hdf5_mutex())) {}
ReadBatch::~ReadBatch() = default;

std::uint64_t RecordInfo::numel() const { return shape_numel(shape); }

struct StepReader::Impl {
  fs::path path;
  std::shared_ptr<h5::Handle> file;
  int fd = -1;  // the file's descriptor, for reading single-chunk records by their offset
  // The generation that reads the file (a pending step: the current one).
  const FormatReader* format = &format_2_reader();
  std::int64_t step = 0;
  std::string format_version;
  Provenance provenance;
  std::vector<RecordInfo> records;
  std::map<RecordKey, std::size_t> by_key;
  std::vector<std::string> skipped;
  std::vector<StoredMetrics> metrics;
  std::map<RecordKey, std::size_t> metrics_by_key;

  // A pending step (StepReader(PendingStep)): what it keeps in memory, and the committed file's
  // reader once something needed it.
  bool pending = false;
  std::vector<ModuleInfo> modules;
  std::map<RecordKey, std::vector<std::byte>> small_tensors;
  std::function<void()> wait_committed;
  std::mutex committed_mutex;
  std::unique_ptr<StepReader> committed;

  void index_by_key() {
    for (std::size_t i = 0; i < records.size(); ++i) by_key.emplace(records[i].key, i);
    for (std::size_t i = 0; i < metrics.size(); ++i) metrics_by_key.emplace(metrics[i].key, i);
  }
  // The committed file's reader (waits for the commit) and its row of `record`.
  std::pair<const StepReader*, const RecordInfo*> on_disk(const RecordInfo& record) {
    const StepReader& reader = committed_file();
    const RecordInfo* info = reader.find(record.key);
    if (!info) {
      throw FormatError(path.string() + ": record " + to_string(record.key) +
                        " is missing from the committed step");
    }
    return {&reader, info};
  }
  const StepReader& committed_file() {
    std::lock_guard lock(committed_mutex);
    if (!committed) {
      wait_committed();
      committed = std::make_unique<StepReader>(path);
    }
    return *committed;
  }
};

namespace {

FormatVersion read_format_version(hid_t file, const std::string& where) {
  if (!h5::has_attribute(file, schema::kFormatVersionAttr)) {
    throw FormatError(where + ": not a dynaprobe step file (no '" +
                      std::string(schema::kFormatVersionAttr) + "' attribute on /)");
  }
  // Format 1 wrote it variable-length, 2.0 fixed-length: which one tells the versions apart before
  // any variable-length read of a 2.0 file.
  bool variable = false;
  {
    h5::Handle attribute = h5::attribute_handle(
        H5Aopen(file, std::string(schema::kFormatVersionAttr).c_str(), H5P_DEFAULT),
        "opening the format version", where);
    h5::Handle type =
        h5::type_handle(H5Aget_type(attribute.get()), "reading the format version", where);
    variable = H5Tget_class(type.get()) == H5T_STRING && H5Tis_variable_str(type.get()) > 0;
  }
  FormatVersion version = parse_format_version(
      h5::read_string_attribute(file, schema::kFormatVersionAttr, where), where);
  if (variable && version.major >= 2) {
    throw FormatError(where + ": damaged: its format version attribute says " + version.text +
                      ", but is stored as format 1 stores it");
  }
  return version;
}

// Provenance: every other string attribute of the root group.
Provenance read_provenance(hid_t file, const FormatReader& format, const std::string& where) {
  Provenance provenance;
  for (const std::string& key : h5::attribute_names(file, where)) {
    if (key == schema::kFormatVersionAttr || key == schema::kStepAttr) continue;
    try {
      provenance[key] = format.read_string(file, key, where);
    } catch (const FormatError&) {  // not a string: not provenance written by dynaprobe
    }
  }
  return provenance;
}

// The records of the index's rows, in order; `record_of_index_row` says where each row went,
// -1 for a row skipped (/metrics names index rows).
std::vector<RecordInfo> records_of_index(const IndexTable& index, const FormatVersion& version,
                                         const FormatReader& format, std::int64_t step,
                                         const std::string& where,
                                         std::vector<std::int64_t>& record_of_index_row,
                                         std::vector<std::string>& skipped) {
  std::vector<RecordInfo> records;
  records.reserve(index.rows().size());
  record_of_index_row.assign(index.rows().size(), -1);
  for (std::size_t i = 0; i < index.rows().size(); ++i) {
    std::string unknown;
    std::optional<RecordInfo> info =
        record_of_row(index.rows()[i], i, step, index.chunk_hashes(), where, unknown);
    if (!info) {
      // A newer minor version may add kinds, sides or dtypes: such records are listed as
      // skipped, and everything this reader understands stays readable. In a file of a version
      // this reader knows, an unknown name can only be damage.
      if (!version.newer()) {
        throw FormatError(where + ": damaged /index: " + unknown + ", which format " +
                          version.text +
                          " does not have; the file is corrupt (re-capture or re-copy it)");
      }
      skipped.push_back(unknown + ", written by a newer dynaprobe (format " + version.text + ")");
      continue;
    }
    info->stored = format.stores_tensor(*info, version);
    record_of_index_row[i] = static_cast<std::int64_t>(records.size());
    records.push_back(std::move(*info));
  }
  return records;
}

}  // namespace

StepReader::StepReader(const fs::path& path) : impl_(std::make_unique<Impl>()) {
  Impl& impl = *impl_;
  impl.path = path;
  impl.file = open_file(path);
  impl.fd = h5::file_descriptor(impl.file->get());
  const std::string where = path.string();
  h5::Lock lock(h5::hdf5_mutex());
  const hid_t file = impl.file->get();
  const FormatVersion version = read_format_version(file, where);
  const FormatReader& format = format_reader(version);
  impl.format = &format;
  impl.format_version = version.text;
  impl.step = parse_step(format.read_string(file, schema::kStepAttr, where), where);
  impl.provenance = read_provenance(file, format, where);
  const auto index = format.read_index(file, version, impl.step, impl.provenance, where);
  std::vector<std::int64_t> record_of_index_row;
  impl.records = records_of_index(*index, version, format, impl.step, where, record_of_index_row,
                                  impl.skipped);
  impl.metrics = read_stored_metrics(file, impl.records, record_of_index_row, format.hash(), where);
  impl.index_by_key();
}

StepReader::StepReader(PendingStep pending) : impl_(std::make_unique<Impl>()) {
  Impl& impl = *impl_;
  impl.pending = true;
  impl.path = std::move(pending.file);
  impl.format_version =
      std::to_string(schema::kFormatMajor) + "." + std::to_string(schema::kFormatMinor);
  impl.step = pending.step;
  impl.provenance = std::move(pending.provenance);
  impl.records = std::move(pending.records);
  impl.metrics = std::move(pending.metrics);
  impl.modules = std::move(pending.modules);
  impl.small_tensors = std::move(pending.small_tensors);
  impl.wait_committed = std::move(pending.wait_committed);
  impl.index_by_key();
}

StepReader::~StepReader() = default;
StepReader::StepReader(StepReader&&) noexcept = default;
StepReader& StepReader::operator=(StepReader&&) noexcept = default;

const fs::path& StepReader::path() const& { return impl_->path; }
fs::path StepReader::path() && { return impl_->path; }
std::int64_t StepReader::step() const { return impl_->step; }
const std::string& StepReader::format_version() const& { return impl_->format_version; }
std::string StepReader::format_version() && { return impl_->format_version; }
const Provenance& StepReader::provenance() const& { return impl_->provenance; }
Provenance StepReader::provenance() && { return impl_->provenance; }
const std::vector<RecordInfo>& StepReader::records() const& { return impl_->records; }
std::vector<RecordInfo> StepReader::records() && { return impl_->records; }
const std::vector<std::string>& StepReader::skipped_records() const& { return impl_->skipped; }
std::vector<std::string> StepReader::skipped_records() && { return impl_->skipped; }
const std::vector<StoredMetrics>& StepReader::stored_metrics() const& { return impl_->metrics; }
std::vector<StoredMetrics> StepReader::stored_metrics() && { return impl_->metrics; }

const StoredMetrics* StepReader::find_metrics(const RecordKey& key) const {
  auto found = impl_->metrics_by_key.find(key);
  return found == impl_->metrics_by_key.end() ? nullptr : &impl_->metrics[found->second];
}

const RecordInfo* StepReader::find(const RecordKey& key) const {
  auto found = impl_->by_key.find(key);
  return found == impl_->by_key.end() ? nullptr : &impl_->records[found->second];
}

namespace {

// A graph's source: one string, stored as the file's generation stores it.
std::string read_graph_text(hid_t dataset, const FormatReader& format, const std::string& context) {
  h5::Handle type = h5::type_handle(H5Dget_type(dataset), "reading graph type", context);
  h5::Handle space = h5::space_handle(H5Dget_space(dataset), "reading graph", context);
  if (H5Tget_class(type.get()) != H5T_STRING || H5Sget_simple_extent_npoints(space.get()) != 1) {
    throw FormatError(context + ": damaged: expected one string (the graph's source)");
  }
  return format.read_graph_text(dataset, type.get(), context);
}

}  // namespace

std::vector<Graph> StepReader::graphs() const {
  if (impl_->pending) return impl_->committed_file().graphs();
  const std::string where = impl_->path.string();
  const FormatReader& format = *impl_->format;
  h5::Lock lock(h5::hdf5_mutex());
  const hid_t file = impl_->file->get();
  std::vector<Graph> graphs;
  const std::string group_name = root_path(schema::kGraphsGroup);
  const auto group = h5::open_group_if_present(file, group_name, where);
  if (!group) {
    format.missing_group(group_name, where);
    return graphs;
  }
  std::vector<NamedAttributes> entries;
  const auto names = h5::link_names(group->get(), false, where);
  for (const std::string& name : names) {
    const std::string context = where + " /graphs/" + name;
    h5::Handle dataset = h5::dataset_handle(H5Dopen2(group->get(), name.c_str(), H5P_DEFAULT),
                                            "opening graph", context);
    Graph graph{name, "", read_graph_text(dataset.get(), format, context), {}};
    NamedAttributes entry{name, graph.text, {}};
    for (const std::string& key : h5::attribute_names(dataset.get(), context)) {
      std::string value = format.read_string(dataset.get(), key, context);
      entry.attributes[key] = value;
      if (key == schema::kGraphKindAttr) {
        graph.kind = std::move(value);
      } else {
        graph.attributes[key] = std::move(value);
      }
    }
    graphs.push_back(std::move(graph));
    entries.push_back(std::move(entry));
  }
  // A group checksum takes the graphs in byte order of their names.
  std::sort(entries.begin(), entries.end(),
            [](const NamedAttributes& a, const NamedAttributes& b) { return a.name < b.name; });
  format.verify_group(group->get(), std::move(entries), true, group_name, where);
  return graphs;
}

std::vector<ModuleInfo> StepReader::modules() const {
  if (impl_->pending) return impl_->modules;
  const std::string where = impl_->path.string();
  const FormatReader& format = *impl_->format;
  h5::Lock lock(h5::hdf5_mutex());
  const hid_t file = impl_->file->get();
  std::vector<ModuleInfo> modules;
  const std::string group_name = root_path(schema::kModulesGroup);
  const auto group = h5::open_group_if_present(file, group_name, where);
  if (!group) {
    format.missing_group(group_name, where);
    return modules;
  }
  std::vector<NamedAttributes> entries;
  const auto names = h5::link_names(group->get(), true, where);
  for (const std::string& name : names) {
    const std::string context = where + " /modules/" + name;
    h5::Handle module = h5::group_handle(H5Gopen2(group->get(), name.c_str(), H5P_DEFAULT),
                                         "opening module", context);
    ModuleInfo info{name, {}};
    for (const std::string& key : h5::attribute_names(module.get(), context)) {
      info.attributes[key] = format.read_string(module.get(), key, context);
    }
    entries.push_back(NamedAttributes{name, "", {info.attributes.begin(), info.attributes.end()}});
    modules.push_back(std::move(info));
  }
  format.verify_group(group->get(), std::move(entries), false, group_name, where);
  return modules;
}

void StepReader::wait_readable() const {
  if (impl_->pending) impl_->committed_file();
}

TensorStream StepReader::open(const RecordInfo& record) const {
  if (!record.stored) {
    throw FormatError(impl_->path.string() + ": record " + to_string(record.key) +
                      " was judged at capture and its tensor not stored (PrecisionChecker(dump="
                      "\"failing\" or \"stats\")): only its dtype, shape and metrics are in the "
                      "dump");
  }
  if (impl_->pending) {
    const auto [reader, info] = impl_->on_disk(record);
    return reader->open(*info);
  }
  // Most records of a step are small, and opening a dataset costs more than reading and checking
  // its bytes: a single-chunk record is read at the offset /index gives, checked by its hash.
  if (is_located(impl_->fd, record)) {
    return located_stream(impl_->file, impl_->fd, record, impl_->path.string(), *impl_->format);
  }
  const std::string name = dataset_path(record.key);
  const auto state = [&] {
    try {
      return open_state(impl_->file, name, impl_->path.string(), record.dtype, *impl_->format);
    } catch (const FormatError& error) {
      throw FormatError("record " + to_string(record.key) + ": " + error.what());
    }
  }();
  if (state->shape != record.shape) {
    throw FormatError(impl_->path.string() + " " + name + ": the index says shape " +
                      shape_string(record.shape) + ", but the dataset has shape " +
                      shape_string(state->shape));
  }
  impl_->format->take_chunk_hashes(*state, record);
  return TensorStream(state);
}

std::vector<std::byte> StepReader::read(const RecordInfo& record) const {
  if (impl_->pending) {
    auto kept = impl_->small_tensors.find(record.key);
    if (kept != impl_->small_tensors.end()) return kept->second;
    const auto [reader, info] = impl_->on_disk(record);
    return reader->read(*info);
  }
  TensorStream stream = open(record);
  std::vector<std::byte> data(record.nbytes());
  const std::size_t element_size = dtype_size(record.dtype);
  stream_chunks(
      stream,
      [&](ChunkExtent extent, const std::byte* chunk) {
        std::memcpy(data.data() + extent.first_element * element_size, chunk,
                    extent.element_count * element_size);
      },
      ChunkOrder::kAnyOrder);
  return data;
}

DumpFiles list_dump(const fs::path& dump) {
  std::error_code error;
  const auto status = fs::status(dump, error);
  if (!fs::exists(status)) {
    throw IoError(dump.string() +
                  ": no such file or folder (expected a dump folder or a step file)");
  }
  DumpFiles files;
  if (fs::is_regular_file(status)) {
    files.steps.push_back(dump);
    return files;
  }
  std::vector<std::pair<std::int64_t, fs::path>> steps;
  for (const auto& entry : fs::directory_iterator(dump, error)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(schema::kStepFilePrefix)) continue;
    if (name.ends_with(schema::kPartialSuffix)) {
      files.unfinished.push_back(entry.path());
      continue;
    }
    std::error_code not_file;  // a dangling link is no step file, and no listing error
    const auto step = step_of_file_name(entry.path());
    if (step && entry.is_regular_file(not_file)) steps.emplace_back(*step, entry.path());
  }
  if (error) throw IoError(dump.string() + ": cannot list folder: " + error.message());
  std::sort(steps.begin(), steps.end());
  for (auto& [step, path] : steps) files.steps.push_back(std::move(path));
  std::sort(files.unfinished.begin(), files.unfinished.end());
  return files;
}

}  // namespace dynaprobe::formats
