#include "io/disk_space.h"

#include <sys/statvfs.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/progress.h"

namespace vavilov {

namespace {
// Directory entries, inodes and partial blocks cost a little beyond the data itself.
constexpr uint64_t kMetadataMargin = 16ull << 20;
}  // namespace

uint64_t free_bytes(const std::string& path) {
  struct statvfs info {};
  check(::statvfs(path.c_str(), &info) == 0, "{}: cannot query free space: {}", path, std::strerror(errno));
  return uint64_t(info.f_bavail) * uint64_t(info.f_frsize);
}

void check_enough_space(const std::string& directory, uint64_t needed, uint64_t available) {
  check(needed + kMetadataMargin <= available,
        "{}: not enough free space: the output needs {} ({} bytes) plus {} of headroom, the filesystem has {} "
        "({} bytes) free",
        directory, format_bytes(double(needed)), needed, format_bytes(double(kMetadataMargin)),
        format_bytes(double(available)), available);
}

}  // namespace vavilov
