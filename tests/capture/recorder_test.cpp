// The capture library against a real libtorch: what record() snapshots is what an independent
// reader (formats::StepReader) gets back, byte for byte, whatever the tensor's dtype and strides;
// back-pressure never drops data; background errors surface and never take other steps with them.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "dynaprobe/capture/recorder.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/imag.h>
#include <ATen/ops/quantize_per_tensor.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scalar_tensor.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dynaprobe/analyze/engine.h"
#include "dynaprobe/analyze/report.h"
#include "dynaprobe/formats/dump_lock.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/reader.h"
#include "formats/error_of.h"
#include "formats/test_util.h"

namespace dynaprobe::capture {
namespace {

namespace fs = std::filesystem;
using formats::DType;
using formats::Kind;
using formats::RecordKey;
using formats::Side;
using formats::testing::TempDir;

RecordKey key(std::string module, std::uint32_t index = 0, Kind kind = Kind::kFwdOutput,
              Side side = Side::kEager) {
  return RecordKey{0, std::move(module), 0, kind, index, side};
}

// The bytes a reader must see for `tensor`: its values in C order (complex as complex: real and
// imaginary parts interleaved, format 2.0).
std::vector<std::byte> contiguous_bytes(const at::Tensor& tensor) {
  const at::Tensor t = tensor.resolve_conj().resolve_neg().contiguous();
  const auto* data = static_cast<const std::byte*>(t.const_data_ptr());
  return std::vector<std::byte>(data, data + t.numel() * t.element_size());
}

std::vector<std::int64_t> shape_of(const at::Tensor& tensor) {
  return std::vector<std::int64_t>(tensor.sizes().begin(), tensor.sizes().end());
}

struct Expected {
  RecordKey key;
  at::Tensor tensor;
  DType dtype;
  std::string label;
};

void expect_records(const fs::path& file, const std::vector<Expected>& expected) {
  formats::StepReader reader(file);
  ASSERT_EQ(reader.records().size(), expected.size());
  for (const Expected& e : expected) {
    SCOPED_TRACE(formats::to_string(e.key));
    const formats::RecordInfo* info = reader.find(e.key);
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->dtype, e.dtype);
    EXPECT_EQ(info->shape, shape_of(e.tensor));
    EXPECT_EQ(info->label, e.label);
    EXPECT_EQ(reader.read(*info), contiguous_bytes(e.tensor));
  }
}

TEST(Recorder, DtypesRoundTripAsTheirOwnBytes) {
  TempDir dir;
  at::manual_seed(1);
  const at::Tensor base = at::randn({3, 5, 7});
  const at::Tensor complex = at::randn({4, 6}, at::kComplexFloat);
  std::vector<Expected> expected = {
      {key("m", 0), base, DType::kFloat32, "float32"},
      {key("m", 1), base.to(at::kDouble), DType::kFloat64, "float64"},
      {key("m", 2), base.to(at::kBFloat16), DType::kBFloat16, "bfloat16"},
      {key("m", 3), base.to(at::kHalf), DType::kFloat16, "float16"},
      {key("m", 4), base.mul(100).to(at::kLong), DType::kInt64, "int64"},
      {key("m", 5), base.gt(0), DType::kBool, "bool"},
      {key("m", 6), base.to(at::kFloat8_e4m3fn), DType::kFloat8E4M3FN, "e4m3fn"},
      {key("m", 7), base.to(at::kFloat8_e5m2), DType::kFloat8E5M2, "e5m2"},
      {key("m", 8), base.mul(50).to(at::kChar), DType::kInt8, "int8"},
      {key("m", 9), base.abs().mul(50).to(at::kByte), DType::kUInt8, "uint8"},
      {key("m", 10), complex, DType::kComplex64, "complex64"},
      {key("m", 11), complex.to(at::kComplexDouble), DType::kComplex128, "complex128"},
      {key("m", 12), at::scalar_tensor(2.5), DType::kFloat32, "0-d"},
      {key("m", 13), at::empty({0, 3}), DType::kFloat32, "empty"},
  };
  Recorder recorder(dir.path(), {{"mode", "single_pass"}});
  recorder.begin_step(0);
  for (const auto& e : expected) recorder.record(e.key, e.tensor, e.label);
  const fs::path file = recorder.end_step();
  EXPECT_EQ(file, dir.path() / "step_00000000.h5");
  expect_records(file, expected);
  EXPECT_EQ(formats::StepReader(file).provenance().at("mode"), "single_pass");
}

TEST(Recorder, ViewsAreStoredAsTheirValuesInCOrder) {
  TempDir dir;
  const at::Tensor base = at::arange(2 * 3 * 4 * 5, at::kFloat).reshape({2, 3, 4, 5});
  const at::Tensor complex = at::randn({3, 4}, at::kComplexFloat);
  std::vector<Expected> expected = {
      {key("v", 0), base.transpose(1, 3), DType::kFloat32, "transpose"},
      {key("v", 1), base.slice(3, 1, 5, 2).slice(0, 1, 2), DType::kFloat32, "step slice"},
      {key("v", 2), at::arange(4, at::kLong).expand({3, 4}), DType::kInt64, "expand"},
      {key("v", 3), base.permute({3, 0, 2, 1}).to(at::kBFloat16), DType::kBFloat16, "permute"},
      {key("v", 4), base.select(2, 1).diagonal(0, 1, 2), DType::kFloat32, "diagonal"},
      {key("v", 5), complex.conj(), DType::kComplex64, "lazy conjugate"},
      {key("v", 6), at::imag(complex.conj()), DType::kFloat32, "lazy negation"},
      {key("v", 7), complex.t(), DType::kComplex64, "complex transpose"},
  };
  ASSERT_TRUE(expected[5].tensor.is_conj());
  ASSERT_TRUE(expected[6].tensor.is_neg());
  Recorder recorder(dir.path(), {});
  recorder.begin_step(0);
  for (const auto& e : expected) recorder.record(e.key, e.tensor, e.label);
  expect_records(recorder.end_step(), expected);
}

TEST(Recorder, SnapshotIsTakenWhenRecordIsCalled) {
  TempDir dir;
  Recorder recorder(dir.path(), {});
  recorder.begin_step(0);
  at::Tensor tensor = at::arange(1 << 16, at::kFloat);
  const at::Tensor original = tensor.clone();
  recorder.record(key("m"), tensor);
  tensor.fill_(-1.0);  // the caller changes the tensor right away, as the next op would
  at::Tensor view = at::arange(64, at::kFloat).reshape({8, 8});
  const at::Tensor original_view = view.t().clone();
  recorder.record(key("m", 1), view.t());
  view.mul_(3.0);
  expect_records(recorder.end_step(), {{key("m"), original, DType::kFloat32, ""},
                                       {key("m", 1), original_view, DType::kFloat32, ""}});
}

TEST(Recorder, BackPressureBlocksButDropsNothing) {
  TempDir dir;
  RecorderOptions options;
  options.memory_budget_bytes = 8 * 1024;
  options.writer.chunk_bytes = 4096;
  Recorder recorder(dir.path(), {}, options);
  recorder.begin_step(0);
  std::vector<Expected> expected;
  for (std::uint32_t i = 0; i < 300; ++i) {
    // Mostly 1-4 KiB tensors, and every 50th one larger than the whole budget.
    const std::int64_t elements = i % 50 == 49 ? 6000 : 256 + (i % 4) * 256;
    at::Tensor tensor = at::randn({elements});
    const std::size_t bytes = static_cast<std::size_t>(elements) * sizeof(float);
    recorder.record(key("layers." + std::to_string(i % 7), i), tensor);
    EXPECT_LE(recorder.queued_bytes(), options.memory_budget_bytes + bytes) << "record " << i;
    expected.push_back({key("layers." + std::to_string(i % 7), i), tensor, DType::kFloat32, ""});
  }
  const fs::path file = recorder.end_step();
  EXPECT_EQ(recorder.queued_bytes(), 0u);
  expect_records(file, expected);
}

TEST(Recorder, BackPressureWaitsForTheWriter) {
  // With a budget of one tensor, record() cannot return before the previous tensor is written.
  TempDir dir;
  RecorderOptions options;
  options.memory_budget_bytes = 1 << 20;
  Recorder recorder(dir.path(), {}, options);
  recorder.begin_step(0);
  std::size_t max_queued = 0;
  for (std::uint32_t i = 0; i < 16; ++i) {
    recorder.record(key("m", i), at::randn({1 << 18}));  // exactly the budget
    max_queued = std::max(max_queued, recorder.queued_bytes());
  }
  EXPECT_LE(max_queued, options.memory_budget_bytes);
  EXPECT_EQ(formats::StepReader(recorder.end_step()).records().size(), 16u);
}

TEST(Recorder, StepFileErrorSurfacesAtEndStep) {
  TempDir dir;
  // Something that is not a file already sits where step 0 would be written.
  const fs::path blocker = dir.path() / "step_00000000.h5.partial";
  fs::create_directories(blocker / "occupied");
  Recorder recorder(dir.path(), {});
  recorder.begin_step(0);
  try {
    recorder.record(key("m"), at::randn({16}));  // may or may not see the error yet
  } catch (const IoError&) {
  }
  try {
    recorder.end_step();
    FAIL() << "end_step() must report that step 0 could not be written";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(blocker.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("step 0"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir.path() / "step_00000000.h5"));
  EXPECT_TRUE(fs::is_directory(blocker / "occupied"));  // not ours: left alone

  // The same recorder goes on with the next step.
  recorder.begin_step(1);
  const at::Tensor tensor = at::randn({3, 3});
  recorder.record(key("m"), tensor);
  const fs::path file = recorder.end_step();
  EXPECT_EQ(file, dir.path() / "step_00000001.h5");
  RecordKey step1 = key("m");
  step1.step = 1;
  expect_records(file, {{step1, tensor, DType::kFloat32, ""}});

  // So does a fresh recorder on another folder.
  TempDir other;
  Recorder fresh(other.path(), {});
  fresh.begin_step(0);
  fresh.record(key("m"), tensor);
  expect_records(fresh.end_step(), {{key("m"), tensor, DType::kFloat32, ""}});
}

TEST(Recorder, BackgroundErrorIsThrownByTheNextRecordOnce) {
  TempDir dir;
  fs::create_directories(dir.path() / "step_00000000.h5.partial" / "occupied");
  Recorder recorder(dir.path(), {});
  recorder.begin_step(0);
  bool thrown = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::uint32_t i = 0;
  while (!thrown && std::chrono::steady_clock::now() < deadline) {
    try {
      recorder.record(key("m", i++), at::randn({4}));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } catch (const IoError& e) {
      thrown = true;
      EXPECT_NE(std::string(e.what()).find("step_00000000.h5.partial"), std::string::npos);
    }
  }
  ASSERT_TRUE(thrown) << "record() never reported the background error";
  // The step is lost: further records are dropped without error, end_step() reports it again.
  EXPECT_NO_THROW(recorder.record(key("m", i++), at::randn({4})));
  EXPECT_NO_THROW(recorder.record_graph({"g", "forward", "text", {}}));
  EXPECT_THROW(recorder.end_step(), IoError);
  recorder.begin_step(1);
  recorder.record(key("m"), at::randn({4}));
  EXPECT_EQ(recorder.end_step(), dir.path() / "step_00000001.h5");
}

// Sets a file-size limit for this process, so that writes past it fail with EFBIG as on a full
// disk; the old limit comes back at the end of the scope.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit = saved_;
    limit.rlim_cur = bytes;
    ok_ = ::setrlimit(RLIMIT_FSIZE, &limit) == 0;
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    ::signal(SIGXFSZ, old_handler_);
  }
  bool ok() const { return ok_; }

