// format_bench: how fast dynaprobe writes and reads dump steps, against memcpy of the same bytes
// and against plain filtered HDF5 (one H5Dwrite / H5Dread through HDF5's own shuffle + zstd
// pipeline, the way h5py with hdf5plugin.Zstd writes). Prints the figures of docs/performance.md
// and whether each target is met.
//
//   format_bench [--mib N] [--reps N] [--tensors N] [--threads N] [--dir PATH] [--steps N]
//                [--zstd-level N] [--default-malloc]
//
// Cases: (a) Gaussian float32, (b) float32 rounded to bfloat16 precision (the low 16 bits zero,
// as activations of mixed-precision training are), (c) native bfloat16 (2-byte values), each
// --mib MiB as one (rows, 4096) tensor; (d) --tensors tensors of 4 KiB written in one step and
// read back one by one. Every figure is the best of --reps repetitions; files are read right
// after they are written (from the page cache) and removed at the end. With --steps N, (b) is also
// written N times in a row into one dump folder, as a run writes its steps, and the median step
// is reported: the best single step of a fresh folder hides what a writer leaves for later (dirty
// pages to write back, a page cache to shrink).
#include <fcntl.h>
#include <hdf5.h>
#include <malloc.h>
#include <sys/resource.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "bench_common.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/filters.h"
#include "dynaprobe/formats/reader.h"
#include "dynaprobe/formats/writer.h"
#include "h5.h"  // formats/src: private, for white-box tests and benchmarks

namespace {

namespace fs = std::filesystem;
namespace fmt = dynaprobe::formats;
using namespace dynaprobe::bench;

constexpr int kZstdFilterId = 32015;
// Plain HDF5's level: the fastest positive one, what an h5py user picks for speed. dynaprobe's
// writer takes --zstd-level (default WriterOptions', zstd's fast mode with Huffman literals).
constexpr unsigned kPlainZstdLevel = 1;
constexpr std::int64_t kColumns = 4096;
constexpr std::size_t kTensorsPerModule = 100;

struct Options {
  std::size_t mib = 256;
  int reps = 3;
  std::size_t tensors = 10000;
  std::size_t tensor_bytes = 4096;
  int threads = 0;
  fs::path dir;
  std::size_t steps = 0;
  int zstd_level = fmt::kDefaultZstdLevel;
  bool default_malloc = false;
};

[[noreturn]] void usage(const char* message) {
  std::fprintf(stderr,
               "format_bench: %s\n"
               "usage: format_bench [--mib N] [--reps N] [--tensors N] [--threads N] [--dir PATH]\n"
               "                    [--steps N] [--zstd-level N] [--default-malloc]\n"
               "  --mib N      size of each large case in MiB (default 256)\n"
               "  --reps N     repetitions, the best is reported (default 3)\n"
               "  --tensors N  number of 4 KiB tensors in the small-tensor case (default 10000)\n"
               "  --threads N  writer compression threads (default 0: all cores)\n"
               "  --dir PATH   where the temporary files go (default: the system temp folder)\n"
               "  --steps N    also write (b) N times in a row into one folder, as a run's steps;\n"
               "               report the median step (default 0: not measured)\n"
               "  --zstd-level N  dynaprobe's zstd level (default: the writer's, %d); plain\n"
               "               HDF5 compresses at level 1\n"
               "  --default-malloc  keep glibc's adaptive heap (see tune_malloc in the source)\n",
               message, fmt::kDefaultZstdLevel);
  std::exit(2);
}

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") usage("benchmark of the dump format");
    if (flag == "--default-malloc") {
      options.default_malloc = true;
      continue;
    }
    if (i + 1 >= argc) usage(("missing value for " + flag).c_str());
    const std::string value = argv[++i];
    const auto number = [&] {
      char* end = nullptr;
      const long long parsed = std::strtoll(value.c_str(), &end, 10);
      if (end == value.c_str() || *end != '\0' || parsed < 0) {
        usage((flag + " needs a non-negative integer, got '" + value + "'").c_str());
      }
      return parsed;
    };
    if (flag == "--zstd-level") {
      char* end = nullptr;
      options.zstd_level = static_cast<int>(std::strtol(value.c_str(), &end, 10));
      if (end == value.c_str() || *end != '\0') {
        usage(("--zstd-level needs an integer, got '" + value + "'").c_str());
      }
    } else if (flag == "--mib") {
      options.mib = static_cast<std::size_t>(number());
    } else if (flag == "--reps") {
      options.reps = static_cast<int>(number());
    } else if (flag == "--tensors") {
      options.tensors = static_cast<std::size_t>(number());
    } else if (flag == "--threads") {
      options.threads = static_cast<int>(number());
    } else if (flag == "--dir") {
      options.dir = value;
    } else if (flag == "--steps") {
      options.steps = static_cast<std::size_t>(number());
    } else {
      usage(("unknown option " + flag).c_str());
    }
  }
  if (options.mib == 0 || options.reps == 0 || options.tensors == 0) {
    usage("--mib, --reps and --tensors must be positive");
  }
  return options;
}

