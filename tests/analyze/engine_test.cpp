// The engine pairs tensors whatever their dtypes and chunking, and its results do not depend on
// how many threads compute them.
#include "dynaprobe/analyze/engine.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "dynaprobe/analyze/report.h"
#include "dynaprobe/formats/error.h"
#include "dynaprobe/formats/writer.h"
#include "formats/error_of.h"
#include "formats/test_util.h"

namespace dynaprobe::analyze {
namespace {

using formats::DType;
using formats::Kind;
using formats::Side;
using formats::testing::TempDir;

std::vector<float> bf16_rounded_noise(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> values(n);
  for (auto& v : values) {
    std::uint32_t bits;
    float x = normal(rng);
    std::memcpy(&bits, &x, 4);
    bits &= 0xffff0000u;
    std::memcpy(&v, &bits, 4);
  }
  return values;
}

std::vector<std::uint16_t> to_bf16(const std::vector<float>& values) {
  std::vector<std::uint16_t> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, &values[i], 4);
    out[i] = static_cast<std::uint16_t>(bits >> 16);
  }
  return out;
}

formats::Record record(Side side, DType dtype, std::vector<std::int64_t> shape, const void* data) {
  formats::Record r;
  r.key = {0, "layers.0", 0, Kind::kFwdOutput, 0, side};
  r.tensor = {dtype, std::move(shape), data};
  return r;
}

void write_dump(const std::filesystem::path& dir, const formats::Record& r,
                std::size_t chunk_bytes) {
  formats::WriterOptions options;
  options.chunk_bytes = chunk_bytes;
  formats::StepWriter writer(dir, 0, {{"mode", "two_pass"}}, options);
  writer.write(r);
  writer.commit();
}

TEST(Engine, PairsTensorsOfDifferentDtypesAndChunking) {
  const std::size_t n = 300007;
  const auto eager = bf16_rounded_noise(n, 1);
  auto compiled = eager;
  for (std::size_t i = 0; i < n; i += 1013) compiled[i] *= 1.0078125f;  // one bf16 ulp
  const auto compiled_bf16 = to_bf16(compiled);
  for (std::size_t i = 0; i < n; ++i) {  // what the bfloat16 copy holds
    const std::uint32_t bits = static_cast<std::uint32_t>(compiled_bf16[i]) << 16;
    std::memcpy(&compiled[i], &bits, 4);
  }

  MetricsAccumulator direct;
  direct.accumulate(eager.data(), compiled.data(), n, 0, {});
  const TensorMetrics expected = direct.result();
  ASSERT_FALSE(expected.allclose);

  TempDir dir;
  // Eager float32 in 40 KB chunks, compiled bfloat16 in 12 KB chunks: boundaries never align.
  write_dump(dir.path() / "eager",
             record(Side::kEager, DType::kFloat32, {static_cast<std::int64_t>(n)}, eager.data()),
             40000);
  write_dump(dir.path() / "compiled",
             record(Side::kCompiled, DType::kBFloat16, {static_cast<std::int64_t>(n)},
                    compiled_bf16.data()),
             12000);
  CompareOptions fixed;
  fixed.dtype_aware = false;  // the spec's tolerances as they are
  const Comparison result = compare(dir.path() / "eager", dir.path() / "compiled", fixed);
  ASSERT_EQ(result.steps.size(), 1u);
  ASSERT_EQ(result.steps[0].rows.size(), 1u);
  const Row& row = result.steps[0].rows[0];
  ASSERT_TRUE(row.metrics);
  EXPECT_EQ(row.status, Status::kFail);
  EXPECT_EQ(row.metrics->max_abs, expected.max_abs);
  EXPECT_EQ(row.metrics->max_rel, expected.max_rel);
  EXPECT_NEAR(row.metrics->mean_abs, expected.mean_abs, 1e-12);
  EXPECT_EQ(row.metrics->mismatches, expected.mismatches);
  EXPECT_EQ(row.metrics->worst_index, expected.worst_index);
  EXPECT_EQ(row.compiled->dtype, DType::kBFloat16);
  EXPECT_FALSE(row.tolerances);

  // By default a bf16 side raises the tolerances to bf16's floor: one bf16 step is within it.
  const Comparison aware = compare(dir.path() / "eager", dir.path() / "compiled", {});
  const Row& judged = aware.steps[0].rows[0];
  EXPECT_EQ(judged.status, Status::kPass);
  ASSERT_TRUE(judged.tolerances);
  EXPECT_EQ(judged.tolerances->rtol, 1.6e-2);
  EXPECT_EQ(judged.tolerances->atol, 1e-2);
  EXPECT_EQ(judged.metrics->max_abs, expected.max_abs);  // the metrics themselves are the same

  // A rule by pattern wins over both; the last matching rule wins.
  CompareOptions ruled;
  ruled.tolerance_rules = {{"fwd_*", {0, 0}}, {"layers.*", {1e-4, 1e-3}}, {"nomatch", {1, 1}}};
  const Comparison ruled_result = compare(dir.path() / "eager", dir.path() / "compiled", ruled);
  const Row& by_rule = ruled_result.steps[0].rows[0];
  // "layers.*" came last: the spec's tolerances again, over "fwd_*" and over the dtype floor.
  EXPECT_EQ(by_rule.status, Status::kFail);
  EXPECT_FALSE(by_rule.tolerances);  // the same as the step's, so not repeated on the row
}

