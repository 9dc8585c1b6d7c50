#include "core/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

namespace vavilov {

namespace {
// How often each style redraws: a terminal line is cheap to overwrite; a log should not fill up.
constexpr auto kTerminalInterval = std::chrono::milliseconds(100);
constexpr auto kLineInterval = std::chrono::seconds(10);
constexpr int kBarWidth = 24;
}  // namespace

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  int unit = 0;
  while (bytes >= 1000.0 && unit < 4) {
    bytes /= 1000.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.{}f} {}", bytes, bytes < 10 ? 2 : 1, units[unit]);
}

std::string format_duration(double seconds) {
  auto total = int64_t(std::llround(std::max(seconds, 0.0)));
  int64_t hours = total / 3600, minutes = total / 60 % 60, secs = total % 60;
  return hours ? fmt::format("{}:{:02}:{:02}", hours, minutes, secs) : fmt::format("{}:{:02}", minutes, secs);
}

std::string progress_text(std::string_view label, uint64_t done, uint64_t total, double seconds) {
  double rate = seconds > 0 ? double(done) / seconds : 0.0;
  std::string text = fmt::format("{}  {} / {}  {}/s", label, format_bytes(double(done)), format_bytes(double(total)),
                                 format_bytes(rate));
  if (rate > 0 && done < total) text += "  ETA " + format_duration(double(total - done) / rate);
  return text;
}

Progress::Progress(std::string label, uint64_t total_bytes, ProgressMode mode, std::FILE* out)
    : label_(std::move(label)), total_(total_bytes), out_(out) {
  terminal_ = ::isatty(::fileno(out)) == 1;
  enabled_ = mode == ProgressMode::Auto || (mode == ProgressMode::Terminal && terminal_);
  start_ = last_draw_ = std::chrono::steady_clock::now();
}

// A job that ends early (an exception) gets no summary, only the bar's line ended.
Progress::~Progress() {
  if (enabled_ && terminal_ && !finished_ && done_ > 0) std::fputc('\n', out_);
}

double Progress::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::add(uint64_t bytes) {
  done_ += bytes;
  if (!enabled_) return;
  auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < (terminal_ ? std::chrono::steady_clock::duration(kTerminalInterval) : kLineInterval)) return;
  last_draw_ = now;
  draw(false);
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  if (enabled_) draw(true);
}

void Progress::draw(bool last) {
  double elapsed = seconds();
  if (last) {
    std::string summary = fmt::format("{}: {} in {:.2f} s ({}/s)", label_, format_bytes(double(done_)), elapsed,
                                      format_bytes(elapsed > 0 ? double(done_) / elapsed : 0.0));
    if (terminal_)
      fmt::print(out_, "\r{}\x1b[K\n", summary);
    else
      fmt::print(out_, "{}\n", summary);
  } else if (terminal_) {
    int filled = total_ ? int(double(kBarWidth) * double(std::min(done_, total_)) / double(total_)) : 0;
    std::string bar = std::string(size_t(filled), '#') + std::string(size_t(kBarWidth - filled), '.');
    fmt::print(out_, "\r[{}] {}\x1b[K", bar, progress_text(label_, done_, total_, elapsed));
  } else {
    fmt::print(out_, "{}\n", progress_text(label_, done_, total_, elapsed));
  }
  std::fflush(out_);
}

}  // namespace vavilov