 private:
  rlimit saved_{};
  sighandler_t old_handler_ = SIG_DFL;
  bool ok_ = false;
};

TEST(Recorder, DiskFullMidStepLosesOnlyThatStep) {
  TempDir dir;
  Recorder recorder(dir.path(), {});
  recorder.begin_step(0);
  const at::Tensor first = at::randn({1000});
  recorder.record(key("m"), first);
  const fs::path step0 = recorder.end_step();
  {
    FileSizeLimit limit(256 * 1024);
    ASSERT_TRUE(limit.ok());
    recorder.begin_step(1);
    std::string message;
    try {
      for (std::uint32_t i = 0; i < 8; ++i) {
        recorder.record(key("m", i), at::randn({1 << 18}));  // incompressible: 1 MiB each
      }
    } catch (const IoError& e) {
      message = e.what();  // the background thread failed while we were still recording
    }
    try {
      // The step is judged before it is written: a write error comes with its commit (or from
      // finish_step(), when the write failed while the step was still open).
      recorder.finish_step().wait_committed();
      FAIL() << "a write past the file-size limit must fail step 1";
    } catch (const IoError& e) {
      if (message.empty()) message = e.what();
    }
    EXPECT_NE(message.find("step_00000001.h5.partial"), std::string::npos) << message;
    EXPECT_NE(message.find("step 1"), std::string::npos) << message;
  }
  EXPECT_FALSE(fs::exists(dir.path() / "step_00000001.h5"));
  EXPECT_FALSE(fs::exists(dir.path() / "step_00000001.h5.partial"));
  expect_records(step0, {{key("m"), first, DType::kFloat32, ""}});

  recorder.begin_step(2);
  const at::Tensor later = at::randn({1 << 16});
  recorder.record(key("m"), later);
  RecordKey step2 = key("m");
  step2.step = 2;
  expect_records(recorder.end_step(), {{step2, later, DType::kFloat32, ""}});
  const auto files = formats::list_dump(dir.path());
  EXPECT_EQ(files.steps.size(), 2u);
  EXPECT_TRUE(files.unfinished.empty());
}