TEST(Engine, DtypeFloorsCoverReducedPrecisionDtypesOnly) {
  EXPECT_EQ(dtype_tolerance_floor(DType::kBFloat16).atol, 1e-2);
  EXPECT_EQ(dtype_tolerance_floor(DType::kBFloat16).rtol, 1.6e-2);
  EXPECT_EQ(dtype_tolerance_floor(DType::kFloat16).rtol, 2e-3);
  EXPECT_EQ(dtype_tolerance_floor(DType::kFloat8E4M3FN).rtol, 0.25);
  EXPECT_EQ(dtype_tolerance_floor(DType::kFloat32).rtol, 0.0);
  EXPECT_EQ(dtype_tolerance_floor(DType::kFloat64).atol, 0.0);
}

TEST(Engine, ResultsDoNotDependOnTheThreadCount) {
  const std::size_t n = 1 << 20;
  const auto eager = bf16_rounded_noise(n, 2);
  auto compiled = eager;
  for (std::size_t i = 0; i < n; i += 77) compiled[i] += 1e-5f * static_cast<float>(i % 13);
  TempDir dir;
  formats::WriterOptions options;
  options.chunk_bytes = 64 << 10;
  {
    formats::StepWriter writer(dir.path(), 0, {{"mode", "single_pass"}}, options);
    writer.write(record(Side::kEager, DType::kFloat32, {1024, 1024}, eager.data()));
    writer.write(record(Side::kCompiled, DType::kFloat32, {1024, 1024}, compiled.data()));
    writer.commit();
  }
  CompareOptions one;
  one.threads = 1;
  const auto serial = compare(dir.path(), dir.path(), one).steps.at(0).rows.at(0).metrics;
  const auto parallel = compare(dir.path(), dir.path(), {}).steps.at(0).rows.at(0).metrics;
  ASSERT_TRUE(serial && parallel);
  EXPECT_EQ(serial->max_abs, parallel->max_abs);
  EXPECT_EQ(serial->mean_abs, parallel->mean_abs);  // bit for bit: partials merge in order
  EXPECT_EQ(serial->rmse, parallel->rmse);
  EXPECT_EQ(serial->cosine, parallel->cosine);
  EXPECT_EQ(serial->worst_index, parallel->worst_index);
}

TEST(Engine, ProgressReachesTheTotal) {
  const auto values = bf16_rounded_noise(100000, 3);
  TempDir dir;
  {
    formats::StepWriter writer(dir.path(), 0, {});
    writer.write(record(Side::kEager, DType::kFloat32, {100000}, values.data()));
    writer.write(record(Side::kCompiled, DType::kFloat32, {100000}, values.data()));
    writer.commit();
  }
  std::uint64_t last_done = 0, last_total = 0;
  CompareOptions options;
  options.progress = [&](std::uint64_t done, std::uint64_t total) {
    last_done = done;
    last_total = total;
  };
  EXPECT_TRUE(compare(dir.path(), dir.path(), options).all_pass());
  EXPECT_EQ(last_total, 800000u);
  EXPECT_EQ(last_done, last_total);
}

