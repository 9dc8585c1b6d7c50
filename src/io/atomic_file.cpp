#include "io/atomic_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace vavilov {

void write_file_atomically(const std::string& path, const void* data, size_t bytes) {
  std::string temporary = path + ".tmp." + std::to_string(::getpid());
  std::FILE* file = std::fopen(temporary.c_str(), "wb");
  check(file != nullptr, "{}: cannot write: {}", path, std::strerror(errno));
  bool ok = std::fwrite(data, 1, bytes, file) == bytes;
  ok = (std::fflush(file) == 0) && ok;
  ok = (::fsync(::fileno(file)) == 0) && ok;
  ok = (std::fclose(file) == 0) && ok;
  if (!ok || std::rename(temporary.c_str(), path.c_str()) != 0) {
    int saved = errno;
    std::filesystem::remove(temporary);
    fail("{}: write failed: {}", path, std::strerror(saved));
  }
}

}  // namespace vavilov
