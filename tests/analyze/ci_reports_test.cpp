// The CI reports: JUnit XML and the GitHub Actions job summary (Markdown), byte for byte on a
// small report, and the escaping of a hostile module name.
#include <gtest/gtest.h>

#include "dynaprobe/analyze/report.h"

namespace dynaprobe::analyze {
namespace {

using formats::Kind;

Row row(const std::string& module, Kind kind, Status status, double max_abs) {
  Row r;
  r.module = module;
  r.kind = kind;
  r.status = status;
  r.eager = TensorSide{formats::DType::kFloat32, {3}};
  r.compiled = r.eager;
  TensorMetrics metrics;
  metrics.max_abs = max_abs;
  metrics.mean_abs = max_abs / 2;
  metrics.max_rel = max_abs * 10;
  r.metrics = metrics;
  return r;
}

Row note(const std::string& module, Status status, const std::string& text) {
  Row r;
  r.module = module;
  r.status = status;
  r.note = text;
  return r;
}

// Rank 0, step 3: a.0 passes, b fails (the root cause), c is skipped, d warns.
std::vector<RankComparison> failing_run() {
  StepReport step;
  step.step = 3;
  step.rows.push_back(row("a.0", Kind::kFwdOutput, Status::kPass, 0));
  step.rows.push_back(row("b", Kind::kFwdOutput, Status::kFail, 0.5));
  step.rows.push_back(note("c", Status::kSkip, "IGNORED"));
  step.rows.push_back(note("d", Status::kWarn, "NOT_COMPILED"));
  step.root_cause.forward = Finding{1, "local", "its inputs matched"};
  step.root_cause.next = "see troubleshooting";
  RankComparison rank;
  rank.comparison.steps.push_back(step);
  return {rank};
}

TEST(CiReports, JunitHasATestcasePerModuleAndAFailurePerFailingModule) {
  const std::string expected =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<testsuites name=\"dynaprobe\" tests=\"4\" failures=\"2\" errors=\"0\" skipped=\"1\">\n"
      "  <testsuite name=\"dynaprobe.rank0.step3\" tests=\"4\" failures=\"2\" errors=\"0\" "
      "skipped=\"1\">\n"
      "    <testcase classname=\"dynaprobe.rank0.step3\" name=\"a.0\"/>\n"
      "    <testcase classname=\"dynaprobe.rank0.step3\" name=\"b\">\n"
      "      <failure type=\"FAIL\" message=\"1 FAIL, 0 WARN: FAIL fwd_output[0] "
      "max_abs=5.000e-01 mean_abs=2.500e-01 max_rel=5.000e+00 shape=(3,)\">"
      "FAIL fwd_output[0] max_abs=5.000e-01 mean_abs=2.500e-01 max_rel=5.000e+00 shape=(3,)\n"
      "root cause of the step:\n"
      "  forward   b fwd_output[0] (max_abs=5.000e-01): local, its inputs matched\n"
      "  next      see troubleshooting\n"
      "</failure>\n"
      "    </testcase>\n"
      "    <testcase classname=\"dynaprobe.rank0.step3\" name=\"c\">\n"
      "      <skipped message=\"IGNORED\"/>\n"
      "    </testcase>\n"
      "    <testcase classname=\"dynaprobe.rank0.step3\" name=\"d\">\n"
      "      <failure type=\"WARN\" message=\"0 FAIL, 1 WARN: WARN note NOT_COMPILED\">"
      "WARN note NOT_COMPILED\n"
      "root cause of the step:\n"
      "  forward   b fwd_output[0] (max_abs=5.000e-01): local, its inputs matched\n"
      "  next      see troubleshooting\n"
      "</failure>\n"
      "    </testcase>\n"
      "  </testsuite>\n"
      "</testsuites>\n";
  EXPECT_EQ(render_junit(failing_run()), expected);
}

TEST(CiReports, JunitEscapesAHostileModuleName) {
  std::vector<RankComparison> run = failing_run();
  run[0].comparison.steps[0].rows[1].module = "<b a=\"1\" c='2'>&\n\x01";
  run[0].comparison.steps[0].rows[1].reason = "]]></failure><x>";
  const std::string xml = render_junit(run);
  EXPECT_NE(xml.find("name=\"&lt;b a=&quot;1&quot; c=&apos;2&apos;&gt;&amp;\\x0A\\x01\">"),
            std::string::npos)
      << xml;
  EXPECT_NE(xml.find("]]&gt;&lt;/failure&gt;&lt;x&gt;"), std::string::npos) << xml;
  EXPECT_EQ(xml.find("<x>"), std::string::npos) << xml;
}

TEST(CiReports, JunitFailsTheLossCheckAndAStepWithNothingCompared) {
  StepReport step;
  step.step = 1;
  step.loss_eager = 1.0;
  step.loss_compiled = 2.0;
  step.rows.push_back(note("c", Status::kSkip, "IGNORED"));
  RankComparison rank;
  rank.rank = 2;
  rank.comparison.steps.push_back(step);
  const std::string xml = render_junit({rank});
  EXPECT_NE(xml.find("<testsuite name=\"dynaprobe.rank2.step1\" tests=\"3\" failures=\"2\" "
                     "errors=\"0\" skipped=\"1\">"),
            std::string::npos)
      << xml;
  EXPECT_NE(xml.find("name=\"(loss)\">\n      <failure type=\"FAIL\" message=\"loss "
                     "eager=1.000000 compiled=2.000000\">"),
            std::string::npos)
      << xml;
  EXPECT_NE(xml.find("name=\"(nothing compared)\">\n      <failure"), std::string::npos) << xml;
}

TEST(CiReports, MarkdownHasTheVerdictTheFailingRowsAndTheRootCause) {
  std::vector<RankComparison> run = failing_run();
  run[0].comparison.steps[0].rows[1].module = "b|c_*";
  const std::string expected =
      "## dynaprobe: FAILED\n"
      "\n"
      "1 of 1 step failed across 1 rank. Rows: 1 FAIL, 1 WARN, 1 PASS, 1 SKIP.\n"
      "\n"
      "| rank | step | module | check | status | max_abs |\n"
      "| ---: | ---: | --- | --- | --- | ---: |\n"
      "| 0 | 3 | b\\|c\\_\\* | fwd\\_output\\[0\\] | FAIL | 5.000e-01 |\n"
      "| 0 | 3 | d | note NOT\\_COMPILED | WARN |  |\n"
      "\n"
      "### Root cause (first seen at rank 0, step 3)\n"
      "\n"
      "- **forward**: b\\|c\\_\\* fwd\\_output\\[0\\] (max\\_abs=5.000e-01): local, its inputs "
      "matched\n"
      "- **next**: see troubleshooting\n";
  EXPECT_EQ(render_markdown(run), expected);
}

TEST(CiReports, MarkdownOfAPassHasNoTable) {
  StepReport step;
  step.rows.push_back(row("a", Kind::kFwdOutput, Status::kPass, 0));
  RankComparison rank;
  rank.comparison.steps.push_back(step);
  EXPECT_EQ(render_markdown({rank}),
            "## dynaprobe: ALL PASS\n\n0 of 1 step failed across 1 rank. Rows: 0 FAIL, 0 WARN, "
            "1 PASS, 0 SKIP.\n");
}

}  // namespace
}  // namespace dynaprobe::analyze