// The capture's /modules attributes (which compiled functions a wrapped module became, its graph
// breaks, notes) reach the step report and the JSON, both sides merged.
TEST(Engine, ModuleAttributesOfBothSidesReachTheReportAndTheJson) {
  const std::vector<float> values = {1, 2, 3};
  TempDir dir;
  {
    formats::StepWriter writer(dir.path() / "eager", 0, {{"mode", "eager_only"}});
    writer.write(record(Side::kEager, DType::kFloat32, {3}, values.data()));
    writer.write_module({"layers.0", {{"role", "wrapped"}}});
    writer.write_module({"head", {{"role", "ignored"}}});
    writer.commit();
  }
  {
    formats::StepWriter writer(dir.path() / "compiled", 0, {{"mode", "compiled_only"}});
    writer.write(record(Side::kCompiled, DType::kFloat32, {3}, values.data()));
    writer.write_module({"layers.0",
                         {{"role", "wrapped"},
                          {"compiled_functions", "__compiled_fn_1,__compiled_fn_3"},
                          {"graph_breaks", "1"},
                          {"graph_break_reasons", "Call to `torch._dynamo.graph_break()`"}}});
    writer.commit();
  }
  const Comparison result = compare(dir.path() / "eager", dir.path() / "compiled", {});
  ASSERT_EQ(result.steps.size(), 1u);
  const auto& modules = result.steps[0].modules;
  ASSERT_EQ(modules.size(), 2u);
  const std::map<std::string, std::string> expected = {
      {"role", "wrapped"},
      {"compiled_functions", "__compiled_fn_1,__compiled_fn_3"},
      {"graph_breaks", "1"},
      {"graph_break_reasons", "Call to `torch._dynamo.graph_break()`"}};
  EXPECT_EQ(modules.at("layers.0"), expected);
  EXPECT_EQ(modules.at("head").at("role"), "ignored");

  const std::string json = render_json({RankComparison{0, "", result}});
  EXPECT_NE(json.find("\"modules\": {\"head\": {\"role\": \"ignored\"}, \"layers.0\": "
                      "{\"compiled_functions\": \"__compiled_fn_1,__compiled_fn_3\", "
                      "\"graph_break_reasons\": \"Call to `torch._dynamo.graph_break()`\", "
                      "\"graph_breaks\": \"1\", \"role\": \"wrapped\"}}"),
            std::string::npos)
      << json;
  // Rows keep each side's dtype and shape.
  EXPECT_NE(json.find("\"eager\": {\"dtype\": \"float32\", \"shape\": [3]}"), std::string::npos);

  CompareOptions only_layers;
  only_layers.module_glob = "layers.*";
  const auto filtered = compare(dir.path() / "eager", dir.path() / "compiled", only_layers);
  EXPECT_EQ(filtered.steps.at(0).modules.count("head"), 0u);
  EXPECT_EQ(filtered.steps.at(0).modules.count("layers.0"), 1u);
}

// A --module filter that selects no module is a usage error naming the filter and the dump's
// modules, never an empty report that passes.
TEST(Engine, ModuleFilterMatchingNothingIsAUsageError) {
  const std::vector<float> values = {1, 2, 3};
  TempDir dir;
  {
    formats::StepWriter writer(dir.path(), 0, {{"mode", "two_pass"}});
    writer.write(record(Side::kEager, DType::kFloat32, {3}, values.data()));
    writer.write(record(Side::kCompiled, DType::kFloat32, {3}, values.data()));
    writer.write_module({"layers.0", {{"role", "wrapped"}}});
    writer.write_module({"head", {{"role", "ignored"}}});
    writer.commit();
  }
  CompareOptions typo;
  typo.module_glob = "typo*";
  try {
    compare(dir.path(), dir.path(), typo);
    FAIL() << "expected a UsageError";
  } catch (const dynaprobe::UsageError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("'typo*'"), std::string::npos) << message;
    EXPECT_NE(message.find("matches no module"), std::string::npos) << message;
    EXPECT_NE(message.find("layers.0, head"), std::string::npos) << message;
  }
  CompareOptions good;
  good.module_glob = "layers.?";
  const Comparison result = compare(dir.path(), dir.path(), good);
  EXPECT_TRUE(result.all_pass());
  EXPECT_EQ(result.steps.at(0).counts().compared, 1u);
  // A filter that selects only an ignored module compares nothing: not a pass.
  CompareOptions ignored_only;
  ignored_only.module_glob = "head";
  const Comparison nothing = compare(dir.path(), dir.path(), ignored_only);
  EXPECT_FALSE(nothing.all_pass());
  EXPECT_TRUE(nothing.steps.at(0).counts().nothing_compared());
}

using testing_helpers::error_of;

// A folder holding only a step the writer never committed is an error, not an empty pass.
TEST(Engine, OnlyUnfinishedStepsAreAnError) {
  TempDir dir;
  formats::testing::write_file(dir.path() / "step_00000000.h5.partial", "killed mid-write");
  const std::string message =
      error_of<dynaprobe::FormatError>([&] { compare(dir.path(), dir.path(), {}); });
  EXPECT_NE(message.find("no committed step, only 1 unfinished"), std::string::npos) << message;
  EXPECT_NE(message.find("step_00000000.h5.partial"), std::string::npos) << message;
}

