#pragma once
// An output directory built under a temporary name beside its target and renamed into place only when complete:
// a failed or interrupted job (an exception unwinding past it) leaves neither a half-written result nor the
// temporary directory behind.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace vavilov {

class StagedDirectory {
 public:
  // Fails when `target` already exists or its parent directory does not.
  explicit StagedDirectory(std::string target);
  ~StagedDirectory();  // removes the temporary directory unless committed
  StagedDirectory(const StagedDirectory&) = delete;
  StagedDirectory& operator=(const StagedDirectory&) = delete;

  // Where a file named `name` is written before the commit.
  std::string staged_path(const std::string& name) const;
  const std::string& target() const { return target_; }
  // Syncs the directory, renames it to the target and syncs the parent so the rename itself is durable.
  void commit();

 private:
  std::string target_, staging_;
  bool committed_ = false;
};

// A file written front to back with explicit padding; every failure (ENOSPC included) is an error naming the file.
// close() flushes and fsyncs; a file never closed is simply abandoned with its staging directory.
class FileWriter {
 public:
  FileWriter(std::string path, std::string display_name);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  uint64_t offset() const { return offset_; }
  void write(const void* data, size_t bytes);
  void pad_to(uint64_t alignment);  // zero bytes up to the next multiple of `alignment`
  void close();

 private:
  std::string path_, display_name_;
  std::FILE* file_ = nullptr;
  uint64_t offset_ = 0;
};

}  // namespace vavilov
