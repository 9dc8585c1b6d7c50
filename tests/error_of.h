#pragma once
// The message of the vavilov::Error an action throws; a test failure when it throws none.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "core/error.h"

namespace vavilov::test {

inline std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a vavilov::Error";
  return "";
}

}  // namespace vavilov::test