// Tolerances that would silently fail (NaN) or pass (infinity) everything are refused, from the
// options and from the dump's provenance.
TEST(Engine, ToleranceThatIsNotAFiniteNonNegativeNumberIsRefused) {
  const std::vector<float> values = {1, 2, 3};
  TempDir dir;
  for (const auto& [name, atol] :
       {std::pair{"good", "0.01"}, std::pair{"inf", "inf"}, std::pair{"junk", "1e-3x"}}) {
    formats::StepWriter writer(dir.path() / name, 0, {{"mode", "two_pass"}, {"atol", atol}});
    writer.write(record(Side::kEager, DType::kFloat32, {3}, values.data()));
    writer.write(record(Side::kCompiled, DType::kFloat32, {3}, values.data()));
    writer.commit();
  }
  const auto good = dir.path() / "good";
  EXPECT_DOUBLE_EQ(compare(good, good, {}).steps.at(0).tolerances.atol, 0.01);
  for (double bad : {std::nan(""), -1e-3, static_cast<double>(INFINITY)}) {
    CompareOptions options;
    options.atol = bad;
    EXPECT_NE(error_of<dynaprobe::UsageError>([&] {
                compare(good, good, options);
              }).find("atol must be a finite number >= 0"),
              std::string::npos);
    CompareOptions rtol;
    rtol.rtol = bad;
    EXPECT_NE(error_of<dynaprobe::UsageError>([&] {
                compare(good, good, rtol);
              }).find("rtol must be a finite number >= 0"),
              std::string::npos);
  }
  for (const char* name : {"inf", "junk"}) {
    const auto path = dir.path() / name;
    const std::string message = error_of<dynaprobe::FormatError>([&] { compare(path, path, {}); });
    EXPECT_NE(message.find("provenance atol="), std::string::npos) << message;
    // It says how to judge the dump anyway: the one command that takes a tolerance.
    EXPECT_NE(message.find("`dynaprobe compare --atol X`"), std::string::npos) << message;
    CompareOptions given;  // the user's own tolerance replaces the damaged one
    given.atol = 1e-4;
    EXPECT_TRUE(compare(path, path, given).all_pass());
  }
}

// Two one-sided captures given in the wrong order are a usage error: their provenance (mode) and
// their records say which side each holds.
TEST(Engine, SwappedSidesAreAUsageError) {
  const std::vector<float> values = {1, 2, 3};
  TempDir dir;
  {
    formats::StepWriter writer(dir.path() / "eager", 0, {{"mode", "eager_only"}});
    writer.write(record(Side::kEager, DType::kFloat32, {3}, values.data()));
    writer.commit();
  }
  for (const char* name : {"compiled", "compiled2"}) {
    formats::StepWriter writer(dir.path() / name, 0, {{"mode", "compiled_only"}});
    writer.write(record(Side::kCompiled, DType::kFloat32, {3}, values.data()));
    writer.commit();
  }
  const auto eager = dir.path() / "eager", compiled = dir.path() / "compiled";
  EXPECT_TRUE(compare(eager, compiled, {}).all_pass());
  const std::string swapped =
      error_of<dynaprobe::UsageError>([&] { compare(compiled, eager, {}); });
  EXPECT_NE(swapped.find("the two sides look swapped"), std::string::npos) << swapped;
  EXPECT_NE(swapped.find("give the eager dump first"), std::string::npos) << swapped;
}

// Two captures of the compiled side alone: the first is a baseline, its compiled side compared in
// the eager side's place (before and after a torch upgrade); the provenance names what changed.
TEST(Engine, TwoCompiledCapturesCompareTheBaselineWithTheNewOne) {
  const std::vector<float> before = {1, 2, 3}, after = {1, 2, 3.5f};
  TempDir dir;
  const auto write = [&](const char* name, const char* torch, const std::vector<float>& values) {
    formats::StepWriter writer(dir.path() / name, 0,
                               {{"mode", "compiled_only"}, {"torch_version", torch}});
    writer.write(record(Side::kCompiled, DType::kFloat32, {3}, values.data()));
    writer.commit();
  };
  write("baseline", "2.12.0", before);
  write("same", "2.13.0", before);
  write("changed", "2.13.0", after);
  const Comparison same = compare(dir.path() / "baseline", dir.path() / "same", {});
  EXPECT_TRUE(same.compiled_baseline);
  EXPECT_TRUE(same.all_pass());
  const Comparison changed = compare(dir.path() / "baseline", dir.path() / "changed", {});
  ASSERT_EQ(changed.steps.size(), 1u);
  const Row& row = changed.steps[0].rows.at(0);
  EXPECT_EQ(row.status, Status::kFail);
  EXPECT_DOUBLE_EQ(row.metrics->max_abs, 0.5);
  const std::string provenance = render_provenance(changed);
  EXPECT_EQ(provenance.rfind("Baseline:      torch_version=2.12.0 mode=compiled_only\n", 0), 0u)
      << provenance;
  EXPECT_NE(provenance.find("Provenance differs between the baseline and the compiled dump:\n"
                            "  torch_version: baseline=2.12.0  compiled=2.13.0\n"),
            std::string::npos)
      << provenance;
}