// glibc serves blocks of 1 MiB and more with mmap() until a freed one raises its threshold, and
// gives the top of the heap back to the OS when more than twice that is free. Plain H5Dwrite
// allocates two such buffers per chunk in HDF5's filter pipeline, so its speed depended on what
// ran before it in the process: 0.5 GB/s in a fresh process (as in a new h5py process: every
// chunk page-faults its buffers in again), 0.8 GB/s after something had freed a large block. Fixed
// thresholds give every contender reused heap memory: the baseline at its best, and figures that
// do not depend on the order of the cases. dynaprobe reuses its own buffers and barely changes.
void tune_malloc() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // the largest glibc accepts
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// Deterministic N(0, 1) samples (Box-Muller on splitmix64), generated in parallel blocks so that
// 256 MiB takes a fraction of a second; store(i, value) receives sample i.
template <typename Store>
void generate_gaussian(std::size_t count, std::uint64_t seed, Store store) {
  constexpr std::size_t kBlock = 1 << 16;  // even, so samples come in whole pairs
  tbb::parallel_for(std::size_t{0}, (count + kBlock - 1) / kBlock, [&](std::size_t block) {
    std::uint64_t state = seed * 0x9e3779b97f4a7c15ull + block;
    const auto uniform = [&state] {  // in (0, 1]
      const std::uint64_t z = mix(state);
      state += 0x9e3779b97f4a7c15ull;
      return static_cast<float>((z >> 40) + 1) * 0x1p-24f;
    };
    const std::size_t end = std::min(count, (block + 1) * kBlock);
    for (std::size_t i = block * kBlock; i < end; i += 2) {
      const float radius = std::sqrt(-2.0f * std::log(uniform()));
      const float angle = 6.2831853f * uniform();
      store(i, radius * std::cos(angle));
      if (i + 1 < end) store(i + 1, radius * std::sin(angle));
    }
  });
}

std::vector<std::byte> gaussian_float32(std::size_t bytes, bool round_to_bf16) {
  std::vector<std::byte> data(bytes);
  auto* out = reinterpret_cast<std::uint32_t*>(data.data());
  generate_gaussian(bytes / 4, round_to_bf16 ? 2 : 1, [&](std::size_t i, float value) {
    std::uint32_t bits;
    std::memcpy(&bits, &value, 4);
    out[i] = round_to_bf16 ? bf16_rounded_bits(value) : bits;
  });
  return data;
}

std::vector<std::byte> gaussian_bfloat16(std::size_t bytes) {
  std::vector<std::byte> data(bytes);
  auto* out = reinterpret_cast<std::uint16_t*>(data.data());
  generate_gaussian(bytes / 2, 3, [&](std::size_t i, float value) {
    out[i] = static_cast<std::uint16_t>(bf16_rounded_bits(value) >> 16);
  });
  return data;
}

void fsync_file(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0 || ::fsync(fd) != 0) throw dynaprobe::IoError("fsync of " + path.string() + " failed");
  ::close(fd);
}

void verify(const std::vector<std::byte>& expected, const std::vector<std::byte>& got,
            const std::string& what) {
  if (expected.size() != got.size() || std::memcmp(expected.data(), got.data(), got.size()) != 0) {
    throw dynaprobe::FormatError(what + ": the bytes read back differ from the bytes written");
  }
}

double gb_per_s(std::size_t bytes, double seconds) {
  return static_cast<double>(bytes) / 1e9 / seconds;
}

// ---- plain filtered HDF5, as h5py + hdf5plugin would do it --------------------------------------

