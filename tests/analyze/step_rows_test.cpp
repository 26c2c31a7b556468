// The phases of a step's rows (analyze/src/step_rows.h), called directly: the verdict table for
// tensors one side lacks (MISSING_*, SKIP_*), module notes and their statuses, module roles,
// the calls each side ran, the provenance header and pairing records read from a step file.
#include "step_rows.h"

#include <gtest/gtest.h>

#include <vector>

#include "dynaprobe/formats/writer.h"
#include "formats/test_util.h"

namespace dynaprobe::analyze {
namespace {

using formats::Kind;
using formats::Side;
using formats::testing::TempDir;

constexpr Kind kForwardKinds[] = {Kind::kFwdInput, Kind::kFwdOutput};
constexpr Kind kBackwardKinds[] = {Kind::kGradInput, Kind::kGradOutput, Kind::kParamGrad};

// The reasons of a tensor missing on one side when nothing more specific is known.
constexpr std::string_view kForwardMissingInEager =
    "the eager run recorded no such tensor: it called the module fewer times, or the module took "
    "or returned fewer tensors there";
constexpr std::string_view kForwardMissingInCompiled =
    "the compiled run recorded no such tensor: it called the module fewer times, or the module "
    "took or returned fewer tensors there";
constexpr std::string_view kBackwardMissingInEager =
    "no gradient reached it in the eager backward: the eager run took another path";
constexpr std::string_view kBackwardMissingInCompiled =
    "no gradient reached it in the compiled backward: the compiled run took another path";

// Every case of one_sided_verdict's table, with its status as the report prints it.
struct VerdictCase {
  OneSidedCase row;
  Status status;
  std::string_view note;
  std::string_view reason;
};

void expect_verdict(const VerdictCase& expected) {
  const OneSidedCase& row = expected.row;
  SCOPED_TRACE(std::string(formats::side_name(row.held)) + " " +
               std::string(formats::kind_name(row.kind)) +
               " wrapped=" + std::to_string(row.wrapped) +
               " inside_wrapped=" + std::to_string(row.inside_wrapped) +
               " compiled_ran=" + std::to_string(row.compiled_ran));
  const Verdict verdict = one_sided_verdict(row);
  EXPECT_EQ(verdict.note, expected.note);
  EXPECT_EQ(verdict.status, expected.status);
  EXPECT_EQ(verdict.reason, expected.reason);
}

// A tensor only the compiled side holds is missing eagerly, wherever its module is.
TEST(VerdictTable, CompiledOnlyTensorIsMissingInEager) {
  for (bool wrapped : {false, true}) {
    for (bool inside : {false, true}) {
      for (bool ran : {false, true}) {
        for (Kind kind : kForwardKinds) {
          expect_verdict({{Side::kCompiled, kind, wrapped, inside, ran},
                          Status::kWarn,
                          notes::kMissingFwdInEager,
                          kForwardMissingInEager});
        }
        for (Kind kind : kBackwardKinds) {
          expect_verdict({{Side::kCompiled, kind, wrapped, inside, ran},
                          Status::kWarn,
                          notes::kMissingBwdInEager,
                          kBackwardMissingInEager});
        }
      }
    }
  }
}

// Eager-only forwards: inside a compiled module Dynamo traced them away (SKIP), elsewhere the
// compiled side lacks them (WARN); a wrapped call the compiled model did not run says so.
TEST(VerdictTable, EagerOnlyForwardIsSkippedInsideCompiledElseMissing) {
  for (Kind kind : kForwardKinds) {
    for (bool ran : {false, true}) {
      expect_verdict({{Side::kEager, kind, false, false, ran},
                      Status::kWarn,
                      notes::kMissingFwdInCompiled,
                      kForwardMissingInCompiled});
      expect_verdict(
          {{Side::kEager, kind, false, true, ran}, Status::kSkip, notes::kInsideCompiled, ""});
    }
    expect_verdict({{Side::kEager, kind, true, false, true},
                    Status::kWarn,
                    notes::kMissingFwdInCompiled,
                    kForwardMissingInCompiled});
    expect_verdict({{Side::kEager, kind, true, false, false},
                    Status::kWarn,
                    notes::kMissingFwdInCompiled,
                    "the compiled model did not run this call"});
    // A wrapped module nested in another: inside the compiled one, and its call did not run.
    expect_verdict({{Side::kEager, kind, true, true, false},
                    Status::kSkip,
                    notes::kInsideCompiled,
                    "the compiled model did not run this call"});
  }
}

// Eager-only gradients: a compiled wrapper's hooks do not align with eager's (SKIP) unless the
// compiled model did not run the call at all (WARN, no gradients); inside a compiled module they
// are traced away (SKIP); elsewhere missing (WARN).
TEST(VerdictTable, EagerOnlyGradientOfAWrapperIsSkippedUnlessTheCallDidNotRun) {
  for (Kind kind : kBackwardKinds) {
    for (bool inside : {false, true}) {
      expect_verdict(
          {{Side::kEager, kind, true, inside, true}, Status::kSkip, notes::kCompiledWrapper, ""});
      expect_verdict({{Side::kEager, kind, true, inside, false},
                      Status::kWarn,
                      notes::kMissingBwdInCompiled,
                      "the compiled model did not run this call, so it has no gradients"});
    }
    for (bool ran : {false, true}) {
      expect_verdict(
          {{Side::kEager, kind, false, true, ran}, Status::kSkip, notes::kInsideCompiled, ""});
      expect_verdict({{Side::kEager, kind, false, false, ran},
                      Status::kWarn,
                      notes::kMissingBwdInCompiled,
                      kBackwardMissingInCompiled});
    }
  }
}

TEST(ModuleNoteRow, ModuleWithoutANoteHasNoRow) {
  EXPECT_FALSE(module_note_row("m", {}, false, 0));
  EXPECT_FALSE(module_note_row("m", {{"role", "wrapped"}, {"reason", "r"}}, false, 0));
  EXPECT_FALSE(module_note_row("m", {{"note", ""}}, false, 0));
}

// The note's status comes from note_status(): the spec's SKIP markers skip, every other note
// (capture notes and ones this version does not know) warns.
TEST(ModuleNoteRow, StatusComesFromTheNoteTable) {
  const std::pair<std::string_view, Status> cases[] = {
      {notes::kInsideCompiled, Status::kSkip}, {notes::kCompiledWrapper, Status::kSkip},
      {notes::kIgnored, Status::kSkip},        {notes::kNotCompiled, Status::kWarn},
      {notes::kHookError, Status::kWarn},      {notes::kNotRun, Status::kWarn},
      {"SKIP_from_the_future", Status::kWarn},
  };
  for (const auto& [note, status] : cases) {
    const auto row =
        module_note_row("layers.0", {{"note", std::string(note)}, {"reason", "why"}}, false, 0);
    ASSERT_TRUE(row) << note;
    EXPECT_EQ(row->module, "layers.0");
    EXPECT_EQ(row->note, note);
    EXPECT_EQ(row->status, status) << note;
    EXPECT_EQ(row->reason, "why");
    EXPECT_FALSE(row->kind);
  }
}

// The capture counts compiled calls only: two-pass, a NOT_RUN module that ran eagerly gets a
// reason saying the two copies took different paths. Single-pass runs both sides in one call.
TEST(ModuleNoteRow, NotRunModuleThatRanEagerlySaysTheCopiesTookDifferentPaths) {
  const std::map<std::string, std::string> attributes = {{"note", "NOT_RUN"},
                                                         {"reason", "not called"}};
  const auto two_pass = module_note_row("m", attributes, false, 2);
  ASSERT_TRUE(two_pass);
  EXPECT_EQ(two_pass->status, Status::kWarn);
  EXPECT_EQ(two_pass->reason.find("the compiled model did not call it in this step, but the eager "
                                  "model did (2 call(s)): the two copies took different paths"),
            0u)
      << two_pass->reason;
  EXPECT_EQ(module_note_row("m", attributes, false, 0)->reason, "not called");
  EXPECT_EQ(module_note_row("m", attributes, true, 2)->reason, "not called");
  EXPECT_EQ(module_note_row("m", {{"note", "NOT_COMPILED"}, {"reason", "r"}}, false, 2)->reason,
            "r");
}

TEST(ModuleNoteRow, IgnoredModuleIsASkip) {
  const Row row = ignored_row("head");
  EXPECT_EQ(row.module, "head");
  EXPECT_EQ(row.note, notes::kIgnored);
  EXPECT_EQ(row.status, Status::kSkip);
  EXPECT_FALSE(row.kind);
}

// Roles come from the "role" attribute; "under" means a submodule path, not a name prefix.
TEST(ModuleRoles, SubmodulesAreMatchedByPathNotByNamePrefix) {
  const ModuleRoles roles({{"layers.1", {{"role", "wrapped"}}},
                           {"layers.1.mlp", {{"role", "wrapped"}}},
                           {"head", {{"role", "ignored"}}},
                           {"embed", {{"note", "NOT_RUN"}}}});
  EXPECT_TRUE(roles.wrapped("layers.1"));
  EXPECT_FALSE(roles.inside_wrapped("layers.1"));
  EXPECT_TRUE(roles.wrapped("layers.1.mlp"));
  EXPECT_TRUE(roles.inside_wrapped("layers.1.mlp"));
  EXPECT_TRUE(roles.inside_wrapped("layers.1.attn.q"));
  EXPECT_FALSE(roles.wrapped("layers.10"));
  EXPECT_FALSE(roles.inside_wrapped("layers.10"));
  EXPECT_FALSE(roles.wrapped("embed"));

  EXPECT_TRUE(roles.ignored("head"));
  EXPECT_TRUE(roles.ignored_or_under("head"));
  EXPECT_FALSE(roles.ignored("head.proj"));
  EXPECT_TRUE(roles.ignored_or_under("head.proj"));
  EXPECT_FALSE(roles.ignored_or_under("header"));
  EXPECT_FALSE(roles.ignored_or_under("layers.1"));
}

// Which calls ran is read from forward records only: gradients say nothing about it.
TEST(CallsRun, ForwardRecordsTellWhichCallsEachSideRan) {
  const formats::RecordInfo record;
  Pairs pairs;
  pairs[{"a", 0, Kind::kFwdOutput, 0}] = {&record, &record, nullptr};
  pairs[{"a", 1, Kind::kFwdInput, 0}] = {&record, nullptr, nullptr};
  pairs[{"a", 2, Kind::kGradInput, 0}] = {&record, &record, nullptr};
  pairs[{"b", 0, Kind::kFwdOutput, 0}] = {nullptr, &record, nullptr};
  const CallsRun run = calls_run(pairs);
  EXPECT_TRUE(run.compiled_ran("a", 0, false));
  EXPECT_FALSE(run.compiled_ran("a", 1, false));
  EXPECT_FALSE(run.compiled_ran("a", 2, false));
  EXPECT_TRUE(run.compiled_ran("a", 2, true));  // single-pass: every call ran on both sides
  EXPECT_TRUE(run.compiled_ran("b", 0, false));
  EXPECT_EQ(run.eager_calls("a"), 2u);
  EXPECT_EQ(run.eager_calls("b"), 0u);
  EXPECT_EQ(run.eager_calls("c"), 0u);
}

TEST(StepHeader, ProvenanceSetsModeCaptureInputAndCast) {
  StepReport defaults;
  apply_provenance({}, defaults);
  EXPECT_FALSE(defaults.single_pass);
  EXPECT_TRUE(defaults.capture_input);
  EXPECT_EQ(defaults.cast_dtype, "");

  StepReport report;
  apply_provenance({{"mode", "single_pass"}, {"capture_input", "false"}, {"cast_dtype", "None"}},
                   report);
  EXPECT_TRUE(report.single_pass);
  EXPECT_FALSE(report.capture_input);
  EXPECT_EQ(report.cast_dtype, "");
  apply_provenance({{"mode", "two_pass"}, {"cast_dtype", "torch.bfloat16"}}, report);
  EXPECT_FALSE(report.single_pass);
  EXPECT_TRUE(report.capture_input);
  EXPECT_EQ(report.cast_dtype, "torch.bfloat16");
}

// Single-pass records a module's inputs and the gradient it receives once, for both sides.
TEST(ComparedPair, SinglePassInputsAndReceivedGradientsStandForBothSides) {
  const formats::RecordInfo one;
  for (Kind kind : {Kind::kFwdInput, Kind::kGradOutput}) {
    const Pair pair = compared_pair({"m", 0, kind, 0}, {nullptr, &one, nullptr}, true);
    EXPECT_EQ(pair.eager, &one);
    EXPECT_EQ(pair.compiled, &one);
    EXPECT_EQ(compared_pair({"m", 0, kind, 0}, {&one, nullptr, nullptr}, true).compiled, &one);
    EXPECT_EQ(compared_pair({"m", 0, kind, 0}, {nullptr, &one, nullptr}, false).eager, nullptr);
  }
  for (Kind kind : {Kind::kFwdOutput, Kind::kGradInput, Kind::kParamGrad}) {
    EXPECT_EQ(compared_pair({"m", 0, kind, 0}, {nullptr, &one, nullptr}, true).eager, nullptr);
  }
}

formats::Record record(const std::string& module, Kind kind, Side side, const float* data,
                       std::string label = "") {
  formats::Record r;
  r.key = {0, module, 0, kind, 0, side};
  r.label = std::move(label);
  r.tensor = {formats::DType::kFloat32, {2}, data};
  return r;
}

// Records read back from a step file pair by (module, call, kind, tensor index); the reference
// joins its pair, the loss is left to the LOSS check, and modules come in execution order.
TEST(PairRecords, RecordsOfAStepFilePairByKeyInExecutionOrder) {
  const float values[2] = {1, 2};
  TempDir dir;
  {
    formats::StepWriter writer(dir.path(), 0, {{"mode", "single_pass"}});
    writer.write(record("b", Kind::kFwdOutput, Side::kCompiled, values, "out"));
    writer.write(record("b", Kind::kFwdOutput, Side::kEager, values));
    writer.write(record("b", Kind::kFwdOutput, Side::kReference, values));
    writer.write(record("a", Kind::kGradInput, Side::kEager, values, "x"));
    writer.write(record(std::string(formats::kLossModule), Kind::kLoss, Side::kCompiled, values));
    writer.write_module({"c", {{"role", "wrapped"}, {"note", "NOT_RUN"}}});
    writer.write_module({"b", {{"role", "wrapped"}}});
    writer.commit();
  }
  const formats::StepReader reader(dir.path() / formats::step_file_name(0));
  const ModuleAttributes modules = merge_module_attributes(&reader, &reader);
  EXPECT_EQ(modules.at("c").at("note"), "NOT_RUN");
  ModuleOrder order;
  const Pairs pairs = pair_records(&reader, &reader, order);
  // Execution order: the compiled side's records first, then the eager side's ...
  EXPECT_EQ(order.modules(), (std::vector<std::string>{"b", "a"}));
  // ... and a listed module without a record after the one before it in model order (c is
  // listed first).
  add_listed_modules(&reader, &reader, order);
  EXPECT_EQ(order.modules(), (std::vector<std::string>{"c", "b", "a"}));

  ASSERT_EQ(pairs.size(), 2u);

  const TensorKey b_key{"b", 0, Kind::kFwdOutput, 0};
  const Pair& b = pairs.at(b_key);
  ASSERT_TRUE(b.eager && b.compiled && b.reference);
  EXPECT_EQ(b.eager->key.side, Side::kEager);
  EXPECT_EQ(b.compiled->key.side, Side::kCompiled);
  EXPECT_EQ(b.reference->key.side, Side::kReference);
  const Row b_row = tensor_row(b_key, b, &reader, &reader);
  EXPECT_EQ(b_row.module, "b");
  EXPECT_EQ(b_row.kind, Kind::kFwdOutput);
  EXPECT_EQ(b_row.sequence, 0u);  // the compiled record's place
  EXPECT_EQ(b_row.label, "out");  // the compiled label when eager has none
  EXPECT_FALSE(b_row.shape_mismatch());

  const TensorKey a_key{"a", 0, Kind::kGradInput, 0};
  const Pair& a = pairs.at(a_key);
  EXPECT_TRUE(a.eager && !a.compiled && !a.reference);
  const Row a_row = tensor_row(a_key, a, &reader, &reader);
  EXPECT_EQ(a_row.sequence, 3u);
  EXPECT_EQ(a_row.label, "x");
  EXPECT_TRUE(a_row.eager && !a_row.compiled);
}

// A module without a record keeps its neighbour of the model's order, wherever that ran.
TEST(ModuleOrder, AModuleWithoutARecordFollowsTheOneBeforeItInModelOrder) {
  ModuleOrder order;
  for (const char* ran : {"down", "mid", "up"}) order.add(ran);
  order.place_listed({"down", "ignored", "up", "spare", "mid"});
  EXPECT_EQ(order.modules(), (std::vector<std::string>{"down", "ignored", "mid", "up", "spare"}));
}

// The eager side's /modules value wins where both sides have a key; keys of either are kept.
TEST(MergeModuleAttributes, EagerValueWinsAndBothSidesKeysAreKept) {
  const float values[2] = {1, 2};
  TempDir dir;
  for (const auto& [name, side] :
       {std::pair{"eager", Side::kEager}, {"compiled", Side::kCompiled}}) {
    formats::StepWriter writer(dir.path() / name, 0, {{"mode", "two_pass"}});
    writer.write(record("m", Kind::kFwdOutput, side, values));
    writer.write_module({"m", {{"role", "wrapped"}, {"calls", std::string(name)}}});
    if (side == Side::kCompiled) writer.write_module({"n", {{"graph_breaks", "1"}}});
    writer.commit();
  }
  const formats::StepReader eager(dir.path() / "eager" / formats::step_file_name(0));
  const formats::StepReader compiled(dir.path() / "compiled" / formats::step_file_name(0));
  const ModuleAttributes modules = merge_module_attributes(&eager, &compiled);
  EXPECT_EQ(modules.at("m").at("calls"), "eager");
  EXPECT_EQ(modules.at("n").at("graph_breaks"), "1");
  ModuleOrder order;
  add_listed_modules(&eager, &compiled, order);
  EXPECT_EQ(order.modules(), (std::vector<std::string>{"m", "n"}));
  EXPECT_EQ(merge_module_attributes(nullptr, &compiled).at("m").at("calls"), "compiled");
}

}  // namespace
}  // namespace dynaprobe::analyze