// Two one-sided captures differ in their mode by design; only real differences are listed.
TEST(Engine, OneSidedCapturesDoNotListTheirModesAsADifference) {
  const std::vector<float> values = {1, 2, 3};
  TempDir dir;
  {
    formats::StepWriter writer(dir.path() / "eager", 0,
                               {{"mode", "eager_only"}, {"torch_version", "2.13.0"}});
    writer.write(record(Side::kEager, DType::kFloat32, {3}, values.data()));
    writer.commit();
  }
  {
    formats::StepWriter writer(dir.path() / "compiled", 0,
                               {{"mode", "compiled_only"}, {"torch_version", "2.14.0"}});
    writer.write(record(Side::kCompiled, DType::kFloat32, {3}, values.data()));
    writer.commit();
  }
  const Comparison result = compare(dir.path() / "eager", dir.path() / "compiled", {});
  ASSERT_EQ(result.provenance_differences.size(), 1u);
  EXPECT_EQ(result.provenance_differences[0].key, "torch_version");
  EXPECT_EQ(render_provenance(result).find("mode: "), std::string::npos)
      << render_provenance(result);
}

// Two-pass, a wrapped module the compiled model did not call but the eager model did: the
// capture notes NOT_RUN (it counts compiled calls); the report says it ran eagerly, and its
// eager-only gradients are missing on the compiled side, not a compiled wrapper's skip.
TEST(Engine, ModuleThatRanOnTheEagerSideOnlyIsMissingItsCompiledGradients) {
  const std::vector<float> values = {1, 2, 3};
  TempDir dir;
  {
    formats::StepWriter writer(dir.path(), 0, {{"mode", "two_pass"}});
    for (Side side : {Side::kEager, Side::kCompiled}) {  // "layers.0" ran on both sides
      for (Kind kind : {Kind::kFwdOutput, Kind::kGradInput}) {
        formats::Record r = record(side, DType::kFloat32, {3}, values.data());
        r.key.kind = kind;
        writer.write(r);
      }
    }
    for (Kind kind : {Kind::kFwdOutput, Kind::kGradInput}) {  // "layers.1" only eagerly
      formats::Record r = record(Side::kEager, DType::kFloat32, {3}, values.data());
      r.key.module = "layers.1";
      r.key.kind = kind;
      writer.write(r);
    }
    writer.write_module({"layers.0", {{"role", "wrapped"}, {"calls", "1"}}});
    writer.write_module({"layers.1",
                         {{"role", "wrapped"},
                          {"calls", "0"},
                          {"note", "NOT_RUN"},
                          {"reason", "the wrapped module was not called in this step"}}});
    writer.commit();
  }
  const Comparison result = compare(dir.path(), dir.path(), {});
  ASSERT_EQ(result.steps.size(), 1u);
  std::map<std::string, const Row*> rows;
  for (const Row& row : result.steps[0].rows) {
    if (row.module == "layers.1") {
      rows[row.kind ? std::string(formats::kind_name(*row.kind)) : "note"] = &row;
    }
  }
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows["note"]->note, "NOT_RUN");
  EXPECT_EQ(rows["note"]->status, Status::kWarn);
  EXPECT_NE(rows["note"]->reason.find("the compiled model did not call it in this step, but the "
                                      "eager model did (1 call(s))"),
            std::string::npos)
      << rows["note"]->reason;
  EXPECT_EQ(rows["fwd_output"]->note, notes::kMissingFwdInCompiled);
  EXPECT_EQ(rows["grad_input"]->status, Status::kWarn);
  EXPECT_EQ(rows["grad_input"]->note, notes::kMissingBwdInCompiled);
  EXPECT_NE(rows["grad_input"]->reason.find("no gradients"), std::string::npos);
  const std::string text = render_text(result.steps[0]);
  EXPECT_EQ(text.find("SKIP_compiled_wrapper"), std::string::npos) << text;
  const std::string row = "  WARN  " + std::string("layers.1.grad_input").append(32, ' ') +
                          "  MISSING_bwd_in_compiled\n        the compiled model did not run "
                          "this call, so it has no gradients\n";
  EXPECT_NE(text.find(row), std::string::npos) << text;
}