fmt::h5::Handle plain_dcpl(const std::vector<hsize_t>& chunk) {
  const std::string where = "plain HDF5 dcpl";
  fmt::h5::Handle dcpl = fmt::h5::plist_handle(H5Pcreate(H5P_DATASET_CREATE), "creating", where);
  fmt::h5::check(H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data()),
                 "setting chunk", where);
  fmt::h5::check(H5Pset_shuffle(dcpl.get()), "setting shuffle", where);
  fmt::h5::check(H5Pset_filter(dcpl.get(), kZstdFilterId, H5Z_FLAG_OPTIONAL, 1, &kPlainZstdLevel),
                 "setting zstd", where);
  return dcpl;
}

// Creates `name` in `location` and writes it with one H5Dwrite through HDF5's filter pipeline.
void plain_write_dataset(hid_t location, const std::string& name, hid_t type,
                         const std::vector<hsize_t>& dims, hid_t dcpl, const void* data) {
  const std::string where = "plain HDF5 " + name;
  fmt::h5::Handle space = fmt::h5::space_handle(
      H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), "dataspace", where);
  fmt::h5::Handle dataset = fmt::h5::dataset_handle(
      H5Dcreate2(location, name.c_str(), type, space.get(), H5P_DEFAULT, dcpl, H5P_DEFAULT),
      "creating", where);
  fmt::h5::check(H5Dwrite(dataset.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "writing",
                 where);
  dataset.close(where);
}

void plain_read_dataset(hid_t location, const std::string& name, hid_t type, void* out) {
  const std::string where = "plain HDF5 " + name;
  fmt::h5::Handle dataset =
      fmt::h5::dataset_handle(H5Dopen2(location, name.c_str(), H5P_DEFAULT), "opening", where);
  fmt::h5::check(H5Dread(dataset.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out), "reading",
                 where);
}

fmt::h5::Handle plain_create(const fs::path& path) {
  return fmt::h5::file_handle(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT),
                              "creating", path.string());
}

fmt::h5::Handle plain_open(const fs::path& path) {
  return fmt::h5::file_handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "opening",
                              path.string());
}

// The chunk dimensions dynaprobe chose for the (only) tensor of a step file, so the baseline
// uses exactly the same chunks.
std::vector<hsize_t> chunk_dims_of(const fs::path& step_file, const std::string& dataset_name) {
  fmt::h5::Lock lock(fmt::h5::hdf5_mutex());
  fmt::h5::Handle file = plain_open(step_file);
  fmt::h5::Handle dataset = fmt::h5::dataset_handle(
      H5Dopen2(file.get(), dataset_name.c_str(), H5P_DEFAULT), "opening", dataset_name);
  fmt::h5::Handle dcpl =
      fmt::h5::plist_handle(H5Dget_create_plist(dataset.get()), "dcpl", dataset_name);
  std::vector<hsize_t> chunk(H5S_MAX_RANK);
  const int rank = H5Pget_chunk(dcpl.get(), H5S_MAX_RANK, chunk.data());
  if (rank <= 0) throw dynaprobe::FormatError(dataset_name + " is not chunked");
  chunk.resize(static_cast<std::size_t>(rank));
  return chunk;
}

std::string dims_string(const std::vector<hsize_t>& dims) {
  std::string text = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + ")";
}

// ---- results
// -------------------------------------------------------------------------------------

// CPU time that other processes used while a repetition ran (all cores, seconds): machine-wide
// busy time from /proc/stat minus this process's own. On a shared 2-core machine one concurrent
// compiler halves the figures, so such repetitions are repeated rather than reported.
class OtherCpu {
 public:
  OtherCpu() : start_(busy_seconds() - own_seconds()) {}
  double seconds() const { return busy_seconds() - own_seconds() - start_; }

 private:
  static double busy_seconds() {
    std::ifstream stat("/proc/stat");
    std::string cpu;
    double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
    return (user + nice + system + irq + softirq + steal) /
           static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  static double own_seconds() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    const auto seconds = [](const timeval& t) {
      return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6;
    };
    return seconds(usage.ru_utime) + seconds(usage.ru_stime);
  }
  double start_;
};

// The timed parts of one repetition.
struct Times {
  double memcpy_s = 0, write_s = 0, read_s = 0, plain_write_s = 0, plain_read_s = 0;
};

struct Result {
  std::string name;
  std::size_t bytes = 0;
  std::size_t count = 1;  // tensors per step
  std::string chunk;
  Times best;              // each figure the fastest of the undisturbed repetitions
  int disturbed = 0;       // repetitions dropped because other processes were running
  double other_cpu_s = 0;  // CPU time other processes used during the dropped repetitions
  std::uintmax_t file_bytes = 0, plain_file_bytes = 0;

