#pragma once
// One error type for everything a user can get wrong: bad files, bad configs, bad arguments.
// The message names the file, tensor, field or parameter; the CLI prints it on one line.
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace vavilov {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

template <typename... Args>
void check(bool condition, fmt::format_string<Args...> format, Args&&... args) {
  if (!condition) throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace vavilov