// AOTAutograd returns zeros for a parameter the backward does not reach, where eager autograd
// returns no gradient (DeepSeek-V4's compressor on short sequences): the same gradient, so the
// row passes and says why, whichever side holds it. A non-zero one-sided gradient still warns.
TEST(Engine, AOneSidedGradientOfZerosEqualsTheOtherSidesNone) {
  TempDir dir;
  const float zeros[3] = {0.0f, -0.0f, 0.0f};
  const float nonzero[3] = {0.0f, 1e-30f, 0.0f};
  const std::uint16_t bf16_zeros[2] = {0x0000, 0x8000};
  {
    formats::StepWriter writer(dir.path(), 0, {{"mode", "single_pass"}});
    const auto write = [&](const std::string& module, Side side, std::uint32_t index,
                           formats::TensorView tensor) {
      formats::Record r = record(side, tensor.dtype, tensor.shape, tensor.data);
      r.key.module = module;
      r.key.kind = Kind::kParamGrad;
      r.key.tensor_index = index;
      writer.write(r);
    };
    for (Side side : {Side::kCompiled, Side::kEager}) {  // both sides ran layers.0 and head
      for (const char* module : {"layers.0", "head"}) {
        formats::Record r = record(side, DType::kFloat32, {3}, zeros);
        r.key.module = module;
        writer.write(r);
      }
    }
    write("layers.0", Side::kCompiled, 0, {DType::kFloat32, {3}, zeros});
    write("layers.0", Side::kCompiled, 1, {DType::kBFloat16, {2}, bf16_zeros});
    write("layers.0", Side::kCompiled, 2, {DType::kFloat32, {3}, nonzero});
    write("head", Side::kEager, 0, {DType::kFloat32, {3}, zeros});  // not wrapped
    writer.write_module({"layers.0", {{"role", "wrapped"}, {"calls", "1"}}});
    writer.commit();
  }
  const Comparison result = compare(dir.path(), dir.path(), {});
  ASSERT_EQ(result.steps.size(), 1u);
  std::map<std::string, const Row*> grads;
  for (const Row& row : result.steps[0].rows) {
    if (row.kind == Kind::kParamGrad) {
      grads[row.module + "[" + std::to_string(row.tensor_index) + "]"] = &row;
    }
  }
  ASSERT_EQ(grads.size(), 4u);
  for (const char* key : {"layers.0[0]", "layers.0[1]"}) {
    EXPECT_EQ(grads[key]->status, Status::kPass) << key;
    EXPECT_TRUE(grads[key]->note.empty()) << key;
    EXPECT_EQ(grads[key]->reason, "eager: no gradient; compiled: zeros (the same gradient)");
    ASSERT_TRUE(grads[key]->metrics);
    EXPECT_EQ(grads[key]->metrics->max_abs, 0.0);
  }
  EXPECT_EQ(grads["layers.0[2]"]->status, Status::kWarn);
  EXPECT_EQ(grads["layers.0[2]"]->note, notes::kMissingBwdInEager);
  EXPECT_EQ(grads["head[0]"]->status, Status::kPass);
  EXPECT_EQ(grads["head[0]"]->reason, "compiled: no gradient; eager: zeros (the same gradient)");
  const std::string text = render_text(result.steps[0]);
  EXPECT_NE(
      text.find("shape=(3,)\n        eager: no gradient; compiled: zeros (the same gradient)"),
      std::string::npos)
      << text;
  EXPECT_EQ(result.steps[0].counts().warn, 1u) << text;
}

TEST(Engine, NoteStatusIsATableThatWarnsForEveryNoteItDoesNotKnow) {
  EXPECT_EQ(note_status(notes::kIgnored), Status::kSkip);
  EXPECT_EQ(note_status(notes::kCompiledWrapper), Status::kSkip);
  EXPECT_EQ(note_status(notes::kInsideCompiled), Status::kSkip);
  for (std::string_view warning :
       {notes::kMissingFwdInCompiled, notes::kMissingFwdInEager, notes::kMissingBwdInCompiled,
        notes::kMissingBwdInEager, notes::kNotRun, notes::kNotCompiled, notes::kHookError,
        notes::kNoReference}) {
    EXPECT_EQ(note_status(warning), Status::kWarn) << warning;
  }
  // Spelling is not a verdict: an unknown note warns, even one that starts like a skip.
  EXPECT_EQ(note_status("SKIP_something_new"), Status::kWarn);
  EXPECT_EQ(note_status(""), Status::kWarn);
}

// A single-pass step of one module whose compiled output is off by `compiled_error` everywhere
// and eager's by `eager_error`, against a float32 reference of 1s; bf16-sized errors.
void write_referenced_step(const std::filesystem::path& dir, float eager_error,
                           float compiled_error, formats::Provenance provenance) {
  static std::vector<float> reference(64, 1.0f), eager(64), compiled(64);
  for (std::size_t i = 0; i < 64; ++i) {
    const float sign = i % 2 ? 1.0f : -1.0f;
    eager[i] = 1.0f + sign * eager_error;
    compiled[i] = 1.0f + sign * compiled_error;
  }
  provenance.emplace("mode", "single_pass");
  formats::StepWriter writer(dir, 0, provenance);
  writer.write(record(Side::kEager, DType::kFloat32, {64}, eager.data()));
  writer.write(record(Side::kCompiled, DType::kFloat32, {64}, compiled.data()));
  writer.write(record(Side::kReference, DType::kFloat32, {64}, reference.data()));
  writer.commit();
}

