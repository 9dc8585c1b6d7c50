#pragma once
// Writes a whole output file or nothing: data goes to a temporary file beside the target, renamed on success.
#include <cstddef>
#include <string>

namespace vavilov {

void write_file_atomically(const std::string& path, const void* data, size_t bytes);

}  // namespace vavilov
