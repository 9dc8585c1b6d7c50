#pragma once
// Where tests find committed fixtures and the shared data beside the repository.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace vavilov::test {

// The source tree the binary was built from, or $VAVILOV_SOURCE_DIR (binaries run from a copy, e.g. on the GPU machine).
inline std::filesystem::path source_dir() {
  const char* moved = std::getenv("VAVILOV_SOURCE_DIR");
  return moved && *moved ? moved : VAVILOV_SOURCE_DIR;
}
inline std::filesystem::path model_fixtures() { return source_dir() / "tests" / "fixtures" / "models"; }

inline std::filesystem::path mtp_fixtures() { return source_dir() / "tests" / "fixtures" / "models_mtp"; }

inline std::vector<std::filesystem::path> fixture_dirs(const std::filesystem::path& root) {
  std::vector<std::filesystem::path> dirs;
  if (std::filesystem::exists(root))
    for (const auto& entry : std::filesystem::directory_iterator(root))
      if (std::filesystem::exists(entry.path() / "reference.json")) dirs.push_back(entry.path());
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

// Trunk fixtures: the plain ones and those that also carry an MTP head.
inline std::vector<std::filesystem::path> model_fixture_dirs() {
  auto dirs = fixture_dirs(model_fixtures());
  auto with_mtp = fixture_dirs(mtp_fixtures());
  dirs.insert(dirs.end(), with_mtp.begin(), with_mtp.end());
  return dirs;
}

inline std::vector<float> read_floats(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<float> values(std::filesystem::file_size(path) / sizeof(float));
  in.read(reinterpret_cast<char*>(values.data()), std::streamsize(values.size() * sizeof(float)));
  return values;
}

}  // namespace vavilov::test
