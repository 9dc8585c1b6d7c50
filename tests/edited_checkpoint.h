#pragma once
// A temporary copy of a single-file fixture checkpoint with its safetensors header (and optionally its config.json)
// edited, for tests of how malformed checkpoints are reported.
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

namespace vavilov::test {

inline std::filesystem::path edited_checkpoint(const std::filesystem::path& fixture, const std::string& name,
                                               const std::function<void(nlohmann::json&)>& edit_header,
                                               const std::function<void(nlohmann::json&)>& edit_config = {}) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("vavilov_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ifstream config_in(fixture / "config.json");
  auto config = nlohmann::json::parse(config_in);
  if (edit_config) edit_config(config);
  std::ofstream(dir / "config.json") << config.dump(2);
  std::ifstream in(fixture / "model.safetensors", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t header_size;
  std::memcpy(&header_size, bytes.data(), 8);
  auto header = nlohmann::json::parse(bytes.substr(8, header_size));
  if (edit_header) edit_header(header);
  const std::string new_header = header.dump();
  const uint64_t new_size = new_header.size();
  std::ofstream out(dir / "model.safetensors", std::ios::binary);
  out.write(reinterpret_cast<const char*>(&new_size), 8);
  out << new_header << bytes.substr(8 + header_size);
  return dir;
}

}  // namespace vavilov::test