TEST(Recorder, GraphsAndModulesRoundTrip) {
  TempDir dir;
  Recorder recorder(dir.path(), {});
  recorder.begin_step(0);
  recorder.record_module({"layers.0", {{"role", "wrapped"}}});
  recorder.record(key("layers.0"), at::randn({2, 2}));
  recorder.record_graph({"__compiled_fn_1.Forward_Graph.1a2b",
                         "forward",
                         "def forward(self, x):\n    return (x * 2,)\n",
                         {{"modules", "layers.0"}}});
  recorder.record_module({"layers.1", {{"role", "ignored"}, {"note", "NOT_COMPILED"}}});
  recorder.record_graph({"__compiled_fn_1.Captured_Graph", "captured", "graph text", {}});
  const fs::path file = recorder.end_step();

  formats::StepReader reader(file);
  const auto graphs = reader.graphs();
  ASSERT_EQ(graphs.size(), 2u);
  bool found_forward = false;
  for (const auto& graph : graphs) {
    if (graph.name == "__compiled_fn_1.Forward_Graph.1a2b") {
      found_forward = true;
      EXPECT_EQ(graph.kind, "forward");
      EXPECT_EQ(graph.text, "def forward(self, x):\n    return (x * 2,)\n");
      EXPECT_EQ(graph.attributes.at("modules"), "layers.0");
    } else {
      EXPECT_EQ(graph.name, "__compiled_fn_1.Captured_Graph");
      EXPECT_EQ(graph.kind, "captured");
      EXPECT_EQ(graph.text, "graph text");
    }
  }
  EXPECT_TRUE(found_forward);
  const auto modules = reader.modules();
  ASSERT_EQ(modules.size(), 2u);
  EXPECT_EQ(modules[0].module, "layers.0");
  EXPECT_EQ(modules[0].attributes.at("role"), "wrapped");
  EXPECT_EQ(modules[1].module, "layers.1");
  EXPECT_EQ(modules[1].attributes.at("note"), "NOT_COMPILED");
}

TEST(Recorder, DestroyedMidStepLeavesNoStepFile) {
  TempDir dir;
  {
    Recorder recorder(dir.path(), {});
    recorder.begin_step(0);
    recorder.record(key("m"), at::randn({4}));
    recorder.end_step();
    recorder.begin_step(1);
    for (std::uint32_t i = 0; i < 32; ++i) recorder.record(key("m", i), at::randn({1 << 16}));
  }
  const auto files = formats::list_dump(dir.path());
  ASSERT_EQ(files.steps.size(), 1u);
  EXPECT_EQ(files.steps[0].filename(), "step_00000000.h5");
  EXPECT_TRUE(files.unfinished.empty());
  EXPECT_FALSE(fs::exists(dir.path() / "step_00000001.h5"));
}

TEST(Recorder, AStepEndedButNotCommittedIsCommittedWhenTheRecorderIsDestroyed) {
  TempDir dir;
  const at::Tensor x = at::randn({1 << 20});  // 4 MiB
  fs::path file;
  {
    Recorder recorder(dir.path(), {});
    recorder.begin_step(0);
    for (std::uint32_t i = 0; i < 8; ++i) recorder.record(key("m", i), x.add(i));
    file = recorder.finish_step().file;
    recorder.begin_step(1);  // begun, not ended: discarded
    recorder.record(key("m"), x);
  }
  const auto files = formats::list_dump(dir.path());
  ASSERT_EQ(files.steps.size(), 1u);
  EXPECT_EQ(files.steps[0], file);
  EXPECT_TRUE(files.unfinished.empty());
  EXPECT_EQ(formats::StepReader(file).records().size(), 8u);
}

// A step recorded in every store mode: pairs that agree and differ, an input compared with
// itself, a one-sided record, the loss, modules and a graph.
void record_mixed_step(Recorder& recorder, std::int64_t step) {
  recorder.begin_step(step);
  recorder.record_module({"same", {{"role", "wrapped"}}});
  recorder.record_module({"differs", {{"role", "wrapped"}}});
  const at::Tensor x = at::randn({512, 512});  // 1 MiB: one chunk
  const at::Tensor big = at::randn({3, 512, 512});
  recorder.record(key("same", 0, Kind::kFwdOutput, Side::kCompiled), x, "out");
  recorder.record(key("same", 0, Kind::kFwdOutput, Side::kEager), x, "out");
  recorder.record(key("same", 0, Kind::kFwdInput, Side::kCompiled), big);
  recorder.record(key("differs", 0, Kind::kParamGrad, Side::kCompiled), big.add(1e-2), "weight");
  recorder.record(key("differs", 0, Kind::kParamGrad, Side::kEager), big, "weight");
  recorder.record(key("alone", 0, Kind::kFwdOutput, Side::kEager), x);
  recorder.record(key(std::string(formats::kLossModule), 0, Kind::kLoss, Side::kCompiled),
                  at::scalar_tensor(2.5));
  recorder.record_graph({"same.graph", "captured", "graph():\n  return x\n", {}});
}

TEST(Recorder, FinishStepGivesTheStepAsItsFileHoldsItAndTheSameReport) {
  for (const StoreMode mode : {StoreMode::kFull, StoreMode::kFailing, StoreMode::kStats}) {
    TempDir dir;
    RecorderOptions options;
    options.store = mode;
    Recorder recorder(dir.path(), {{"mode", "single_pass"}, {"atol", "0.0001"}, {"rtol", "0.001"}},
                      options);
    record_mixed_step(recorder, 3);
    formats::PendingStep pending = recorder.finish_step();
    EXPECT_EQ(pending.file, dir.path() / formats::step_file_name(3));
    // Every pair was judged in memory and the loss is kept: the report needs no file.
    formats::PendingStep without_file = pending;
    without_file.wait_committed = [] { throw std::logic_error("the report waited for the file"); };
    const analyze::Comparison in_memory = analyze::compare_pending(without_file, {});
    pending.wait_committed();
    const formats::StepReader file(pending.file);
    ASSERT_EQ(pending.records.size(), file.records().size());
    for (std::size_t i = 0; i < pending.records.size(); ++i) {
      const formats::RecordInfo& a = pending.records[i];
      const formats::RecordInfo& b = file.records()[i];
      EXPECT_EQ(a.key, b.key);
      EXPECT_EQ(a.label, b.label);
      EXPECT_EQ(a.dtype, b.dtype);
      EXPECT_EQ(a.shape, b.shape);
      EXPECT_EQ(a.stored, b.stored) << formats::to_string(a.key);
    }
    ASSERT_EQ(pending.metrics.size(), file.stored_metrics().size());
    for (std::size_t i = 0; i < pending.metrics.size(); ++i) {
      EXPECT_EQ(pending.metrics[i].key, file.stored_metrics()[i].key);
      EXPECT_EQ(std::memcmp(&pending.metrics[i].metrics.max_abs,
                            &file.stored_metrics()[i].metrics.max_abs, sizeof(double)),
                0);
    }
    ASSERT_EQ(pending.modules.size(), file.modules().size());
    for (std::size_t i = 0; i < pending.modules.size(); ++i) {
      EXPECT_EQ(pending.modules[i].module, file.modules()[i].module);
      EXPECT_EQ(pending.modules[i].attributes, file.modules()[i].attributes);
    }
    EXPECT_EQ(pending.small_tensors.size(), 1u);  // the loss, read without the file
    analyze::CompareOptions step;
    step.step = 3;
    const analyze::Comparison from_file = analyze::compare(dir.path(), dir.path(), step);
    ASSERT_EQ(in_memory.steps.size(), 1u);
    ASSERT_EQ(from_file.steps.size(), 1u);
    EXPECT_EQ(analyze::render_text(in_memory.steps[0]), analyze::render_text(from_file.steps[0]));
    EXPECT_EQ(in_memory.warnings, from_file.warnings);
  }
}

