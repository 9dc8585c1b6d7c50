#pragma once
// Where tests find committed fixtures and the shared data beside the repository.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace vavilov::test {

inline std::filesystem::path source_dir() { return VAVILOV_SOURCE_DIR; }
inline std::filesystem::path model_fixtures() { return source_dir() / "tests" / "fixtures" / "models"; }

inline std::vector<std::filesystem::path> model_fixture_dirs() {
  std::vector<std::filesystem::path> dirs;
  for (const auto& entry : std::filesystem::directory_iterator(model_fixtures()))
    if (std::filesystem::exists(entry.path() / "reference.json")) dirs.push_back(entry.path());
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

inline std::vector<float> read_floats(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<float> values(std::filesystem::file_size(path) / sizeof(float));
  in.read(reinterpret_cast<char*>(values.data()), std::streamsize(values.size() * sizeof(float)));
  return values;
}

}  // namespace vavilov::test
