#pragma once
// Progress of a long job that moves bytes (packing, verifying, loading). On a terminal: one line redrawn in place
// with a bar, bytes, rate and ETA. Elsewhere (logs, pipes): a plain line now and then. Quiet: nothing at all.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace vavilov {

enum class ProgressMode {
  Auto,      // bar on a terminal, plain lines otherwise
  Terminal,  // bar on a terminal, nothing otherwise
  Quiet,
};

// "3.21 GB", "812 MB", "4.0 kB" (decimal units, as disks and rates are quoted).
std::string format_bytes(double bytes);
// "0:07", "1:02:03".
std::string format_duration(double seconds);
// "packing  1.21 GB / 3.40 GB  812 MB/s  ETA 0:03": the text both display styles share.
std::string progress_text(std::string_view label, uint64_t done, uint64_t total, double seconds);

class Progress {
 public:
  Progress(std::string label, uint64_t total_bytes, ProgressMode mode = ProgressMode::Auto, std::FILE* out = stderr);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void add(uint64_t bytes);
  // The last line: "label: 3.40 GB in 4.20 s (812 MB/s)"; idempotent. Without it (a failed job) nothing is summed up.
  void finish();
  double seconds() const;
  uint64_t done() const { return done_; }

 private:
  void draw(bool last);

  std::string label_;
  uint64_t total_ = 0, done_ = 0;
  bool enabled_ = false, terminal_ = false, finished_ = false;
  std::FILE* out_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace vavilov