  double write_ratio() const { return best.plain_write_s / best.write_s; }
  double read_ratio() const { return best.plain_read_s / best.read_s; }
  double compression() const {
    return static_cast<double>(bytes) / static_cast<double>(file_bytes);
  }
  double plain_compression() const {
    return static_cast<double>(bytes) / static_cast<double>(plain_file_bytes);
  }
};

// Runs `rep` until options.reps repetitions ran undisturbed by other processes (at most 4 x
// reps in all) and keeps the fastest time of each part; if none was undisturbed, of all.
void repeat(const Options& options, Result& result, const std::function<Times(int)>& rep) {
  std::vector<Times> clean, all;
  for (int i = 0; static_cast<int>(clean.size()) < options.reps && i < 4 * options.reps; ++i) {
    const OtherCpu other;
    const auto start = Clock::now();
    const Times times = rep(i);
    // Up to 5% of one core is background noise (kernel threads, the flushes of fsync).
    const double other_s = other.seconds();
    const bool disturbed = other_s > 0.02 + 0.05 * seconds_since(start);
    (disturbed ? all : clean).push_back(times);
    if (disturbed) {
      ++result.disturbed;
      result.other_cpu_s += other_s;
    }
  }
  const std::vector<Times>& pool = clean.empty() ? all : clean;
  const auto fastest = [&](double Times::*part) {
    double best = std::numeric_limits<double>::infinity();
    for (const Times& t : pool) best = std::min(best, t.*part);
    return best;
  };
  result.best = {fastest(&Times::memcpy_s), fastest(&Times::write_s), fastest(&Times::read_s),
                 fastest(&Times::plain_write_s), fastest(&Times::plain_read_s)};
}

fmt::Provenance bench_provenance() { return {{"producer", "bench/format_bench"}}; }

fmt::RecordKey key_of(std::size_t i) {
  return {0,
          "layers." + std::to_string(i / kTensorsPerModule),
          0,
          fmt::Kind::kFwdOutput,
          static_cast<std::uint32_t>(i % kTensorsPerModule),
          fmt::Side::kEager};
}

// --steps: `data` (the (b) case) written as options.steps consecutive steps into one dump folder;
// prints the median and the slowest step.
void run_steps(const Options& options, const fs::path& root, const std::vector<std::byte>& data) {
  const std::vector<std::int64_t> shape = {static_cast<std::int64_t>(data.size() / 4 / kColumns),
                                           kColumns};
  fmt::WriterOptions writer_options;
  writer_options.threads = options.threads;
  writer_options.zstd_level = options.zstd_level;
  const fs::path dump = root / "steps";
  std::vector<double> seconds;
  for (std::size_t step = 0; step < options.steps; ++step) {
    fmt::RecordKey key = key_of(0);
    key.step = static_cast<std::int64_t>(step);
    const fmt::Record record{key, "", {fmt::DType::kFloat32, shape, data.data()}};
    seconds.push_back(timed([&] {
      fmt::StepWriter writer(dump, key.step, bench_provenance(), writer_options);
      writer.write(record);
      writer.commit();
    }));
  }
  fs::remove_all(dump);
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  std::printf("  %zu steps into one folder: median %.1f ms per step (%.2f GB/s), slowest %.1f ms\n",
              options.steps, median * 1e3, gb_per_s(data.size(), median), seconds.back() * 1e3);
  std::fflush(stdout);
}

