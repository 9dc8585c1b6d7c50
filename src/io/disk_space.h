#pragma once
// Free space on the filesystem that will hold an output, checked before a long write starts rather than
// discovered as ENOSPC halfway through.
#include <cstdint>
#include <functional>
#include <string>

namespace vavilov {

// Bytes an unprivileged writer may still use on the filesystem holding `path` (statvfs f_bavail · f_frsize).
uint64_t free_bytes(const std::string& path);

// Throws, naming the directory and both sizes, when `needed` (plus a margin for filesystem metadata) exceeds
// `available`.
void check_enough_space(const std::string& directory, uint64_t needed, uint64_t available);

using FreeSpaceFunction = std::function<uint64_t(const std::string&)>;

}  // namespace vavilov
