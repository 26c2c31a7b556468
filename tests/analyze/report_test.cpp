// The spec's report examples (报告说明, CSV 报告格式), byte for byte.
//
// The spec's single-rank numbers (e.g. max_abs=2.300e-07 with max_rel=5.100e-06) cannot come from
// float32 data: an element whose relative error stays below 5.1e-6 has |a| >= 0.045, where float32
// differences are multiples of 2^-28 and never round to 2.300e-07. So these goldens render a
// report holding the spec's numbers; tests/python/test_analyze_runs.py reproduces the spec's
// multi-rank example from real dumps.
#include "dynaprobe/analyze/report.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <cmath>
#include <cstring>

#include "dynaprobe/analyze/root_cause.h"
#include "dynaprobe/formats/error.h"

namespace dynaprobe::analyze {
namespace {

using formats::Kind;

Row tensor_row(const std::string& module, Kind kind, double max_abs, double mean_abs,
               double max_rel) {
  Row row;
  row.module = module;
  row.kind = kind;
  row.status = Status::kPass;
  row.eager = TensorSide{formats::DType::kFloat32, {2, 128, 4096}};
  row.compiled = row.eager;
  TensorMetrics metrics;
  metrics.max_abs = max_abs;
  metrics.mean_abs = mean_abs;
  metrics.max_rel = max_rel;
  row.metrics = metrics;
  return row;
}

StepReport spec_example() {
  StepReport report;
  report.loss_eager = 6.912340;
  report.loss_compiled = 6.9123412;
  report.rows.push_back(tensor_row("layers.0", Kind::kFwdInput, 0, 0, 0));
  report.rows.push_back(tensor_row("layers.0", Kind::kFwdOutput, 2.3e-07, 1.2e-08, 5.1e-06));
  report.rows.push_back(tensor_row("layers.0", Kind::kGradInput, 1.1e-07, 9.0e-09, 4.2e-06));
  return report;
}

TEST(Report, StdoutIsTheSpecExample) {
  StepReport report = spec_example();
  report.rows.push_back(tensor_row("layers.0", Kind::kGradOutput, 0, 0, 0));
  const std::string expected =
      "========================================================================\n"
      "  Loss  eager=6.912340  compiled=6.912341  diff=1.200e-06\n"
      "========================================================================\n"
      "\n"
      "  FORWARD INPUT\n"
      "  --------------------------------------------------------------------\n"
      "  pass  layers.0                                             [OK] max_abs=0.000e+00  "
      "mean_abs=0.000e+00  max_rel=0.000e+00  shape=(2, 128, 4096)\n"
      "\n"
      "  FORWARD OUTPUT\n"
      "  --------------------------------------------------------------------\n"
      "  pass  layers.0                                             [OK] max_abs=2.300e-07  "
      "mean_abs=1.200e-08  max_rel=5.100e-06  shape=(2, 128, 4096)\n"
      "\n"
      "  BACKWARD\n"
      "  --------------------------------------------------------------------\n"
      "  pass  layers.0.grad_input                                  [OK] max_abs=1.100e-07  "
      "mean_abs=9.000e-09  max_rel=4.200e-06  shape=(2, 128, 4096)\n"
      "  pass  layers.0.grad_output                                 [OK] max_abs=0.000e+00  "
      "mean_abs=0.000e+00  max_rel=0.000e+00  shape=(2, 128, 4096)\n"
      "\n"
      "========================================================================\n"
      "  RESULT: ALL PASS  (atol=1e-4 rtol=1e-3)\n"
      "========================================================================\n";
  EXPECT_EQ(render_text(report), expected);
}

TEST(Report, CsvIsTheSpecExample) {
  StepReport report = spec_example();
  Row ignored;
  ignored.module = "layers.1";
  ignored.status = Status::kSkip;
  ignored.note = "IGNORED";
  report.rows.push_back(ignored);
  const std::string expected =
      "module_name,check_type,tensor_index,status,max_abs_diff,mean_abs_diff,max_rel_diff,shape,"
      "note\n"
      "LOSS,loss,0,PASS,1.200000e-06,N/A,N/A,eager=6.912340 compiled=6.912341,\n"
      "layers.0,fwd_input,0,PASS,0.000000e+00,0.000000e+00,0.000000e+00,\"(2, 128, 4096)\",\n"
      "layers.0,fwd_output,0,PASS,2.300000e-07,1.200000e-08,5.100000e-06,\"(2, 128, 4096)\",\n"
      "layers.0,grad_input,0,PASS,1.100000e-07,9.000000e-09,4.200000e-06,\"(2, 128, 4096)\",\n"
      "layers.1,note,0,SKIP,,,,,IGNORED\n";
  EXPECT_EQ(render_csv({report}), expected);
}

// The Loss line says why eager is nan where the reader sees it; the spec's two-pass line
// (StdoutIsTheSpecExample) stays as it is.
TEST(Report, SinglePassLossLineSaysWhyEagerIsNanAndLossRowIsCompiledOnly) {
  StepReport report;
  report.single_pass = true;
  report.loss_compiled = 0.333408;
  const std::string text = render_text(report);
  EXPECT_NE(text.find("\n  Loss  eager=nan  compiled=0.333408  diff=nan  (single-pass: no "
                      "whole-model eager run)\n"),
            std::string::npos)
      << text;
  report.cast_dtype = "torch.bfloat16";
  EXPECT_NE(render_text(report).find("  diff=nan  cast_dtype=torch.bfloat16  (single-pass: no "
                                     "whole-model eager run)\n"),
            std::string::npos);
  EXPECT_EQ(render_csv({report}),
            "module_name,check_type,tensor_index,status,max_abs_diff,mean_abs_diff,max_rel_diff,"
            "shape,note\n"
            "LOSS,loss,0,PASS,N/A,N/A,N/A,compiled=0.333408,single_pass mode\n");
}

// Below a single-pass report, what its zero rows are (the Loss line says why eager is nan); a
// two-pass report, such as the spec's example, ends with its RESULT block.
TEST(Report, SinglePassReportEndsWithTheHintAboutSharedTensors) {
  StepReport report;
  report.single_pass = true;
  report.loss_compiled = 0.333408;
  report.rows.push_back(tensor_row("layers.0", Kind::kFwdOutput, 0, 0, 0));
  const std::string text = render_text(report);
  const std::string ending =
      "  RESULT: ALL PASS  (atol=1e-4 rtol=1e-3)\n"
      "========================================================================\n"
      "  single-pass: FORWARD INPUT and grad_output are the tensors both sides share (0 by "
      "design);\n"
      "  FORWARD OUTPUT and grad_input are what compares the two sides.\n";
  ASSERT_GE(text.size(), ending.size());
  EXPECT_EQ(text.substr(text.size() - ending.size()), ending);
  const std::string two_pass = render_text(spec_example());
  EXPECT_TRUE(two_pass.ends_with(
      "  RESULT: ALL PASS  (atol=1e-4 rtol=1e-3)\n"
      "========================================================================\n"))
      << two_pass;
}

// Why a row fails, when its metrics do not say it (NaN/Inf on one side), is on the stdout line
// below the row, as in the CSV's note column.
TEST(Report, FailingRowShowsItsReasonOnStdout) {
  StepReport report;
  report.loss_eager = 1.0;
  report.loss_compiled = 1.0;
  Row row = tensor_row("layers.0", Kind::kFwdOutput, NAN, NAN, NAN);
  row.status = Status::kFail;
  row.reason = "32 NaN/Inf only in compiled";
  report.rows.push_back(row);
  const std::string text = render_text(report);
  EXPECT_NE(text.find("[!!] max_abs=nan  mean_abs=nan  max_rel=nan  shape=(2, 128, 4096)\n"
                      "        32 NaN/Inf only in compiled\n"),
            std::string::npos)
      << text;
  EXPECT_NE(render_csv({report}).find(",32 NaN/Inf only in compiled\n"), std::string::npos);
}

TEST(Report, FailingRowsAreFlaggedAndResultFails) {
  StepReport report = spec_example();
  report.rows[1].status = Status::kFail;
  report.rows[1].metrics->max_abs = 0.5;
  report.tolerances = {1e-5, 0.01};
  const std::string text = render_text(report);
  EXPECT_NE(
      text.find(
          "  FAIL  layers.0                                             [!!] max_abs=5.000e-01"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("  RESULT: FAILED  (1 FAIL, 0 WARN; atol=1e-5 rtol=0.01)\n"),
            std::string::npos)
      << text;
  EXPECT_FALSE(report.all_pass());
}

Row missing_row(const std::string& module, Kind kind, bool eager_side) {
  Row row;
  row.module = module;
  row.kind = kind;
  row.status = Status::kWarn;
  row.note = eager_side ? "MISSING_fwd_in_compiled" : "MISSING_fwd_in_eager";
  (eager_side ? row.eager : row.compiled) = TensorSide{formats::DType::kFloat32, {3}};
  return row;
}

Row note_row(const std::string& module, Status status, const std::string& note) {
  Row row;
  row.module = module;
  row.status = status;
  row.note = note;
  return row;
}

std::string result_line(const std::string& text) {
  const auto start = text.find("  RESULT: ");
  return start == std::string::npos ? "" : text.substr(start, text.find('\n', start) - start);
}

// A step where no tensor was compared on both sides (everything ignored, skipped, or present on
// one side only) is not a pass, whatever else it holds: the RESULT line says so.
TEST(Report, NothingComparedIsNeverAPass) {
  StepReport only_loss;
  only_loss.loss_eager = 1.0;
  only_loss.loss_compiled = 1.0;
  EXPECT_FALSE(only_loss.all_pass());
  EXPECT_TRUE(only_loss.counts().nothing_compared());
  EXPECT_EQ(result_line(render_text(only_loss)),
            "  RESULT: FAILED  (0 FAIL, 0 WARN, nothing compared; atol=1e-4 rtol=1e-3)");

  StepReport only_skips;
  only_skips.rows.push_back(note_row("head", Status::kSkip, "IGNORED"));
  only_skips.rows.push_back(note_row("body", Status::kSkip, "SKIP_inside_compiled"));
  EXPECT_FALSE(only_skips.all_pass());
  EXPECT_EQ(result_line(render_text(only_skips)),
            "  RESULT: FAILED  (0 FAIL, 0 WARN, nothing compared; atol=1e-4 rtol=1e-3)");

  StepReport one_sided;
  one_sided.rows.push_back(missing_row("layers.0", Kind::kFwdOutput, true));
  one_sided.rows.push_back(missing_row("layers.1", Kind::kFwdOutput, false));
  EXPECT_EQ(one_sided.counts().compared, 0u);
  EXPECT_EQ(result_line(render_text(one_sided)),
            "  RESULT: FAILED  (0 FAIL, 2 WARN, nothing compared; atol=1e-4 rtol=1e-3)");

  // One compared tensor is enough; skipped rows beside it do not count.
  StepReport compared = only_skips;
  compared.rows.push_back(tensor_row("layers.0", Kind::kFwdOutput, 0, 0, 0));
  EXPECT_TRUE(compared.all_pass());
  EXPECT_EQ(result_line(render_text(compared)), "  RESULT: ALL PASS  (atol=1e-4 rtol=1e-3)");

  // A comparison without any step is not a pass either.
  EXPECT_FALSE(Comparison{}.all_pass());
}

// The RESULT line of a failed step counts its FAIL and WARN rows (module notes included) and says
// when the loss check failed; the CSV holds exactly those statuses.
TEST(Report, FailedResultLineCountsFailAndWarnRowsAndTheLoss) {
  StepReport report = spec_example();
  report.rows[1].status = Status::kFail;
  report.rows[2].status = Status::kFail;
  report.rows.push_back(missing_row("layers.1", Kind::kFwdOutput, true));
  report.rows.push_back(note_row("layers.2", Status::kWarn, "NOT_COMPILED"));
  report.rows.push_back(note_row("layers.3", Status::kSkip, "IGNORED"));
  EXPECT_EQ(result_line(render_text(report)),
            "  RESULT: FAILED  (2 FAIL, 2 WARN; atol=1e-4 rtol=1e-3)");

  report.loss_compiled = 7.5;  // the two-pass loss check fails too
  EXPECT_EQ(result_line(render_text(report)),
            "  RESULT: FAILED  (2 FAIL, 2 WARN, loss FAIL; atol=1e-4 rtol=1e-3)");
  const std::string csv = render_csv({report});
  std::size_t fail = 0, warn = 0;
  for (std::size_t at = 0; (at = csv.find(",FAIL,", at)) != std::string::npos; ++at) ++fail;
  for (std::size_t at = 0; (at = csv.find(",WARN,", at)) != std::string::npos; ++at) ++warn;
  EXPECT_EQ(fail, 3u) << csv;  // two rows and the LOSS row
  EXPECT_EQ(warn, 2u) << csv;
  EXPECT_NE(csv.find("LOSS,loss,0,FAIL,"), std::string::npos) << csv;

  // Only the loss: no row is counted, the reason is still given.
  StepReport loss_only = spec_example();
  loss_only.loss_compiled = 7.5;
  EXPECT_EQ(result_line(render_text(loss_only)),
            "  RESULT: FAILED  (0 FAIL, 0 WARN, loss FAIL; atol=1e-4 rtol=1e-3)");
}

// A run that FAILED only because of WARN rows says so in all three reports: the RESULT line, the
// CSV (WARN rows, no FAIL row) and the JSON (verdict FAILED with the same counts).
TEST(Report, StdoutCsvAndJsonAgreeOnAWarnOnlyFailure) {
  StepReport report = spec_example();
  report.rows.push_back(missing_row("layers.1", Kind::kFwdOutput, true));
  report.rows.push_back(note_row("layers.2", Status::kWarn, "NOT_COMPILED"));
  EXPECT_FALSE(report.all_pass());
  EXPECT_EQ(result_line(render_text(report)),
            "  RESULT: FAILED  (0 FAIL, 2 WARN; atol=1e-4 rtol=1e-3)");
  const std::string csv = render_csv({report});
  EXPECT_EQ(csv.find(",FAIL,"), std::string::npos) << csv;
  EXPECT_NE(csv.find("layers.1,fwd_output,0,WARN,,,,\"(3,)\",MISSING_fwd_in_compiled\n"),
            std::string::npos)
      << csv;
  EXPECT_NE(csv.find("layers.2,note,0,WARN,,,,,NOT_COMPILED\n"), std::string::npos) << csv;

  RankComparison rank;
  rank.comparison.steps.push_back(report);
  const std::string json = render_json({rank});
  EXPECT_NE(json.find("\"result\": {\"verdict\": \"FAILED\", \"fail\": 0, \"warn\": 2, "
                      "\"pass\": 3, \"skip\": 0, \"compared\": 3, \"noise_pass\": 0, "
                      "\"no_reference_calls\": 0, \"referenced\": 0, \"screened\": 0, "
                      "\"low_precision_unreferenced\": 0, \"loss_fail\": false, "
                      "\"nothing_compared\": false}"),
            std::string::npos)
      << json;
  EXPECT_NE(
      json.find(
          "\"summary\": {\"all_pass\": false, \"ranks\": 1, \"rows\": 5, \"pass\": 3, "
          "\"fail\": 0, \"warn\": 2, \"skip\": 0, \"compared\": 3, "
          "\"loss_fail\": 0, \"steps\": 1, \"failed_steps\": 1, "
          "\"nothing_compared_steps\": 0, \"root_cause_first_seen\": null, \"warnings\": []}"),
      std::string::npos)
      << json;
}

// Names come from files: control characters and bytes that are not UTF-8 are escaped the same
// way in every report, so a line stays a line and the JSON stays valid UTF-8.
TEST(Report, NamesAreEscapedInTextCsvAndJson) {
  EXPECT_EQ(formats::printable_name("layers.0"), "layers.0");
  EXPECT_EQ(formats::printable_name("caf\xc3\xa9 \xe2\x82\xac"),
            "caf\xc3\xa9 \xe2\x82\xac");  // UTF-8 kept
  EXPECT_EQ(formats::printable_name("a\nb\tc\x7f"), "a\\x0Ab\\x09c\\x7F");
  EXPECT_EQ(formats::printable_name("bad\xcf"), "bad\\xCF");              // truncated sequence
  EXPECT_EQ(formats::printable_name("\xc0\xaf"), "\\xC0\\xAF");           // overlong '/'
  EXPECT_EQ(formats::printable_name("\xed\xa0\x80"), "\\xED\\xA0\\x80");  // surrogate
  EXPECT_EQ(formats::printable_name("\xc2\x85"), "\\xC2\\x85");           // C1 control NEL

  StepReport report;
  report.rows.push_back(tensor_row("evil\nmodule\xcf", Kind::kFwdOutput, 0, 0, 0));
  report.rows.back().label = "p\x01";
  report.rows.push_back(note_row("note\r", Status::kWarn, "NOT_COMPILED"));
  report.rows.back().reason = "why\n\xff";
  const std::string text = render_text(report);
  EXPECT_NE(text.find("  pass  evil\\x0Amodule\\xCF   "), std::string::npos) << text;
  EXPECT_NE(text.find("  WARN  note\\x0D   "), std::string::npos) << text;
  EXPECT_NE(text.find("NOT_COMPILED\n        why\\x0A\\xFF\n"), std::string::npos) << text;
  const std::string csv = render_csv({report});
  EXPECT_NE(csv.find("\nevil\\x0Amodule\\xCF,fwd_output,0,PASS,"), std::string::npos) << csv;
  EXPECT_NE(csv.find("\nnote\\x0D,note,0,WARN,,,,,NOT_COMPILED: why\\x0A\\xFF\n"),
            std::string::npos)
      << csv;
  RankComparison rank;
  rank.comparison.steps.push_back(report);
  rank.comparison.warnings.push_back("w\xcf");
  const std::string json = render_json({rank});
  EXPECT_NE(json.find("\"module\": \"evil\\\\x0Amodule\\\\xCF\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"label\": \"p\\\\x01\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"w\\\\xCF\""), std::string::npos) << json;
  for (unsigned char c : json) {
    EXPECT_TRUE(c < 0x80 && (c >= 0x20 || c == '\n')) << "raw byte " << int(c) << " in JSON";
  }
}

TEST(Report, SeveralTensorsOfAModuleEachGetALine) {
  StepReport report;
  Row first = tensor_row("block", Kind::kFwdOutput, 0, 0, 0);
  Row second = tensor_row("block", Kind::kFwdOutput, 1.0, 0.5, 2.0);
  second.tensor_index = 1;
  second.status = Status::kFail;
  second.eager->shape = {7};
  second.compiled->shape = {7};
  report.rows = {first, second};
  const std::string text = render_text(report);
  // The module's line takes the worst status; the second tensor continues under the first.
  EXPECT_NE(
      text.find(
          "  FAIL  block                                                [OK] max_abs=0.000e+00"),
      std::string::npos)
      << text;
  EXPECT_NE(
      text.find("\n" + std::string(61, ' ') +
                "[!!] max_abs=1.000e+00  mean_abs=5.000e-01  max_rel=2.000e+00  shape=(7,)\n"),
      std::string::npos)
      << text;
}

// A bf16 row with its reference: the verdict's line only where it says something (a FAIL, or a
// pass the tolerances alone would fail), no `tol:` line under a row the reference decided or under
// an exact match, and a RESULT line naming the rule that decided instead of tolerances no row used.
Row referenced_row(const std::string& module, double eager_rmse, double compiled_rmse,
                   Status tolerance_status) {
  Row row = tensor_row(module, Kind::kFwdOutput, compiled_rmse, compiled_rmse, compiled_rmse);
  row.eager->dtype = row.compiled->dtype = formats::DType::kBFloat16;
  row.tolerances = Tolerances{0.01, 0.016};  // the bf16 floor
  row.reference_verdict = compiled_rmse > 2 * eager_rmse ? "divergence" : "noise";
  row.reference_dtype = "fp32";
  row.reference_eager = TensorMetrics{};
  row.reference_eager->rmse = eager_rmse;
  row.reference_compiled = TensorMetrics{};
  row.reference_compiled->rmse = compiled_rmse;
  row.noise_units = compiled_rmse / eager_rmse;
  row.tolerance_status = tolerance_status;
  row.status = row.reference_verdict == "noise" ? Status::kPass : Status::kFail;
  return row;
}

TEST(Report, ALowPrecisionReportShowsWhatDecidedEachRowAndTheStep) {
  StepReport report;
  report.rows = {referenced_row("quiet", 1e-3, 1e-3, Status::kPass),
                 referenced_row("close", 1e-3, 1.5e-3, Status::kFail),
                 referenced_row("fault", 1e-3, 2e-2, Status::kPass)};
  const std::string text = render_text(report);
  EXPECT_EQ(text.find("tol: "), std::string::npos) << text;
  EXPECT_EQ(text.find("fp32: noise, 1.0x noise"), std::string::npos) << text;
  EXPECT_NE(text.find("fp32: noise, 1.5x noise (rmse compiled=1.5e-03 eager=1.0e-03; tolerances "
                      "fail)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("fp32: divergence, 20x noise"), std::string::npos) << text;
  EXPECT_NE(text.find("RESULT: FAILED  (1 FAIL, 0 WARN, 1 pass only within reference noise; "
                      "reference: noise within 2x)"),
            std::string::npos)
      << text;
  // The failing-only view: the FAIL row alone, the RESULT line the whole step's.
  const std::string failing = render_text(report, /*only_failing=*/true);
  EXPECT_NE(failing.find("failing rows only: 2 passing or skipped row(s) not shown"),
            std::string::npos)
      << failing;
  EXPECT_EQ(failing.find("  pass  quiet"), std::string::npos) << failing;
  EXPECT_NE(failing.find("  FAIL  fault"), std::string::npos) << failing;
  EXPECT_NE(failing.find("RESULT: FAILED  (1 FAIL, 0 WARN, 1 pass only within reference noise;"),
            std::string::npos)
      << failing;
  // Without the reference, the RESULT line says the dtype's tolerances decided.
  StepReport unreferenced;
  unreferenced.rows = {tensor_row("block", Kind::kFwdOutput, 0, 0, 0)};
  unreferenced.rows[0].eager->dtype = formats::DType::kBFloat16;
  EXPECT_NE(render_text(unreferenced)
                .find("RESULT: ALL PASS  (1 low-precision row(s) without a reference: judged by "
                      "the tolerances; atol=1e-4 rtol=1e-3)"),
            std::string::npos)
      << render_text(unreferenced);
  // The CSV says it on the row; a float32 row or a referenced one has no such note.
  EXPECT_NE(render_csv({unreferenced}).find("4096)\",no reference: judged by the tolerances\n"),
            std::string::npos)
      << render_csv({unreferenced});
  EXPECT_EQ(render_csv({report}).find("no reference"), std::string::npos) << render_csv({report});
  unreferenced.rows[0].eager->dtype = formats::DType::kFloat32;
  EXPECT_EQ(render_csv({unreferenced}).find("no reference"), std::string::npos);
}

// A row's details (reason, its own tolerances, the reference verdict, a note's reason) are on
// lines of their own below it, indented and wrapped to 120 columns; the row itself is the spec's.
TEST(Report, RowDetailsGoBelowTheRowAndFitA120ColumnTerminal) {
  StepReport report = spec_example();
  Row& row = report.rows[1];
  row.status = Status::kFail;
  row.reason = "3 NaN/Inf only in compiled";
  row.tolerances = Tolerances{0.01, 0.016};
  row.reference_verdict = "divergence";
  row.reference_dtype = "fp32";
  row.reference_eager = TensorMetrics{};
  row.reference_eager->rmse = 1.0e-3;
  row.reference_compiled = TensorMetrics{};
  row.reference_compiled->rmse = 3.1e-2;
  row.tolerance_status = Status::kPass;
  report.rows.push_back(note_row("layers.1", Status::kWarn, "NOT_COMPILED"));
  report.rows.back().reason = "some calls were not compared: " + std::string(40, 'a') + " " +
                              std::string(60, 'b') + " " + std::string(30, 'c');
  const std::string text = render_text(report);
  EXPECT_NE(
      text.find(
          "\n  FAIL  layers.0                                             [!!] max_abs=2.300e-07  "
          "mean_abs=1.200e-08  max_rel=5.100e-06  shape=(2, 128, 4096)\n"
          "        3 NaN/Inf only in compiled  fp32: divergence (rmse compiled=3.1e-02 "
          "eager=1.0e-03; tolerances pass)\n"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("\n  WARN  layers.1                                             "
                      "NOT_COMPILED\n"
                      "        some calls were not compared: " +
                      std::string(40, 'a') + "\n        " + std::string(60, 'b') + " " +
                      std::string(30, 'c') + "\n"),
            std::string::npos)
      << text;
  // Every line but the spec's rows (their layout is the spec's: 144 columns with this shape).
  std::size_t start = 0;
  while (start < text.size()) {
    const std::size_t end = text.find('\n', start);
    const std::string line = text.substr(start, end - start);
    if (line.find("shape=(2, 128, 4096)") == std::string::npos) {
      EXPECT_LE(line.size(), 120u) << line;
    }
    start = end + 1;
  }
}

TEST(Report, MergedCsvUsesTheMultiRankSpelling) {
  StepReport report;
  report.single_pass = true;
  report.loss_compiled = 0.333408;
  Row ignored;
  ignored.module = "layers.0";
  ignored.status = Status::kSkip;
  ignored.note = "IGNORED";
  report.rows.push_back(ignored);
  RankComparison rank;
  rank.rank = 1;
  rank.scenario = "ignore";
  rank.comparison.steps.push_back(report);
  EXPECT_EQ(render_merged_csv({rank}),
            "rank,scenario,module_name,check_type,tensor_index,status,max_abs_diff,mean_abs_diff,"
            "max_rel_diff,shape,note\n"
            "1,ignore,LOSS,loss,0,PASS,N/A,N/A,N/A,compiled=0.333408,single_pass mode\n"
            "1,ignore,layers.0,-,0,SKIP,N/A,N/A,N/A,,IGNORED\n");
}

// One step keeps the spec's columns; several carry the step, so that a script tells them apart.
TEST(Report, CsvsOfSeveralStepsCarryTheStep) {
  StepReport first = spec_example();
  StepReport second = spec_example();
  second.step = 7;
  const std::string csv = render_csv({first, second});
  EXPECT_TRUE(csv.starts_with("step,module_name,check_type,tensor_index,status,")) << csv;
  EXPECT_NE(csv.find("\n0,LOSS,loss,0,PASS,"), std::string::npos) << csv;
  EXPECT_NE(csv.find("\n7,layers.0,fwd_output,0,PASS,2.300000e-07,"), std::string::npos) << csv;
  EXPECT_TRUE(render_csv({second}).starts_with("module_name,check_type,"));

  RankComparison rank;
  rank.rank = 3;
  rank.scenario = "base";
  rank.comparison.steps = {first, second};
  const std::string merged = render_merged_csv({rank});
  EXPECT_TRUE(merged.starts_with("rank,scenario,step,module_name,check_type,")) << merged;
  EXPECT_NE(merged.find("\n3,base,7,layers.0,fwd_output,0,PASS,"), std::string::npos) << merged;
}

TEST(Report, FloatsAreSpelledAsPythonSpellsThem) {
  EXPECT_EQ(format_float(NAN, "%.3e"), "nan");
  EXPECT_EQ(format_float(-NAN, "%.6f"), "nan");
  EXPECT_EQ(format_float(INFINITY, "%.6e"), "inf");
  EXPECT_EQ(format_float(-INFINITY, "%.6e"), "-inf");
  EXPECT_EQ(format_float(1.192092896e-07, "%.6e"), "1.192093e-07");
}

// A new whole-run format is one registry entry: each renders, and a name that is not one is a
// usage error that lists the known names.
TEST(Report, EveryRegisteredFormatRendersAndAnUnknownOneIsAUsageError) {
  RankComparison rank;
  rank.comparison.steps.push_back(spec_example());
  std::vector<std::string> names;
  for (const ReportFormat& format : report_formats()) {
    names.emplace_back(format.name);
    EXPECT_FALSE(format.render({rank}).empty()) << format.name;
    EXPECT_EQ(&report_format(format.name), &format);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"merged-csv", "json", "html", "junit", "markdown"}));
  try {
    report_format("pdf");
    FAIL() << "no error";
  } catch (const UsageError& error) {
    EXPECT_NE(std::string(error.what())
                  .find("(merged-csv, json, html, junit, markdown), but received 'pdf'"),
              std::string::npos)
        << error.what();
  }
}

// The JSON row has the worst element nested, the mismatch fraction and the |diff| histogram;
// the Python dicts are the same model (tests/python/test_report_model.py).
TEST(Report, JsonRowHasTheWorstElementAndTheHistogram) {
  StepReport report = spec_example();
  TensorMetrics& m = *report.rows[1].metrics;
  m.elements = 4;
  m.mismatches = 1;
  m.worst_index = 4097;
  m.worst_eager = 1.5;
  m.worst_compiled = -0.5;
  m.histogram[3] = 4;
  RankComparison rank;
  rank.comparison.steps.push_back(report);
  const std::string json = render_json({rank});
  EXPECT_NE(json.find("\"mismatch_fraction\": 0.25, \"nan_eager\": 0"), std::string::npos) << json;
  EXPECT_NE(json.find("\"worst\": {\"flat_index\": 4097, \"index\": [0, 1, 1], \"eager\": 1.5, "
                      "\"compiled\": -0.5}, \"histogram\": [0, 0, 0, 4, 0"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("\"worst\": null"), std::string::npos) << json;  // rows without one
  // 2^-40, 2^-38, 2^-36: doubles as their shortest round-trip text.
  EXPECT_NE(json.find("\"histogram_edges\": [9.094947017729282e-13, 3.637978807091713e-12, "
                      "1.4551915228366852e-11"),
            std::string::npos)
      << json;
}

// The data of an HTML report: base64, then gzip, as the page's script reads it.
std::string html_data(const std::string& html) {
  const std::string open = "id=\"dynaprobe-data\">";
  const std::size_t start = html.find(open) + open.size();
  const std::string text = html.substr(start, html.find('<', start) - start);
  std::string bytes;
  std::uint32_t group = 0;
  int bits = 0;
  for (char c : text) {
    const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const char* at = std::strchr(alphabet, c);
    if (c == '=' || !at) continue;
    group = (group << 6) | static_cast<std::uint32_t>(at - alphabet);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      bytes += static_cast<char>((group >> bits) & 0xFF);
    }
  }
  z_stream stream{};
  EXPECT_EQ(inflateInit2(&stream, 15 + 16), Z_OK);
  std::string out(bytes.size() * 50 + 1024, '\0');
  stream.next_in = reinterpret_cast<Bytef*>(bytes.data());
  stream.avail_in = static_cast<uInt>(bytes.size());
  stream.next_out = reinterpret_cast<Bytef*>(out.data());
  stream.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(inflate(&stream, Z_FINISH), Z_STREAM_END);
  out.resize(stream.total_out);
  inflateEnd(&stream);
  return out;
}

// The HTML report opens offline: nothing is loaded from elsewhere, and text from the dump
// (graph code here) cannot end the <script> element that holds the data. Its data is the JSON
// report's model, and each rank's graphs with their lines.
TEST(Report, HtmlIsSelfContainedAndDumpTextCannotCloseItsScript) {
  RankComparison rank;
  rank.comparison.steps.push_back(spec_example());
  rank.graphs.push_back(
      {"__compiled_fn_1.Forward_Graph.0", "forward", "x = '</script><script>alert(1)'\n", {}});
  const std::string html = render_html({rank});
  std::size_t closing = 0;
  for (std::size_t at = html.find("</script"); at != std::string::npos;
       at = html.find("</script", at + 1)) {
    ++closing;
  }
  EXPECT_EQ(closing, 3u);  // Chart.js, the data, the page's script
  EXPECT_EQ(html.find("<link"), std::string::npos);
  EXPECT_EQ(html.find(" src="), std::string::npos);
  EXPECT_NE(html.find("Chart.js v3"), std::string::npos);
  EXPECT_EQ(html.find("alert(1)"), std::string::npos);
  const std::string data = html_data(html);
  std::string json = render_json({rank});
  json.pop_back();  // its final newline
  EXPECT_EQ(data, "{\"report\": " + json +
                      ",\n\"graphs\": [\n  {\"__compiled_fn_1.Forward_Graph.0\": \"x = "
                      "'</script><script>alert(1)'\\n\"}],\n\"verdicts\": {\n  \"all_pass\": \"ALL "
                      "PASS\",\n  \"failed\": \"FAILED\"\n}}");
}

// A divergence's next line is the commands that find its stage and op, and a change that fixes
// it, with the dump as a POSIX shell reads it; without the call kept for replay it says to keep
// it first.
// A single-pass step of `dump` whose one row, of `module`, FAILs beyond the reference's noise;
// the module keeps its call for replay.
StepReport divergence_report(const std::string& dump, const std::string& module) {
  StepReport report;
  report.single_pass = true;
  report.dump = dump;
  Row row;
  row.module = module;
  row.kind = Kind::kFwdOutput;
  row.status = Status::kFail;
  row.metrics = TensorMetrics{};
  row.metrics->max_abs = 0.5;
  row.reference_verdict = "divergence";
  report.rows.push_back(row);
  report.modules[module]["replay"] = "{}";
  return report;
}

TEST(RootCause, NextLineIsTheBisectAndRemedyCommandsOnThisDump) {
  StepReport report = divergence_report("/tmp/my run's/dump", "model.layers.0");
  find_root_cause(report);
  const std::string dump = "'/tmp/my run'\\''s/dump' --module model.layers.0";
  const std::string commands = "find the compile stage and op that change it: dynaprobe bisect " +
                               dump + " --ops; then a change that fixes it: dynaprobe remedy " +
                               dump;
  EXPECT_TRUE(report.root_cause.next.ends_with("a compiler divergence; " + commands))
      << report.root_cause.next;
  // The modules that define its backend and inductor pass are imported, by both commands; the
  // capture script's own (__main__) cannot be.
  report.modules["model.layers.0"]["replay"] =
      R"({"backend": {"name": "fault", "defined": "my_backends:fault"}, "inductor_config": )"
      R"({"post_grad_custom_post_pass": {"import": "my_passes:PASS"}, )"
      R"("joint_custom_pre_pass": {"import": "__main__:other"}}})";
  find_root_cause(report);
  const std::string imports = " --import my_backends --import my_passes";
  EXPECT_TRUE(report.root_cause.next.ends_with("dynaprobe bisect " + dump + " --ops" + imports +
                                               "; then a change that fixes it: dynaprobe remedy " +
                                               dump + imports))
      << report.root_cause.next;
  report.modules.clear();
  find_root_cause(report);
  EXPECT_TRUE(report.root_cause.next.ends_with(
      "keep its call for replay (single-pass with dump=\"full\" or \"failing\", whose "
      "replay=\"failing\" is the default) and " +
      commands))
      << report.root_cause.next;
}

// A module compiled in several graphs gets the divergence's commands (bisect and remedy replay
// each of its graphs); one Dynamo did not compile at all is sent to troubleshooting.
TEST(RootCause, GraphBreaksDoNotHideTheDivergenceCommands) {
  StepReport report = divergence_report("dump", "block");
  report.modules["block"]["graph_breaks"] = "1";
  find_root_cause(report);
  EXPECT_TRUE(report.root_cause.next.ends_with(
      "then a change that fixes it: dynaprobe remedy dump --module block"))
      << report.root_cause.next;
  report.modules["block"]["note"] = "NOT_COMPILED";
  find_root_cause(report);
  EXPECT_EQ(report.root_cause.next,
            "block was not compiled in this step (its compiled side ran eagerly): see "
            "troubleshooting, \"Graph breaks and NOT_COMPILED\"");
}

}  // namespace
}  // namespace dynaprobe::analyze
