#pragma once
// Stop strings over streamed text. Text that could still be the start of a stop string is held back until later
// text decides it, so a stop string never reaches the client, even when it is split across tokens or chunks.
#include <string>
#include <string_view>
#include <vector>

namespace vavilov::server {

// The length of the longest suffix of `text` that is a proper prefix of one of `markers` (text that must wait).
size_t partial_marker_suffix(std::string_view text, const std::vector<std::string>& markers);

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);

  // Appends `text` and returns what can be released. Once a stop string appears, the text before it is released,
  // the rest is dropped, and stopped() turns true.
  std::string push(std::string_view text);
  // The held-back text at the end of generation (when no stop string came).
  std::string finish();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace vavilov::server