// The reference verdict decides a row that has one: noise beyond the tolerances passes (and is
// counted as such), divergence inside them fails; verdict=tolerances, in the dump or asked for,
// keeps the tolerance check's status.
TEST(Engine, TheReferenceVerdictDecidesTheRowUnlessTheTolerancesAreAskedFor) {
  struct Case {
    float eager_error, compiled_error;
    Status decided, tolerances_only;
    std::string verdict;
  };
  // atol 1e-4, rtol 1e-3: |diff| <= 1.1e-3 passes. Errors of opposite signs differ from each
  // other by twice their size.
  for (const Case& c : {Case{4e-3f, -4e-3f, Status::kPass, Status::kFail, "noise"},
                        Case{1e-5f, 3e-4f, Status::kFail, Status::kPass, "divergence"},
                        Case{2e-4f, 3e-4f, Status::kPass, Status::kPass, "noise"},
                        Case{1e-5f, 5e-3f, Status::kFail, Status::kFail, "divergence"}}) {
    TempDir dir;
    write_referenced_step(dir.path(), c.eager_error, c.compiled_error, {});
    const Comparison decided = compare(dir.path(), dir.path(), {});
    const Row& row = decided.steps[0].rows.at(0);
    SCOPED_TRACE(std::to_string(c.eager_error) + " " + std::to_string(c.compiled_error));
    EXPECT_EQ(row.reference_verdict, c.verdict);
    EXPECT_EQ(row.reference_dtype, "fp32");
    EXPECT_EQ(row.status, c.decided);
    ASSERT_TRUE(row.tolerance_status);
    EXPECT_EQ(*row.tolerance_status, c.tolerances_only);
    EXPECT_EQ(decided.steps[0].counts().noise_pass,
              c.decided == Status::kPass && c.tolerances_only == Status::kFail ? 1u : 0u);

    CompareOptions options;
    options.reference_decides = false;
    const Row& spec = compare(dir.path(), dir.path(), options).steps[0].rows.at(0);
    EXPECT_EQ(spec.status, c.tolerances_only);
    EXPECT_FALSE(spec.tolerance_status);
    EXPECT_EQ(spec.reference_verdict, c.verdict);

    TempDir stored;
    write_referenced_step(stored.path(), c.eager_error, c.compiled_error,
                          {{"verdict", "tolerances"}});
    EXPECT_EQ(compare(stored.path(), stored.path(), {}).steps[0].rows.at(0).status,
              c.tolerances_only);
  }
  // What the reader sees: the verdict, both errors and the tolerances' own outcome.
  TempDir dir;
  write_referenced_step(dir.path(), 4e-3f, -4e-3f, {});
  const std::string text = render_text(compare(dir.path(), dir.path(), {}).steps[0]);
  EXPECT_NE(text.find("[OK] max_abs="), std::string::npos) << text;
  EXPECT_NE(
      text.find("fp32: noise, 1.0x noise (rmse compiled=4.0e-03 eager=4.0e-03; tolerances fail)"),
      std::string::npos)
      << text;
  EXPECT_NE(
      text.find(
          "RESULT: ALL PASS  (1 pass only within reference noise; reference: noise within 2x)"),
      std::string::npos)
      << text;
}

TEST(Engine, NoiseRuleOfNonFiniteErrors) {
  TensorMetrics eager, compiled;
  eager.rmse = 1e-3;
  eager.rms_eager = 1;
  compiled.rmse = NAN;
  EXPECT_TRUE(measure_noise(eager, compiled, 0x1p-8, 0).divergence);
  eager.rmse = INFINITY;  // eager's own NaN/Inf: a finite compiled side cannot be beaten
  compiled.rmse = 1e-3;
  EXPECT_FALSE(measure_noise(eager, compiled, 0x1p-8, 0).divergence);
}

// A row with -inf at the same elements on all three sides (log(0)) is judged on the rest.
TEST(Engine, NoiseRuleOfEqualInfinitiesJudgesTheFiniteElements) {
  const auto metrics = [](const std::vector<float>& a, const std::vector<float>& b) {
    MetricsAccumulator accumulator;
    accumulator.accumulate(a.data(), b.data(), a.size(), 0, Tolerances{});
    return accumulator.result();
  };
  const std::vector<float> reference = {-INFINITY, 1.0f, 2.0f, 3.0f};
  const TensorMetrics eager = metrics(reference, {-INFINITY, 1.001f, 2.0f, 3.0f});
  EXPECT_FALSE(measure_noise(eager, metrics(reference, {-INFINITY, 1.0f, 2.001f, 3.0f}), 0x1p-8, 0)
                   .divergence);
  const NoiseMeasure fault =
      measure_noise(eager, metrics(reference, {-INFINITY, 1.05f, 2.1f, 3.15f}), 0x1p-8, 0);
  EXPECT_TRUE(fault.divergence);
  EXPECT_TRUE(std::isfinite(fault.units));
}

