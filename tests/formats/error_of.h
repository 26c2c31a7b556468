// A GoogleTest helper shared by the formats and analyze tests: the message of the exception a
// call throws.
#pragma once

#include <gtest/gtest.h>

#include <string>

namespace dynaprobe::testing_helpers {

// Catches the exception `call` throws as E and returns its message; fails if it throws nothing.
template <typename E, typename F>
std::string error_of(F&& call) {
  try {
    call();
  } catch (const E& error) {
    return error.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

}  // namespace dynaprobe::testing_helpers