// A report of a step still being committed reads the pairs not judged in memory (here a
// reference record) from the file once committed. It must wait for that commit before taking the
// HDF5 lock for its reads: the background writer needs that lock to commit (modelled here by a
// commit that takes the lock on another thread; a deadlock ends the test binary).
TEST(Recorder, AReportReadingAPendingStepWaitsForTheCommitOutsideTheReadLock) {
  TempDir dir;
  Recorder recorder(dir.path(), {{"mode", "single_pass"}});
  recorder.begin_step(0);
  const at::Tensor x = at::randn({64});
  recorder.record(key("m", 0, Kind::kFwdOutput, Side::kReference), x.to(at::kDouble));
  recorder.record(key("m", 0, Kind::kFwdOutput, Side::kCompiled), x);
  recorder.record(key("m", 0, Kind::kFwdOutput, Side::kEager), x);
  formats::PendingStep pending = recorder.finish_step();
  pending.wait_committed = [commit = pending.wait_committed] {
    std::thread([] { formats::ReadBatch the_writer_takes_the_lock; }).join();
    commit();
  };
  auto report =
      std::async(std::launch::async, [pending] { return analyze::compare_pending(pending, {}); });
  if (report.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "compare_pending of a pending step deadlocked with its writer\n");
    std::_Exit(1);  // the threads cannot be joined: end the test binary with a failure
  }
  const analyze::Comparison comparison = report.get();
  const analyze::Row& row = comparison.steps.at(0).rows.at(0);
  EXPECT_EQ(row.module, "m");
  EXPECT_EQ(row.reference_verdict, "noise");
  EXPECT_EQ(row.reference_dtype, "fp64");
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// One writer per folder: a second recorder of a folder whose lock is held writes nothing there.
// Strict, it refuses at once, naming the folder and the holder; with strict_io off it judges its
// steps in memory, and each step's commit says why it was not stored.
TEST(Recorder, ASecondWriterOfAFolderWritesNothingThere) {
  TempDir dir;
  Recorder first(dir.path(), {{"mode", "single_pass"}, {"host", "trainer-7"}});
  const std::string holder = read_file(dir.path() / formats::DumpLock::kFileName);
  EXPECT_NE(holder.find("host trainer-7, pid " + std::to_string(::getpid())), std::string::npos)
      << holder;
  const std::string busy = testing_helpers::error_of<formats::DumpBusyError>([&] {
    Recorder second(dir.path(), {{"mode", "single_pass"}});
  });
  EXPECT_NE(busy.find(dir.path().string() + " is being written by another process (host "
                                            "trainer-7, pid "),
            std::string::npos)
      << busy;

  RecorderOptions lenient;
  lenient.strict_io = false;
  Recorder second(dir.path(), {{"mode", "single_pass"}}, lenient);
  second.begin_step(0);
  const at::Tensor x = at::randn({8});
  second.record(key("m", 0, Kind::kFwdOutput, Side::kCompiled), x);
  second.record(key("m", 0, Kind::kFwdOutput, Side::kEager), x.add(1));
  formats::PendingStep pending = second.finish_step();
  ASSERT_EQ(pending.metrics.size(), 1u);  // judged in memory
  EXPECT_FALSE(pending.metrics[0].metrics.allclose);
  EXPECT_NE(testing_helpers::error_of<formats::DumpBusyError>([&] {
              pending.wait_committed();
            }).find("is being written by another process"),
            std::string::npos);
  const analyze::Comparison report = analyze::compare_pending(pending, {});
  EXPECT_EQ(report.steps.at(0).rows.at(0).status, analyze::Status::kFail);
  EXPECT_FALSE(fs::exists(dir.path() / formats::step_file_name(0)));

  // The first writes on, untouched.
  first.begin_step(0);
  first.record(key("m", 0, Kind::kFwdOutput, Side::kCompiled), x);
  EXPECT_EQ(first.end_step(), dir.path() / formats::step_file_name(0));
}

