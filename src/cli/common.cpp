#include "cli/common.h"

#include <charconv>

#include "core/error.h"
#include "core/threads.h"

namespace vavilov::cli {

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    int32_t value = 0;
    auto [ptr, ec] = std::from_chars(text.data() + begin, text.data() + end, value);
    check(ec == std::errc() && ptr == text.data() + end && end > begin && value >= 0,
          "--ids: expected comma-separated non-negative integers, got '{}'", text.substr(begin, end - begin));
    ids.push_back(value);
    begin = end + 1;
  }
  return ids;
}

void add_threads_option(CLI::App* command, int& threads) {
  command->add_option("--threads", threads, "CPU threads (0: all hardware threads)")->check(CLI::NonNegativeNumber);
}

void apply_threads(int threads) { set_thread_count(threads); }

}  // namespace vavilov::cli