// The rule has no absolute term: the same relative errors give the same verdict and the same
// units at every magnitude (a loss scaled by 1e-8 .. 1e4), where `rmse <= 2 * eager + atol / 10`
// called every error below 1e-5 noise.
TEST(Engine, NoiseRuleIsTheSameAtEveryScale) {
  for (const double scale : {1e-12, 1e-8, 1e-3, 1.0, 1e4}) {
    TensorMetrics eager, compiled;
    eager.rms_eager = compiled.rms_eager = scale;  // the reference's magnitude
    eager.rmse = 4e-3 * scale;                     // eager's own error: one bf16 rounding
    compiled.rmse = 5e-2 * scale;                  // 5%: 12.5x eager's
    const NoiseMeasure fault = measure_noise(eager, compiled, 0x1p-8, 1e-5);
    EXPECT_TRUE(fault.divergence) << scale;
    EXPECT_NEAR(fault.units, 12.5, 1e-9) << scale;
    compiled.rmse = 6e-3 * scale;  // 1.5x: noise
    EXPECT_FALSE(measure_noise(eager, compiled, 0x1p-8, 1e-5).divergence) << scale;
    // Eager exact: the floor is one rounding of bf16 at the reference's magnitude.
    eager.rmse = 0;
    compiled.rmse = 0x1p-8 * scale;
    const NoiseMeasure floor = measure_noise(eager, compiled, 0x1p-8, 1e-5);
    EXPECT_FALSE(floor.divergence) << scale;
    EXPECT_NEAR(floor.units, 1.0, 1e-9) << scale;
  }
}

// Zeros: an all-zero reference that both sides get exactly is noise (0 units); compiled values
// where eager and the reference are exactly zero diverge. A dump from before rms_eager (the
// reference's magnitude not stored) takes the legacy floor.
TEST(Engine, NoiseRuleOfZerosAndOfOldDumps) {
  TensorMetrics eager, compiled;
  NoiseMeasure zeros = measure_noise(eager, compiled, 0x1p-8, 0);
  EXPECT_FALSE(zeros.divergence);
  EXPECT_EQ(zeros.units, 0);
  compiled.rmse = 1e-30;
  EXPECT_TRUE(measure_noise(eager, compiled, 0x1p-8, 0).divergence);
  eager.rms_eager = formats::kMetricNotStored;
  EXPECT_FALSE(measure_noise(eager, compiled, 0x1p-8, 1e-6).divergence);
}

// The fp32 screen: relative to eager's own magnitude, only for float32/float64 rows, and never
// for a tensor whose magnitude is zero or unknown.
TEST(Engine, RelativeScreenIsForFloat32RowsAndScaleFree) {
  using formats::DType;
  EXPECT_NEAR(relative_screen(DType::kFloat32, DType::kFloat32), 0x1p-12, 0);
  EXPECT_TRUE(std::isnan(relative_screen(DType::kBFloat16, DType::kFloat32)));
  EXPECT_TRUE(std::isnan(relative_screen(DType::kInt64, DType::kInt64)));
  TensorMetrics metrics;
  EXPECT_TRUE(std::isnan(relative_error(metrics)));  // all zeros
  metrics.rms_eager = formats::kMetricNotStored;
  EXPECT_TRUE(std::isnan(relative_error(metrics)));
  for (const double scale : {1e-9, 1.0, 1e4}) {
    metrics.rms_eager = scale;
    metrics.rmse = 1e-2 * scale;
    EXPECT_NEAR(relative_error(metrics), 1e-2, 1e-12) << scale;
  }
}

// Calls that got no reference (reference_missing, reference_error) are a WARN row naming why,
// counted in the RESULT line: never a silent absence.
TEST(Engine, CallsWithoutTheirReferenceAreAWarnRowThatSaysWhy) {
  TempDir dir;
  {
    static const float values[4] = {1, 2, 3, 4};
    formats::StepWriter writer(dir.path(), 0, {{"mode", "single_pass"}});
    writer.write(record(Side::kEager, DType::kFloat32, {4}, values));
    writer.write(record(Side::kCompiled, DType::kFloat32, {4}, values));
    writer.write_module({"layers.0",
                         {{"role", "wrapped"},
                          {"reference_missing", "3"},
                          {"reference_error", "NotImplementedError: no float32 kernel"}}});
    writer.commit();
  }
  const StepReport step = compare(dir.path(), dir.path(), {}).steps[0];
  const auto note = std::find_if(step.rows.begin(), step.rows.end(),
                                 [](const Row& r) { return r.note == notes::kNoReference; });
  ASSERT_NE(note, step.rows.end());
  EXPECT_EQ(note->status, Status::kWarn);
  EXPECT_NE(note->reason.find("3 call(s) without a reference"), std::string::npos);
  EXPECT_NE(note->reason.find("no float32 kernel"), std::string::npos);
  EXPECT_EQ(step.counts().no_reference_calls, 3u);
  EXPECT_FALSE(step.all_pass());
  const std::string text = render_text(step);
  EXPECT_NE(text.find("0 FAIL, 1 WARN, 3 call(s) without a reference; atol="), std::string::npos)
      << text;
}

}  // namespace
}  // namespace dynaprobe::analyze
