// The op localisations beside a dump (dynaprobe bisect --ops): a step's report names the first op
// of each aten graph that fails, in text, JSON and HTML, and an ops dump that cannot be read is
// said in the report, never taking it down.
#include "ops_dumps.h"

#include <gtest/gtest.h>

#include <sstream>

#include "dynaprobe/analyze/report.h"
#include "dynaprobe/analyze/report_model.h"
#include "dynaprobe/formats/writer.h"
#include "formats/test_util.h"

namespace dynaprobe::analyze {
namespace {

namespace fs = std::filesystem;
using formats::DType;
using formats::Kind;
using formats::Side;
using formats::testing::TempDir;

// 1.0625 - 1 is exact in float32: the failing ops' max_abs.
constexpr float kError = 0.0625f;
const std::string kSource = "/src/models.py:162  norm = x * torch.rsqrt(x.pow(2).mean(-1))";

struct Op {
  std::string graph, node, op;
  bool fails;
};

// A single-pass step of `module`: its output, off by kError on the compiled side.
void write_step(const fs::path& dir, const std::string& module, std::int64_t step,
                formats::Provenance provenance = {}) {
  static const std::vector<float> eager(8, 1.0f), compiled(8, 1.0f + kError);
  provenance.emplace("mode", "single_pass");
  formats::StepWriter writer(dir, step, provenance);
  for (const auto& [side, values] :
       {std::pair{Side::kEager, &eager}, {Side::kCompiled, &compiled}}) {
    formats::Record record;
    record.key = {step, module, 0, Kind::kFwdOutput, 0, side};
    record.tensor = {DType::kFloat32, {8}, values->data()};
    writer.write(record);
  }
  writer.commit();
}

// An ops dump as bisect --ops writes it: one fwd_output per op on eager, compiled and reference,
// the op's attributes, the provenance naming the localised call.
void write_ops_dump(const fs::path& dir, std::int64_t step, const std::vector<Op>& ops,
                    const std::string& source = kSource) {
  static const std::vector<float> exact(8, 1.0f), off(8, 1.0f + kError);
  formats::StepWriter writer(dir, step,
                             {{"mode", "single_pass"},
                              {"producer", "dynaprobe bisect --ops"},
                              {"ops_module", "layers.0"},
                              {"ops_call", "1"},
                              {"ops_backend", "aot_eager"}});
  for (const Op& op : ops) {
    const std::string module = op.graph + "." + op.node;
    for (const auto& [side, values] : {std::pair{Side::kEager, &exact},
                                       {Side::kCompiled, op.fails ? &off : &exact},
                                       {Side::kReference, &exact}}) {
      formats::Record record;
      record.key = {step, module, 0, Kind::kFwdOutput, 0, side};
      record.tensor = {DType::kFloat32, {8}, values->data()};
      writer.write(record);
    }
    writer.write_module({module, {{"op", op.op}, {"graph", op.graph}, {"source", source}}});
  }
  writer.commit();
}

const std::vector<Op> kOps = {{"forward", "pow_1", "aten.pow.Tensor_Scalar", false},
                              {"forward", "rsqrt", "aten.rsqrt.default", true},
                              {"forward", "mul", "aten.mul.Tensor", true},
                              {"backward", "mul_3", "aten.mul.Tensor", false}};

// The step's text from its OPS section on.
std::string ops_section(const std::string& text) {
  const std::size_t at = text.find("\n  OPS  ");
  return at == std::string::npos ? "" : text.substr(at);
}

TEST(OpsDumps, TheStepNamesTheFirstFailingOpOfEachGraph) {
  TempDir dir;
  const fs::path dump = dir.path() / "rank0";
  write_step(dump, "layers.0", 0);
  const fs::path ops = dump / "ops" / "layers.0.call1.step0";
  write_ops_dump(ops, 0, kOps);
  const Comparison result = compare(dump, dump, {});
  ASSERT_EQ(result.steps.at(0).ops.size(), 1u);
  const OpsDump& found = result.steps[0].ops[0];
  EXPECT_EQ(found.module, "layers.0");
  EXPECT_EQ(found.call, 1u);
  EXPECT_EQ(found.backend, "aot_eager");
  EXPECT_EQ(found.dump, ops);
  EXPECT_EQ(found.error, "");
  ASSERT_EQ(found.graphs.size(), 2u);
  const OpsGraph& forward = found.graphs[0];
  EXPECT_EQ(forward.graph, "forward");
  EXPECT_EQ(forward.ops, 3u);
  EXPECT_EQ(forward.failing, 2u);
  ASSERT_TRUE(forward.first_failing);
  EXPECT_EQ(forward.first_failing->node, "rsqrt");
  EXPECT_EQ(forward.first_failing->op, "aten.rsqrt.default");
  EXPECT_EQ(forward.first_failing->source, kSource);
  EXPECT_EQ(forward.first_failing->max_abs, kError);
  EXPECT_EQ(forward.first_failing->mean_abs, kError);
  EXPECT_EQ(found.graphs[1].graph, "backward");
  EXPECT_EQ(found.graphs[1].ops, 1u);
  EXPECT_EQ(found.graphs[1].failing, 0u);
  EXPECT_FALSE(found.graphs[1].first_failing);

  const std::string text = render_text(result.steps[0]);
  EXPECT_EQ(ops_section(text),
            "\n  OPS  layers.0 call 1 (aot_eager)\n"
            "  --------------------------------------------------------------------\n"
            "  forward   first op that fails: rsqrt (aten.rsqrt.default)  max_abs=6.250e-02  "
            "(2 of 3 ops fail)\n"
            "            at " +
                kSource +
                "\n"
                "  backward  no op fails beyond fp64 noise (1 op)\n"
                "  every op  dynaprobe compare " +
                ops.string() + "\n")
      << text;

  const std::string json = render_json({RankComparison{0, "", result}});
  for (const std::string& expected :
       {"\"ops\": [\n            {\"module\": \"layers.0\", \"call\": 1, \"backend\": "
        "\"aot_eager\", \"dump\": \"" +
            ops.string() + "\", \"error\": null, \"graphs\": [",
        "{\"graph\": \"forward\", \"first_failing\": {\"node\": \"rsqrt\", \"op\": "
        "\"aten.rsqrt.default\", \"source\": \"" +
            kSource +
            "\", \"max_abs\": 0.0625, \"mean_abs\": 0.0625, \"status\": \"FAIL\"}, "
            "\"ops\": 3, \"failing\": 2}",
        std::string("{\"graph\": \"backward\", \"first_failing\": null, \"ops\": 1, "
                    "\"failing\": 0}]}]")}) {
    EXPECT_NE(json.find(expected), std::string::npos) << expected << "\n" << json;
  }
  // The HTML report carries the same model (its page draws an "Ops" section from it).
  EXPECT_NE(render_html({RankComparison{0, "", result}}).find("function renderOps()"),
            std::string::npos);
}

// Without ops dumps of the step, the report is what it was: the spec's layout, nothing added; and
// read_ops off leaves them unread.
TEST(OpsDumps, OtherStepsModulesAndReadOpsOffAddNothing) {
  TempDir dir;
  const fs::path dump = dir.path() / "rank0";
  write_step(dump, "layers.0", 0);
  const std::string plain = render_text(compare(dump, dump, {}).steps.at(0));
  EXPECT_EQ(plain.find("OPS"), std::string::npos);
  write_ops_dump(dump / "ops" / "layers.0.call1.step1", 1, kOps);  // another step's
  fs::create_directories(dump / "ops" / "not an ops dump");
  EXPECT_EQ(render_text(compare(dump, dump, {}).steps.at(0)), plain);

  write_ops_dump(dump / "ops" / "layers.0.call1.step0", 0, kOps);
  CompareOptions unread;
  unread.read_ops = false;
  EXPECT_EQ(render_text(compare(dump, dump, unread).steps.at(0)), plain);
  CompareOptions other_module;
  other_module.module_glob = "layers.*";
  EXPECT_EQ(compare(dump, dump, other_module).steps.at(0).ops.size(), 1u);
  write_step(dir.path() / "two", "head", 0);
  write_ops_dump(dir.path() / "two" / "ops" / "layers.0.call1.step0", 0, kOps);
  CompareOptions head;
  head.module_glob = "head";  // the ops dump is of layers.0
  EXPECT_TRUE(compare(dir.path() / "two", dir.path() / "two", head).steps.at(0).ops.empty());
  // A step file given for the dump finds the ops beside it.
  const auto files = formats::list_dump(dump).steps;
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(compare(files[0], files[0], {}).steps.at(0).ops.size(), 1u);
}

// A damaged ops dump is said in the report, which is otherwise whole.
TEST(OpsDumps, AnUnreadableOpsDumpIsSaidAndTheReportStands) {
  TempDir dir;
  const fs::path dump = dir.path() / "rank0";
  write_step(dump, "layers.0", 0);
  const fs::path ops = dump / "ops" / "layers.0.call1.step0";
  fs::create_directories(ops);
  formats::testing::write_file(ops / "step_00000000.h5", "not an HDF5 file");
  const Comparison result = compare(dump, dump, {});
  const StepReport& step = result.steps.at(0);
  ASSERT_EQ(step.ops.size(), 1u);
  EXPECT_NE(step.ops[0].error, "");
  EXPECT_EQ(step.ops[0].module, "layers.0");  // the folder's name
  EXPECT_EQ(step.ops[0].call, 1u);
  EXPECT_EQ(step.rows.size(), 1u);
  const std::string text = render_text(step);
  const std::string section = ops_section(text);
  EXPECT_EQ(section.rfind("\n  OPS  layers.0 call 1\n", 0), 0u) << text;
  EXPECT_NE(section.find("  ops dump " + ops.string() + " unreadable:"), std::string::npos) << text;
  EXPECT_EQ(section.find("every op"), std::string::npos);
  EXPECT_NE(render_json({RankComparison{0, "", result}}).find("\"error\": \""), std::string::npos);
}

// Every line the OPS section adds fits a 120-column terminal: a long source line wraps under the
// finding, as a row's details do.
TEST(OpsDumps, OpsLinesFitATerminal) {
  TempDir dir;
  const fs::path dump = dir.path() / "rank0";
  write_step(dump, "layers.0", 0);
  const std::string source =
      "/a/rather/long/path/to/the/model/source/of/a/transformers/family/"
      "modeling_llama.py:1234  hidden_states = hidden_states * "
      "torch.rsqrt(variance + self.variance_epsilon)";
  write_ops_dump(dump / "ops" / "layers.0.call1.step0", 0, kOps, source);
  const std::string section = ops_section(render_text(compare(dump, dump, {}).steps.at(0)));
  ASSERT_NE(section, "");
  std::istringstream lines(section);
  std::string joined;
  for (std::string line; std::getline(lines, line);) {
    EXPECT_LE(line.size(), 120u) << line;
    if (line.starts_with("            ")) joined += " " + line.substr(12);
  }
  EXPECT_NE(section.find("hidden_states"), std::string::npos);
  EXPECT_NE(joined.find("variance + self.variance_epsilon)"), std::string::npos) << section;
}

}  // namespace
}  // namespace dynaprobe::analyze
