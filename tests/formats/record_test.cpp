// Record kinds and sides: their names in a dump, and the pass each kind belongs to, which is what
// the analyzer judges and reports a kind by (formats/src/record.cpp's kind table).
#include "dynaprobe/formats/record.h"

#include <gtest/gtest.h>

#include <string>

namespace dynaprobe::formats {
namespace {

constexpr Kind kEveryKind[] = {Kind::kFwdInput,   Kind::kFwdOutput, Kind::kGradInput,
                               Kind::kGradOutput, Kind::kParamGrad, Kind::kLoss,
                               Kind::kReplay};

TEST(Record, KindNamesRoundTripAndAreListedInEnumeratorOrder) {
  std::string listed;
  for (Kind kind : kEveryKind) {
    EXPECT_EQ(parse_kind(kind_name(kind)), kind);
    listed += (listed.empty() ? "" : ", ") + std::string(kind_name(kind));
  }
  EXPECT_EQ(listed, "fwd_input, fwd_output, grad_input, grad_output, param_grad, loss, replay");
  EXPECT_EQ(kind_names(), listed);
  EXPECT_FALSE(parse_kind("FWD_INPUT"));
  EXPECT_FALSE(parse_kind(""));
}

TEST(Record, EveryKindButReplayIsCompared) {
  for (Kind kind : kEveryKind)
    EXPECT_EQ(is_compared(kind), kind != Kind::kReplay) << kind_name(kind);
}

TEST(Record, OnlyFwdInputAndFwdOutputAreForwardKinds) {
  for (Kind kind : kEveryKind) {
    EXPECT_EQ(is_forward(kind), kind == Kind::kFwdInput || kind == Kind::kFwdOutput)
        << kind_name(kind);
  }
}

TEST(Record, SideNamesRoundTrip) {
  for (Side side : {Side::kEager, Side::kCompiled, Side::kReference}) {
    EXPECT_EQ(parse_side(side_name(side)), side);
  }
  EXPECT_FALSE(parse_side("both"));
}

}  // namespace
}  // namespace dynaprobe::formats
