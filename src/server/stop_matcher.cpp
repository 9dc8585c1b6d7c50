#include "server/stop_matcher.h"

#include <algorithm>

namespace vavilov::server {

size_t partial_marker_suffix(std::string_view text, const std::vector<std::string>& markers) {
  size_t longest = 0;
  for (const std::string& marker : markers) {
    const size_t most = std::min(text.size(), marker.size() - (marker.empty() ? 0 : 1));
    for (size_t length = most; length > longest; --length)
      if (text.substr(text.size() - length) == std::string_view(marker).substr(0, length)) {
        longest = length;
        break;
      }
  }
  return longest;
}

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  std::erase_if(stops_, [](const std::string& stop) { return stop.empty(); });
}

std::string StopMatcher::push(std::string_view text) {
  if (stopped_) return {};
  held_ += text;
  size_t first = std::string::npos;
  for (const std::string& stop : stops_) first = std::min(first, held_.find(stop));
  if (first != std::string::npos) {
    stopped_ = true;
    std::string released = held_.substr(0, first);
    held_.clear();
    return released;
  }
  const size_t keep = partial_marker_suffix(held_, stops_);
  std::string released = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return released;
}

std::string StopMatcher::finish() {
  std::string rest;
  rest.swap(held_);
  return stopped_ ? std::string() : rest;
}

}  // namespace vavilov::server