// Without strict_io, a step whose file cannot be written is still judged; the next step is
// written again once it can be (here: the folder removed, then made again by the user).
TEST(Recorder, WithoutStrictIoALostFileLeavesTheStepJudgedAndTheNextIsWrittenAgain) {
  TempDir dir;
  RecorderOptions lenient;
  lenient.strict_io = false;
  Recorder recorder(dir.path() / "dump", {{"mode", "single_pass"}}, lenient);
  fs::remove_all(dir.path() / "dump");
  recorder.begin_step(0);
  const at::Tensor x = at::randn({8});
  recorder.record(key("m", 0, Kind::kFwdOutput, Side::kCompiled), x);
  recorder.record(key("m", 0, Kind::kFwdOutput, Side::kEager), x);
  formats::PendingStep lost = recorder.finish_step();
  ASSERT_EQ(lost.metrics.size(), 1u);
  EXPECT_TRUE(lost.metrics[0].metrics.allclose);
  EXPECT_NE(testing_helpers::error_of<IoError>([&] {
              lost.wait_committed();
            }).find("does not exist any more"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(dir.path() / "dump"));  // not made again behind the user's back
  fs::create_directories(dir.path() / "dump");
  recorder.begin_step(1);
  recorder.record(key("m", 0, Kind::kFwdOutput, Side::kCompiled), x);
  EXPECT_EQ(recorder.end_step(), dir.path() / "dump" / formats::step_file_name(1));
}

TEST(Recorder, ManyStepsGiveOneFileEach) {
  TempDir dir;
  Recorder recorder(dir.path(), {{"rank", "0"}});
  for (std::int64_t step = 0; step < 3; ++step) {
    recorder.begin_step(step);
    recorder.record(key("m"), at::full({2}, static_cast<double>(step)));
    EXPECT_EQ(recorder.end_step(), dir.path() / formats::step_file_name(step));
  }
  EXPECT_EQ(formats::list_dump(dir.path()).steps.size(), 3u);
}

TEST(Recorder, RejectsMisuseWithUsageErrors) {
  TempDir dir;
  Recorder recorder(dir.path(), {});
  EXPECT_THROW(recorder.record(key("m"), at::randn({2})), UsageError);  // no step begun
  EXPECT_THROW(recorder.end_step(), UsageError);
  recorder.begin_step(0);
  EXPECT_THROW(recorder.begin_step(1), UsageError);  // step 0 still open
  recorder.record(key("m"), at::randn({2}));
  EXPECT_THROW(recorder.record(key("m"), at::randn({2})), UsageError);  // same key twice
  EXPECT_THROW(recorder.record(key("a/b"), at::randn({2})), UsageError);
  EXPECT_THROW(recorder.record(key("m", 1), at::Tensor()), UsageError);
  EXPECT_THROW(recorder.record(key("m", 2), at::empty({2}, at::TensorOptions().device(at::kMeta))),
               UsageError);
  recorder.record_graph({"g", "forward", "", {}});
  EXPECT_THROW(recorder.record_graph({"g", "forward", "", {}}), UsageError);
  recorder.record_module({"m", {}});
  EXPECT_THROW(recorder.record_module({"m", {}}), UsageError);
  // Misuse did not break the step.
  EXPECT_EQ(formats::StepReader(recorder.end_step()).records().size(), 1u);
}

TEST(Recorder, UnsupportedDtypeIsNamed) {
  TempDir dir;
  try {
    dtype_of(at::quantize_per_tensor(at::full({2}, 1.0), 0.1, 0, at::kQInt8));
    FAIL() << "a quantized tensor has no dump dtype";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("QInt8"), std::string::npos) << e.what();
  }
  EXPECT_EQ(dtype_of(at::empty({1}, at::kComplexHalf)), DType::kComplex32);
  EXPECT_EQ(dtype_of(at::empty({1}, at::kFloat8_e8m0fnu)), DType::kFloat8E8M0FNU);
  EXPECT_EQ(dtype_of(at::empty({1}, at::kUInt16)), DType::kUInt16);
  Recorder recorder(dir.path(), {});
  recorder.begin_step(0);
  try {
    recorder.record(key("m"), at::empty({2}, at::kFloat4_e2m1fn_x2));
    FAIL() << "packed float4 has no dump dtype";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("Float4_e2m1fn_x2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(formats::StepReader(recorder.end_step()).records().size(), 0u);
}

TEST(Recorder, ReservedProvenanceKeyIsRejectedUpFront) {
  TempDir dir;
  EXPECT_THROW(Recorder(dir.path(), {{"step", "1"}}), UsageError);
}

TEST(Recorder, TypedJudgingIsWrittenIntoTheProvenanceAndJudgesThePairs) {
  TempDir dir;
  RecorderOptions options;
  options.judging.emplace();
  options.judging->tolerances = {2e-5, 1e-3};
  options.judging->rules = {{"wide", {1.0, 0.0}}};
  Recorder recorder(dir.path(), {{"mode", "single_pass"}}, options);
  recorder.begin_step(0);
  const at::Tensor x = at::full({64}, 0.0);
  recorder.record(key("wide", 0, Kind::kFwdOutput, Side::kCompiled), x.add(0.5));
  recorder.record(key("wide", 0, Kind::kFwdOutput, Side::kEager), x);
  recorder.record(key("narrow", 0, Kind::kFwdOutput, Side::kCompiled), x.add(1e-4));
  recorder.record(key("narrow", 0, Kind::kFwdOutput, Side::kEager), x);
  EXPECT_EQ(recorder.failing_calls(), (std::vector<CallKey>{{"narrow", 0}}));
  formats::StepReader reader(recorder.end_step());
  const formats::Provenance& provenance = reader.provenance();
  EXPECT_EQ(provenance.at("atol"), "2e-05");
  EXPECT_EQ(provenance.at("rtol"), "0.001");
  EXPECT_EQ(provenance.at("tolerance_rules"), "1.0 0.0 wide\n");
  EXPECT_EQ(provenance.at("dtype_aware_tolerances"), "true");
}

TEST(Recorder, TypedJudgingRefusesAProvenanceThatNamesItsTolerancesToo) {
  TempDir dir;
  RecorderOptions options;
  options.judging.emplace();
  EXPECT_THROW(Recorder(dir.path(), {{"atol", "0.1"}}, options), UsageError);
  options.judging->tolerances.rtol = NAN;
  EXPECT_THROW(Recorder(dir.path(), {}, options), UsageError);
}

// Judging in memory: a pair of each kind, one equal and one that differs, under each StoreMode.
struct JudgedStep {
  fs::path file;
  std::vector<formats::RecordInfo> records;
  std::vector<formats::StoredMetrics> metrics;
  bool stored(const std::string& module, Side side) const {
    for (const auto& r : records) {
      if (r.key.module == module && r.key.side == side) return r.stored;
    }
    ADD_FAILURE() << "no record of " << module;
    return false;
  }
};

JudgedStep judged_step(const fs::path& dir, StoreMode mode) {
  RecorderOptions options;
  options.store = mode;
  Recorder recorder(dir, {{"mode", "single_pass"}, {"atol", "0.0001"}, {"rtol", "0.001"}}, options);
  recorder.begin_step(0);
  const at::Tensor x = at::randn({256, 256});  // 256 KiB
  recorder.record(key("same", 0, Kind::kFwdOutput, Side::kCompiled), x);
  recorder.record(key("same", 0, Kind::kFwdOutput, Side::kEager), x);
  recorder.record(key("differs", 0, Kind::kFwdOutput, Side::kCompiled), x.add(1));
  recorder.record(key("differs", 0, Kind::kFwdOutput, Side::kEager), x);
  // Single-pass records a module's input once, for both sides: compared with itself.
  recorder.record(key("same", 0, Kind::kFwdInput, Side::kCompiled), x);
  // A record without a twin (a one-sided row).
  recorder.record(key("alone", 0, Kind::kFwdOutput, Side::kEager), x);
  JudgedStep step;
  step.file = recorder.end_step();
  formats::StepReader reader(step.file);
  step.records = reader.records();
  step.metrics = reader.stored_metrics();
  return step;
}

TEST(Recorder, EveryPairIsJudgedInMemoryAndItsMetricsStored) {
  for (const StoreMode mode : {StoreMode::kFull, StoreMode::kFailing, StoreMode::kStats}) {
    TempDir dir;
    const JudgedStep step = judged_step(dir.path(), mode);
    ASSERT_EQ(step.metrics.size(), 3u);  // same, differs, and the input compared with itself
    for (const auto& m : step.metrics) {
      EXPECT_EQ(m.key.side, Side::kCompiled);
      EXPECT_EQ(m.metrics.elements, 256u * 256u);
      EXPECT_EQ(m.metrics.allclose, m.key.module != "differs") << m.key.module;
      EXPECT_EQ(m.tolerances.atol, 1e-4);
    }
  }
}

// A float32 call's late-reference decision judges its parameters' gradient sums during the
// backward (judge_pair), and collect() records the same sums: the recorder takes those metrics
// instead of comparing the pair again, but only for the very tensors judged, unchanged since.
// A single-pass recorder storing metrics only, judging with atol 1e-4 and rtol 1e-3.
RecorderOptions stats_only() {
  RecorderOptions options;
  options.store = StoreMode::kStats;
  return options;
}
const formats::Provenance kSinglePassTolerances{
    {"mode", "single_pass"}, {"atol", "0.0001"}, {"rtol", "0.001"}};

TEST(Recorder, APairJudgedBeforeItIsRecordedIsNotComparedAgainUnlessItChanged) {
  TempDir dir;
  Recorder recorder(dir.path(), kSinglePassTolerances, stats_only());
  EXPECT_THROW(recorder.judge_pair(at::randn({4}), at::randn({4}), {}), UsageError);  // no step
  recorder.begin_step(0);
  const formats::Tolerances tolerances{1e-4, 1e-3};
  const auto pair = [] {
    const at::Tensor eager = at::randn({300, 1000}).mul(1e3);  // a gradient at a real loss scale
    return std::pair{eager, eager.add(at::randn({300, 1000}).mul(1e-3))};
  };
  auto [kept_eager, kept_compiled] = pair();
  auto [changed_eager, changed_compiled] = pair();
  auto [elsewhere_eager, elsewhere_compiled] = pair();
  const formats::TensorMetrics kept = recorder.judge_pair(kept_eager, kept_compiled, tolerances);
  const formats::TensorMetrics changed =
      recorder.judge_pair(changed_eager, changed_compiled, tolerances);
  recorder.judge_pair(elsewhere_eager, elsewhere_compiled, tolerances);
  EXPECT_EQ(kept.elements, 300'000u);
  EXPECT_FALSE(kept.allclose);
  // Bytes written behind torch's back (no version change): the metrics judged before stand,
  // which shows they were taken, not computed again.
  std::memset(kept_compiled.data_ptr(), 0, 4 * 1000);
  changed_compiled.mul_(0.5);  // a change in place torch sees: compared again
  const auto param = [](const char* module, Side side) {
    return RecordKey{0, module, 0, Kind::kParamGrad, 0, side};
  };
  recorder.record(param("kept", Side::kEager), kept_eager, "", true);
  recorder.record(param("kept", Side::kCompiled), kept_compiled, "", true);
  recorder.record(param("changed", Side::kEager), changed_eager, "", true);
  recorder.record(param("changed", Side::kCompiled), changed_compiled, "", true);
  // Each judged, but never as one pair: each compared with its real twin.
  recorder.record(param("elsewhere", Side::kEager), elsewhere_eager, "", true);
  recorder.record(param("elsewhere", Side::kCompiled), kept_compiled.clone(), "", true);
  const fs::path file = recorder.end_step();
  std::map<std::string, formats::TensorMetrics> stored;
  const formats::StepReader reader(file);
  for (const auto& m : reader.stored_metrics()) stored[m.key.module] = m.metrics;
  ASSERT_EQ(stored.size(), 3u);
  EXPECT_EQ(stored["kept"].rmse, kept.rmse);
  EXPECT_EQ(stored["kept"].max_abs, kept.max_abs);
  EXPECT_EQ(stored["kept"].histogram, kept.histogram);
  EXPECT_NE(stored["changed"].rmse, changed.rmse);
  EXPECT_GT(stored["changed"].max_abs, 100.0);    // half of a value of about 1e3
  EXPECT_GT(stored["elsewhere"].max_abs, 100.0);  // its compiled side is another tensor
}

// Single-pass judges a module's parameter gradient sums once its backward is done
// (judge_later), in the background, each side against the reference too; collect() records the
// same sums: the recorder takes those metrics, but only for the very tensors judged, unchanged.
TEST(Recorder, APairJudgedAheadInTheBackgroundIsTakenWhenItsRecordsComeUnchanged) {
  TempDir dir;
  Recorder recorder(dir.path(), kSinglePassTolerances, stats_only());
  EXPECT_THROW(recorder.judge_later("m", at::randn({4}), at::randn({4}), {}), UsageError);
  recorder.begin_step(0);
  struct Sums {
    at::Tensor eager, compiled, reference;
  };
  const auto sums = [] {  // bf16 gradients at a real loss scale, and their float32 reference
    const at::Tensor reference = at::randn({300, 1000}).mul(1e3);
    return Sums{reference.to(at::kBFloat16),
                reference.add(at::randn({300, 1000}).mul(3.0)).to(at::kBFloat16), reference};
  };
  const Sums kept = sums(), changed = sums(), alone = sums();
  recorder.judge_later("kept", kept.eager, kept.compiled, kept.reference);
  recorder.judge_later("changed", changed.eager, changed.compiled, changed.reference);
  recorder.judge_later("alone", alone.eager, alone.compiled, {});
  recorder.failing_calls();  // waits until the background thread has judged them
  // Bytes written behind torch's back (no version change): the metrics judged ahead stand,
  // which shows they were taken, not computed again.
  std::memset(kept.compiled.data_ptr(), 0, kept.compiled.nbytes());
  std::memset(alone.compiled.data_ptr(), 0, alone.compiled.nbytes());
  changed.compiled.mul_(0.5);  // a change in place torch sees: compared again
  const auto param = [](const char* module, Side side) {
    return RecordKey{0, module, 0, Kind::kParamGrad, 0, side};
  };
  for (const auto& [module, tensors] : {std::pair{"kept", kept}, std::pair{"changed", changed}}) {
    // The reference first: a module's calls record theirs before its parameters' sums come.
    recorder.record(param(module, Side::kReference), tensors.reference, "", true);
    recorder.record(param(module, Side::kEager), tensors.eager, "", true);
    recorder.record(param(module, Side::kCompiled), tensors.compiled, "", true);
  }
  recorder.record(param("alone", Side::kEager), alone.eager, "", true);
  recorder.record(param("alone", Side::kCompiled), alone.compiled, "", true);
  const fs::path file = recorder.end_step();
  std::map<std::pair<std::string, Side>, formats::TensorMetrics> stored;
  for (const auto& m : formats::StepReader(file).stored_metrics()) {
    stored[{m.key.module, m.key.side}] = m.metrics;
  }
  ASSERT_EQ(stored.size(), 7u);  // each referenced pair's row and its two reference comparisons
  const auto max_abs = [&](const char* module, Side side) {
    return stored[std::pair<std::string, Side>(module, side)].max_abs;
  };
  // kept: the pair and the compiled side against the reference as judged ahead (about 3 apart),
  // not as the zeros now there (about 1e3 apart).
  EXPECT_LT(max_abs("kept", Side::kCompiled), 100.0);
  EXPECT_LT(max_abs("kept", Side::kReference), 100.0);
  EXPECT_LT(max_abs("alone", Side::kCompiled), 100.0);
  EXPECT_GT(max_abs("changed", Side::kCompiled), 100.0);  // half of about 1e3
  EXPECT_GT(max_abs("changed", Side::kReference), 100.0);
  EXPECT_LT(max_abs("changed", Side::kEager), 100.0);  // eager against the reference
}

// A float32 call's late-reference decision comes at the end of the backward pass, once
// judge_later() has queued its parameters' gradient sums: judge_pair() takes the background
// thread's metrics of that very pair, waiting for them, when they were judged with the same
// tolerances, and computes the pair itself otherwise.
TEST(Recorder, APairJudgedAheadIsTakenByJudgePairWithTheSameTolerances) {
  TempDir dir;
  Recorder recorder(dir.path(), kSinglePassTolerances, stats_only());
  recorder.begin_step(0);
  const at::Tensor eager = at::randn({300, 1000}).mul(1e3);  // float32 sums at a real loss scale
  const at::Tensor compiled = eager.add(at::randn({300, 1000}).mul(1e-3));
  const at::Tensor waited_eager = eager.clone(), waited_compiled = compiled.clone();
  recorder.judge_later("m", eager, compiled, {});
  recorder.judge_later("waited", waited_eager, waited_compiled, {});
  const formats::Tolerances same{1e-4, 1e-3};
  // Right after queueing it: judge_pair() waits for the background thread's metrics.
  const formats::TensorMetrics waited = recorder.judge_pair(waited_eager, waited_compiled, same);
  recorder.failing_calls();  // waits until the background thread has judged them
  // Bytes written behind torch's back (no version change): the metrics judged ahead stand,
  // which shows they were taken, not computed again, unless the tolerances differ.
  std::memset(compiled.data_ptr(), 0, compiled.nbytes());
  const formats::TensorMetrics taken = recorder.judge_pair(eager, compiled, same);
  const formats::TensorMetrics computed = recorder.judge_pair(eager, compiled, {1e-2, 1e-3});
  EXPECT_LT(taken.max_abs, 1.0);             // about 4e-3 apart as judged ahead
  EXPECT_GT(computed.max_abs, 1e3);          // the zeros now there
  EXPECT_EQ(waited.max_abs, taken.max_abs);  // the same values, judged the same way
  EXPECT_EQ(waited.rmse, taken.rmse);
  EXPECT_EQ(waited.histogram, taken.histogram);
  recorder.end_step();
}

// A side the recorder cannot keep as it is (a device tensor; here a strided one) is judged
// ahead in a copy taken at once, and its record reuses that copy: the bytes judged are the bytes
// stored, and nothing is copied twice. Such copies take at most a quarter of the memory budget
// a step; past it a pair is judged when its records come.
TEST(Recorder, ASideJudgedAheadInACopyIsRecordedFromThatCopy) {
  TempDir dir;
  const std::int64_t rows = 300, columns = 1000;
  const std::size_t copy_bytes = rows * columns * sizeof(float);
  RecorderOptions options;                       // full: every tensor is stored
  options.memory_budget_bytes = 4 * copy_bytes;  // one copy fits in a quarter, not two
  Recorder recorder(dir.path(), kSinglePassTolerances, options);
  recorder.begin_step(0);
  const auto pair = [&] {  // a transposed eager sum at a real loss scale, a contiguous compiled
    const at::Tensor eager = at::randn({columns, rows}).mul(1e3).t();
    return std::pair{eager, eager.add(at::randn({rows, columns}).mul(3.0)).contiguous()};
  };
  const auto [copied_eager, copied_compiled] = pair();
  const auto [over_eager, over_compiled] = pair();
  ASSERT_FALSE(copied_eager.is_contiguous());
  ASSERT_TRUE(copied_compiled.is_contiguous());
  const at::Tensor judged_values = copied_eager.clone();
  recorder.judge_later("copied", copied_eager, copied_compiled, {});
  recorder.judge_later("over", over_eager, over_compiled, {});  // past the budget's quarter
  recorder.failing_calls();  // waits until the background thread has judged them
  // Zeros behind torch's back (no version change): a record that copied the tensor now would
  // store and compare them.
  for (const at::Tensor& eager : {copied_eager, over_eager}) {
    std::memset(eager.data_ptr(), 0, eager.nbytes());
  }
  const auto param = [](const char* module, Side side) {
    return RecordKey{0, module, 0, Kind::kParamGrad, 0, side};
  };
  for (const auto& [module, eager, compiled] : {std::tuple{"copied", copied_eager, copied_compiled},
                                                std::tuple{"over", over_eager, over_compiled}}) {
    recorder.record(param(module, Side::kEager), eager, "", true);
    recorder.record(param(module, Side::kCompiled), compiled, "", true);
  }
  const fs::path file = recorder.end_step();
  formats::StepReader reader(file);
  std::map<std::string, formats::TensorMetrics> stored;
  for (const auto& m : reader.stored_metrics()) stored[m.key.module] = m.metrics;
  ASSERT_EQ(stored.size(), 2u);
  EXPECT_LT(stored["copied"].max_abs, 100.0);  // judged ahead: about 3 apart
  EXPECT_GT(stored["over"].max_abs, 100.0);    // judged now, against the zeros: about 1e3
  const formats::RecordInfo* copied = reader.find(param("copied", Side::kEager));
  ASSERT_NE(copied, nullptr);
  EXPECT_EQ(reader.read(*copied), contiguous_bytes(judged_values));
  const formats::RecordInfo* over = reader.find(param("over", Side::kEager));
  ASSERT_NE(over, nullptr);
  EXPECT_EQ(reader.read(*over), std::vector<std::byte>(copy_bytes));  // zeros
}

RecordKey call_key(std::string module, std::uint32_t call, Kind kind, Side side) {
  return RecordKey{0, std::move(module), call, kind, 0, side};
}

TEST(Recorder, FailingCallsAreTheCallsWithAPairOutsideItsTolerances) {
  for (const StoreMode mode : {StoreMode::kFull, StoreMode::kFailing}) {
    TempDir dir;
    RecorderOptions options;
    options.store = mode;
    Recorder recorder(dir.path(), {{"mode", "single_pass"}, {"atol", "0.0001"}, {"rtol", "0.001"}},
                      options);
    EXPECT_THROW(recorder.failing_calls(), UsageError);  // outside a step
    recorder.begin_step(0);
    const at::Tensor x = at::randn({64, 64});
    recorder.record(call_key("m", 0, Kind::kFwdOutput, Side::kCompiled), x);
    recorder.record(call_key("m", 0, Kind::kFwdOutput, Side::kEager), x);
    recorder.record(call_key("m", 1, Kind::kFwdOutput, Side::kCompiled), x);
    recorder.record(call_key("m", 1, Kind::kFwdOutput, Side::kEager), x);
    recorder.record(call_key("m", 1, Kind::kGradInput, Side::kCompiled),
                    x.add(1e-3));  // > tolerance
    recorder.record(call_key("m", 1, Kind::kGradInput, Side::kEager), x);
    recorder.record(call_key("n", 0, Kind::kFwdOutput, Side::kCompiled), x.add(5e-5));  // within
    recorder.record(call_key("n", 0, Kind::kFwdOutput, Side::kEager), x);
    recorder.record(call_key("o", 2, Kind::kFwdOutput, Side::kCompiled), x.reshape({4096}));
    recorder.record(call_key("o", 2, Kind::kFwdOutput, Side::kEager), x);         // shapes differ
    recorder.record(call_key("p", 0, Kind::kFwdOutput, Side::kEager), x.add(1));  // no twin yet
    EXPECT_EQ(recorder.failing_calls(), (std::vector<CallKey>{{"m", 1}, {"o", 2}}));
    recorder.end_step();
    recorder.begin_step(1);  // a new step starts with none
    EXPECT_TRUE(recorder.failing_calls().empty());
    recorder.end_step();
  }
}

// Single-pass decides a float32 call's reference once its backward has run. Until then its pairs
// wait for that reference, each judged as soon as both sides are in, so that the decision can ask
// for their verdicts, and a reference that comes later is judged with them, in stats mode too,
// where no tensor is kept for later.
TEST(Recorder, ACallHeldForItsReferenceIsJudgedWithTheReferenceThatComesLater) {
  TempDir dir;
  Recorder recorder(dir.path(), kSinglePassTolerances, stats_only());
  EXPECT_THROW(recorder.hold_for_reference("m", 0), UsageError);  // outside a step
  EXPECT_THROW(recorder.fails_before_reference("m", 0), UsageError);
  recorder.begin_step(0);
  const at::Tensor x = at::randn({64, 64}).mul(1e3);  // activations of a real model's scale
  const auto record = [&](const char* module, Kind kind, Side side, const at::Tensor& tensor) {
    recorder.record(call_key(module, 0, kind, side), tensor);
  };
  for (const char* module : {"referred", "failing", "passing"}) {
    recorder.hold_for_reference(module, 0);
    record(module, Kind::kFwdOutput, Side::kEager, x);
    record(module, Kind::kFwdInput, Side::kCompiled, x);  // recorded once: waits for the step end
  }
  record("referred", Kind::kFwdOutput, Side::kCompiled, x.add(2));
  record("failing", Kind::kFwdOutput, Side::kCompiled, x.add(2));
  record("passing", Kind::kFwdOutput, Side::kCompiled, x);
  record("passing", Kind::kGradInput, Side::kCompiled, x.mul(1e-3));
  record("passing", Kind::kGradInput, Side::kEager, x.mul(1e-3));
  record("after", Kind::kFwdOutput, Side::kCompiled, x);  // a call not held, recorded later
  record("after", Kind::kFwdOutput, Side::kEager, x);
  EXPECT_TRUE(recorder.fails_before_reference("referred", 0));
  EXPECT_TRUE(recorder.fails_before_reference("failing", 0));
  EXPECT_FALSE(recorder.fails_before_reference("passing", 0));
  EXPECT_TRUE(recorder.failing_calls().empty());  // judged, but still waiting for a reference
  record("referred", Kind::kFwdOutput, Side::kReference, x.add(1));
  for (const char* module : {"referred", "failing", "passing"}) {
    recorder.settle_reference(module, 0);  // "referred"'s reference came; the others get none
  }
  const std::vector<CallKey> failing = recorder.failing_calls();
  EXPECT_NE(std::find(failing.begin(), failing.end(), CallKey{"failing", 0}), failing.end());
  EXPECT_EQ(std::find(failing.begin(), failing.end(), CallKey{"passing", 0}), failing.end());
  const fs::path file = recorder.end_step();
  // Listed in the order they came, though judged with their reference later: the report's
  // modules are in execution order.
  std::vector<std::string> listed;
  for (const auto& r : formats::StepReader(file).records()) {
    if (r.key.kind == Kind::kFwdOutput && r.key.side == Side::kCompiled)
      listed.push_back(r.key.module);
  }
  EXPECT_EQ(listed, (std::vector<std::string>{"referred", "failing", "passing", "after"}));
  std::map<std::pair<std::string, Kind>, std::set<Side>> sides;
  std::map<std::string, formats::TensorMetrics> rows;
  for (const auto& m : formats::StepReader(file).stored_metrics()) {
    if (m.key.kind == Kind::kFwdInput) continue;
    sides[{m.key.module, m.key.kind}].insert(m.key.side);
    if (m.key.side == Side::kCompiled) rows[m.key.module] = m.metrics;
  }
  // The row, and each side against the reference that came after the row was judged.
  EXPECT_EQ(sides[std::pair("referred", Kind::kFwdOutput)],
            (std::set<Side>{Side::kCompiled, Side::kEager, Side::kReference}));
  EXPECT_EQ(sides[std::pair("failing", Kind::kFwdOutput)], std::set<Side>{Side::kCompiled});
  EXPECT_EQ(sides[std::pair("passing", Kind::kGradInput)], std::set<Side>{Side::kCompiled});
  EXPECT_NEAR(rows["referred"].max_abs, 2.0, 1e-3);  // float32 sums of values near 1e3
  EXPECT_FALSE(rows["failing"].allclose);
  EXPECT_TRUE(rows["passing"].allclose);
}

TEST(Recorder, StoreModesKeepTheTensorsTheyPromise) {
  TempDir full_dir, failing_dir, stats_dir;
  const JudgedStep full = judged_step(full_dir.path(), StoreMode::kFull);
  for (const auto& r : full.records) EXPECT_TRUE(r.stored) << formats::to_string(r.key);
  const JudgedStep failing = judged_step(failing_dir.path(), StoreMode::kFailing);
  EXPECT_FALSE(failing.stored("same", Side::kEager));
  EXPECT_FALSE(failing.stored("same", Side::kCompiled));
  EXPECT_TRUE(failing.stored("differs", Side::kEager));
  EXPECT_TRUE(failing.stored("differs", Side::kCompiled));
  EXPECT_TRUE(failing.stored("alone", Side::kEager));  // a WARN row keeps its tensor
  const JudgedStep stats = judged_step(stats_dir.path(), StoreMode::kStats);
  for (const auto& r : stats.records) {
    EXPECT_FALSE(r.stored) << formats::to_string(r.key);
    EXPECT_EQ(r.shape, (std::vector<std::int64_t>{256, 256}));
  }
  EXPECT_LT(fs::file_size(stats.file) * 20, fs::file_size(full.file));
}

TEST(Recorder, HeldSnapshotsStayWithinHalfTheBudgetAndTheRestIsStoredWhole) {
  // Two-pass: every eager record comes before its compiled twin. 16 pairs of 64 KiB under a
  // 256 KiB budget: at most 128 KiB wait for their twin; the older ones are stored whole.
  TempDir dir;
  RecorderOptions options;
  options.store = StoreMode::kStats;
  options.memory_budget_bytes = 256 << 10;
  Recorder recorder(dir.path(), {{"mode", "two_pass"}}, options);
  recorder.begin_step(0);
  std::vector<at::Tensor> tensors;
  for (int i = 0; i < 16; ++i) tensors.push_back(at::randn({128, 128}));  // 64 KiB each
  std::size_t most_held = 0;
  for (int i = 0; i < 16; ++i) {
    recorder.record(key("m", i, Kind::kFwdOutput, Side::kEager), tensors[i]);
    most_held = std::max(most_held, recorder.held_bytes());
  }
  for (int i = 0; i < 16; ++i) {
    recorder.record(key("m", i, Kind::kFwdOutput, Side::kCompiled), tensors[i]);
  }
  formats::StepReader reader(recorder.end_step());
  EXPECT_LE(most_held, options.memory_budget_bytes / 2);
  std::size_t stored = 0;
  for (const auto& r : reader.records()) stored += r.stored;
  EXPECT_GT(stored, 0u);  // spilled pairs, stored whole on both sides
  EXPECT_EQ(stored % 2, 0u);
  EXPECT_EQ(reader.stored_metrics().size() + stored / 2, 16u);  // every other pair judged
  EXPECT_GT(reader.stored_metrics().size(), 0u);
}

}  // namespace
}  // namespace dynaprobe::capture