// One large tensor: (a), (b), (c).
Result run_large(const Options& options, const fs::path& root, const std::string& name,
                 fmt::DType dtype, const std::vector<std::byte>& data) {
  const std::size_t element_size = fmt::dtype_size(dtype);
  const std::vector<std::int64_t> shape = {
      static_cast<std::int64_t>(data.size() / element_size / kColumns), kColumns};
  const std::vector<hsize_t> dims(shape.begin(), shape.end());
  const fmt::Record record{key_of(0), "", {dtype, shape, data.data()}};
  const std::string dataset_name = fmt::dataset_path(record.key);
  // Same bytes on disk as dynaprobe's types; no conversion happens on either side.
  const hid_t plain_type = dtype == fmt::DType::kFloat32 ? H5T_IEEE_F32LE : H5T_STD_U16LE;
  fmt::WriterOptions writer_options;
  writer_options.threads = options.threads;
  writer_options.zstd_level = options.zstd_level;

  Result result;
  result.name = name;
  result.bytes = data.size();
  std::vector<std::byte> out(data.size());
  std::vector<hsize_t> chunk;
  repeat(options, result, [&](int rep) {
    Times times;
    times.memcpy_s = timed([&] { std::memcpy(out.data(), data.data(), data.size()); });

    const fs::path dump = root / ("ours_" + std::to_string(rep));
    fs::path step_file;
    times.write_s = timed([&] {
      fmt::StepWriter writer(dump, 0, bench_provenance(), writer_options);
      writer.write(record);
      step_file = writer.commit();
    });
    result.file_bytes = fs::file_size(step_file);
    load_into_page_cache(step_file);
    std::memset(out.data(), 0, out.size());
    times.read_s = timed([&] {
      fmt::StepReader reader(step_file);
      const fmt::TensorStream stream = reader.open(reader.records().at(0));
      fmt::stream_chunks(
          stream,
          [&](fmt::ChunkExtent extent, const std::byte* chunk_data) {
            std::memcpy(out.data() + extent.first_element * element_size, chunk_data,
                        extent.element_count * element_size);
          },
          fmt::ChunkOrder::kAnyOrder);
    });
    verify(data, out, name + " (dynaprobe reader)");
    if (chunk.empty()) chunk = chunk_dims_of(step_file, dataset_name);
    fs::remove_all(dump);

    const fs::path plain_file = root / ("plain_" + std::to_string(rep) + ".h5");
    fmt::h5::Lock lock(fmt::h5::hdf5_mutex());
    fmt::h5::Handle dcpl = plain_dcpl(chunk);
    times.plain_write_s = timed([&] {
      fmt::h5::Handle file = plain_create(plain_file);
      plain_write_dataset(file.get(), "data", plain_type, dims, dcpl.get(), data.data());
      file.close(plain_file.string());
      fsync_file(plain_file);  // commit() fsyncs too: compare the same durability
    });
    result.plain_file_bytes = fs::file_size(plain_file);
    load_into_page_cache(plain_file);
    std::memset(out.data(), 0, out.size());
    times.plain_read_s = timed([&] {
      fmt::h5::Handle file = plain_open(plain_file);
      plain_read_dataset(file.get(), "data", plain_type, out.data());
    });
    verify(data, out, name + " (plain H5Dread)");
    fs::remove(plain_file);
    return times;
  });
  result.chunk = dims_string(chunk);
  return result;
}

