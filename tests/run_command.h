#pragma once
// Runs the vavilov binary with arguments through the shell; its exit code and output.
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace vavilov::test {

struct CommandResult {
  int exit_code;
  std::string output;
};

inline CommandResult run_vavilov(const std::string& arguments, bool with_stderr = true) {
  std::string command = std::string(VAVILOV_BINARY) + " " + arguments + (with_stderr ? " 2>&1" : " 2>/dev/null");
  FILE* pipe = ::popen(command.c_str(), "r");
  std::string output;
  char buffer[512];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) output.append(buffer, n);
  int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

}  // namespace vavilov::test
