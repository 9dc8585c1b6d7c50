#include "io/staged_directory.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"

namespace vavilov {

namespace fs = std::filesystem;

namespace {
void sync_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  check(fd >= 0, "{}: cannot open directory to sync: {}", path, std::strerror(errno));
  int result = ::fsync(fd);
  int saved = errno;
  ::close(fd);
  check(result == 0, "{}: fsync failed: {}", path, std::strerror(saved));
}

std::string parent_of(const fs::path& target) {
  fs::path parent = target.parent_path();
  return parent.empty() ? "." : parent.string();
}
}  // namespace

StagedDirectory::StagedDirectory(std::string target) : target_(std::move(target)) {
  fs::path path = fs::path(target_).lexically_normal();
  if (!path.has_filename()) path = path.parent_path();  // "out/" names the directory "out"
  std::error_code error;
  check(!fs::exists(path, error), "{}: already exists; remove it or choose another output", target_);
  check(fs::is_directory(parent_of(path), error), "{}: parent directory {} does not exist", target_, parent_of(path));
  target_ = path.string();
  std::string name = fmt::format(".{}.partial-{}", path.filename().string(), ::getpid());
  staging_ = (fs::path(parent_of(path)) / name).string();
  fs::remove_all(staging_, error);  // a leftover of an earlier process with our pid, killed outright
  check(fs::create_directory(staging_, error), "{}: cannot create {}: {}", target_, staging_, error.message());
}

StagedDirectory::~StagedDirectory() {
  if (committed_) return;
  std::error_code ignored;
  fs::remove_all(staging_, ignored);
}

std::string StagedDirectory::staged_path(const std::string& name) const { return (fs::path(staging_) / name).string(); }

void StagedDirectory::commit() {
  sync_directory(staging_);
  check(std::rename(staging_.c_str(), target_.c_str()) == 0, "{}: cannot rename {} into place: {}", target_, staging_,
        std::strerror(errno));
  committed_ = true;
  sync_directory(parent_of(target_));
}

FileWriter::FileWriter(std::string path, std::string display_name)
    : path_(std::move(path)), display_name_(std::move(display_name)) {
  file_ = std::fopen(path_.c_str(), "wb");
  check(file_ != nullptr, "{}: cannot create: {}", display_name_, std::strerror(errno));
  std::setvbuf(file_, nullptr, _IOFBF, 1 << 20);
}

FileWriter::~FileWriter() {
  if (file_) std::fclose(file_);
}

void FileWriter::write(const void* data, size_t bytes) {
  check(file_ != nullptr, "{}: write after close", display_name_);
  if (bytes == 0) return;
  check(std::fwrite(data, 1, bytes, file_) == bytes, "{}: write failed at byte {}: {}", display_name_, offset_,
        std::strerror(errno));
  offset_ += bytes;
}

void FileWriter::pad_to(uint64_t alignment) {
  static const std::vector<char> zeros(1 << 16, 0);
  uint64_t padding = (alignment - offset_ % alignment) % alignment;
  while (padding > 0) {
    size_t chunk = size_t(std::min<uint64_t>(padding, zeros.size()));
    write(zeros.data(), chunk);
    padding -= chunk;
  }
}

void FileWriter::close() {
  if (!file_) return;
  bool ok = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  int saved = errno;
  ok = std::fclose(file_) == 0 && ok;
  file_ = nullptr;
  check(ok, "{}: flushing to disk failed: {}", display_name_, std::strerror(saved));
}

}  // namespace vavilov