// Many small tensors in one step: (d). Measures per-dataset overhead, not bandwidth.
Result run_small(const Options& options, const fs::path& root) {
  const std::size_t elements = options.tensor_bytes / 4;
  const std::vector<std::byte> data =
      gaussian_float32(options.tensors * options.tensor_bytes, true);
  std::vector<fmt::Record> records(options.tensors);
  for (std::size_t i = 0; i < records.size(); ++i) {
    records[i] = {key_of(i),
                  "",
                  {fmt::DType::kFloat32,
                   {static_cast<std::int64_t>(elements)},
                   data.data() + i * options.tensor_bytes}};
  }
  fmt::WriterOptions writer_options;
  writer_options.threads = options.threads;
  writer_options.zstd_level = options.zstd_level;

  Result result;
  result.name = "(d) " + std::to_string(options.tensors) + " x " +
                std::to_string(options.tensor_bytes / 1024) + " KiB float32, bf16-rounded";
  result.bytes = data.size();
  result.count = options.tensors;
  result.chunk = "(" + std::to_string(elements) + ",)";
  std::vector<std::byte> out(data.size());
  const std::vector<hsize_t> dims = {elements};
  const auto plain_name = [](std::size_t i) {
    return "fwd_output.eager.0." + std::to_string(i % kTensorsPerModule);
  };
  repeat(options, result, [&](int rep) {
    Times times;
    times.memcpy_s = timed([&] {
      for (std::size_t i = 0; i < options.tensors; ++i) {
        const std::size_t at = i * options.tensor_bytes;
        std::memcpy(out.data() + at, data.data() + at, options.tensor_bytes);
      }
    });

    const fs::path dump = root / ("small_" + std::to_string(rep));
    fs::path step_file;
    times.write_s = timed([&] {
      fmt::StepWriter writer(dump, 0, bench_provenance(), writer_options);
      writer.write(records);
      step_file = writer.commit();
    });
    result.file_bytes = fs::file_size(step_file);
    load_into_page_cache(step_file);
    std::memset(out.data(), 0, out.size());
    times.read_s = timed([&] {
      fmt::StepReader reader(step_file);
      for (std::size_t i = 0; i < options.tensors; ++i) {
        const fmt::RecordInfo* info = reader.find(key_of(i));
        if (info == nullptr) {
          throw dynaprobe::FormatError("record " + std::to_string(i) + " missing");
        }
        std::byte* target = out.data() + i * options.tensor_bytes;
        fmt::stream_chunks(
            reader.open(*info), [&](fmt::ChunkExtent extent, const std::byte* chunk_data) {
              std::memcpy(target + extent.first_element * 4, chunk_data, extent.element_count * 4);
            });
      }
    });
    verify(data, out, result.name + " (dynaprobe reader)");
    fs::remove_all(dump);

    // The baseline: the same groups and dataset names, each written with its own H5Dwrite.
    const fs::path plain_file = root / ("plain_small_" + std::to_string(rep) + ".h5");
    fmt::h5::Lock lock(fmt::h5::hdf5_mutex());
    fmt::h5::Handle dcpl = plain_dcpl(dims);
    times.plain_write_s = timed([&] {
      fmt::h5::Handle file = plain_create(plain_file);
      fmt::h5::Handle group;
      for (std::size_t i = 0; i < options.tensors; ++i) {
        if (i % kTensorsPerModule == 0) {
          group = fmt::h5::group_handle(H5Gcreate2(file.get(), key_of(i).module.c_str(),
                                                   H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                                        "creating group", plain_file.string());
        }
        plain_write_dataset(group.get(), plain_name(i), H5T_IEEE_F32LE, dims, dcpl.get(),
                            data.data() + i * options.tensor_bytes);
      }
      group.reset();
      file.close(plain_file.string());
      fsync_file(plain_file);
    });
    result.plain_file_bytes = fs::file_size(plain_file);
    load_into_page_cache(plain_file);
    std::memset(out.data(), 0, out.size());
    times.plain_read_s = timed([&] {
      fmt::h5::Handle file = plain_open(plain_file);
      for (std::size_t i = 0; i < options.tensors; ++i) {
        plain_read_dataset(file.get(), key_of(i).module + "/" + plain_name(i), H5T_IEEE_F32LE,
                           out.data() + i * options.tensor_bytes);
      }
    });
    verify(data, out, result.name + " (plain H5Dread)");
    fs::remove(plain_file);
    return times;
  });
  return result;
}

// ---- report
// --------------------------------------------------------------------------------------

struct Target {
  std::string what;
  double value;
  double limit;
  bool at_most;  // value must be <= limit (else >=)
  bool met() const { return at_most ? value <= limit : value >= limit; }
};

void print_result(const Result& r) {
  std::printf("\n%s: %.1f MiB, chunk %s", r.name.c_str(), static_cast<double>(r.bytes) / (1 << 20),
              r.chunk.c_str());
  if (r.disturbed > 0) {
    std::printf(" (%d repetitions dropped: other processes used %.1f s of CPU during them)",
                r.disturbed, r.other_cpu_s);
  }
  const Times& t = r.best;
  std::printf("\n  memcpy                          %7.2f GB/s\n", gb_per_s(r.bytes, t.memcpy_s));
  std::printf("  write: dynaprobe StepWriter     %7.2f GB/s   plain H5Dwrite %6.2f GB/s   x%.2f\n",
              gb_per_s(r.bytes, t.write_s), gb_per_s(r.bytes, t.plain_write_s), r.write_ratio());
  std::printf("  read:  dynaprobe StepReader     %7.2f GB/s   plain H5Dread  %6.2f GB/s   x%.2f\n",
              gb_per_s(r.bytes, t.read_s), gb_per_s(r.bytes, t.plain_read_s), r.read_ratio());
  std::printf("  compression ratio (file size)   %7.2f        plain          %6.2f\n",
              r.compression(), r.plain_compression());
  if (r.count > 1) {
    const double n = static_cast<double>(r.count);
    std::printf("  per tensor: write %.1f us (plain %.1f us), read %.1f us (plain %.1f us)\n",
                t.write_s / n * 1e6, t.plain_write_s / n * 1e6, t.read_s / n * 1e6,
                t.plain_read_s / n * 1e6);
  }
}

// The table of docs/performance.md: GB/s of uncompressed data, or us per tensor for the case of
// many small tensors.
void print_markdown(const std::vector<Result>& results) {
  std::printf(
      "\n| case | memcpy | dynaprobe write | plain H5Dwrite | write x | dynaprobe read "
      "| plain H5Dread | read x | compression (plain) |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Result& r : results) {
    const auto figure = [&](double seconds) {
      char text[32];
      if (r.count > 1) {
        std::snprintf(text, sizeof(text), "%.1f us/tensor",
                      seconds / static_cast<double>(r.count) * 1e6);
      } else {
        std::snprintf(text, sizeof(text), "%.2f GB/s", gb_per_s(r.bytes, seconds));
      }
      return std::string(text);
    };
    const Times& t = r.best;
    std::printf("| %s | %s | %s | %s | %.1f | %s | %s | %.1f | %.2f (%.2f) |\n", r.name.c_str(),
                figure(t.memcpy_s).c_str(), figure(t.write_s).c_str(),
                figure(t.plain_write_s).c_str(), r.write_ratio(), figure(t.read_s).c_str(),
                figure(t.plain_read_s).c_str(), r.read_ratio(), r.compression(),
                r.plain_compression());
  }
}

// Removes the temporary folder however the benchmark ends.
struct TempDir {
  fs::path path;
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse_options(argc, argv);
  if (!options.default_malloc) tune_malloc();
  try {
    fmt::h5::init();  // silences HDF5's error printing and registers the zstd filter (32015)
    const fs::path base = options.dir.empty() ? fs::temp_directory_path() : options.dir;
    TempDir temp{base / ("format_bench." + std::to_string(::getpid()))};
    fs::create_directories(temp.path);
    const std::size_t bytes = options.mib << 20;
    std::printf(
        "format_bench: %zu MiB per large case, %zu x %zu B small tensors, best of %d "
        "undisturbed repetitions, %d threads, zstd level %d (plain HDF5: %u), %s malloc, files in "
        "%s\n",
        options.mib, options.tensors, options.tensor_bytes, options.reps,
        options.threads > 0 ? options.threads : tbb::info::default_concurrency(),
        options.zstd_level, kPlainZstdLevel, options.default_malloc ? "default" : "tuned",
        temp.path.c_str());

    std::vector<Result> results;
    const auto large = [&](const std::string& name, fmt::DType dtype, std::vector<std::byte> data) {
      results.push_back(run_large(options, temp.path, name, dtype, data));
      print_result(results.back());
      std::fflush(stdout);
    };
    large("(a) float32, Gaussian", fmt::DType::kFloat32, gaussian_float32(bytes, false));
    std::vector<std::byte> b_data = gaussian_float32(bytes, true);
    large("(b) float32, bf16-rounded", fmt::DType::kFloat32, b_data);
    if (options.steps > 0) run_steps(options, temp.path, b_data);
    b_data = {};
    large("(c) bfloat16", fmt::DType::kBFloat16, gaussian_bfloat16(bytes));
    results.push_back(run_small(options, temp.path));
    print_result(results.back());
    print_markdown(results);

    const Result& b = results[1];
    const Result& d = results[3];
    const double n = static_cast<double>(d.count);
    std::vector<Target> targets = {
        {"(b) writer / plain H5Dwrite", b.write_ratio(), 2.0, false},
        {"(a) reader / plain H5Dread", results[0].read_ratio(), 3.0, false},
        {"(b) reader / plain H5Dread", b.read_ratio(), 3.0, false},
        {"(c) reader / plain H5Dread", results[2].read_ratio(), 3.0, false},
        {"(b) compression ratio", b.compression(), 2.5, false},
        {"(d) us per tensor written", d.best.write_s / n * 1e6, 40.0, true},
        {"(d) us per tensor read", d.best.read_s / n * 1e6, 40.0, true},
    };
    std::printf("\ntargets%s:\n",
                options.mib == 256 && options.tensors == 10000 && options.reps >= 3
                    ? ""
                    : " (set for the default --mib, --tensors and --reps)");
    bool all = true;
    for (const Target& t : targets) {
      std::printf("  %-30s %8.2f  %s %5.1f  %s\n", t.what.c_str(), t.value,
                  t.at_most ? "<=" : ">=", t.limit, t.met() ? "met" : "MISSED");
      all = all && t.met();
    }
    std::printf("%s\n", all ? "all targets met" : "some targets missed");
    return 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "format_bench: %s\n", error.what());
    return 3;
  }
}
