#pragma once
// The `quantization` section of an MLX checkpoint's config.json (mlx-lm / mlx-vlm): a default affine bits and
// group size, and per-module overrides keyed by module path (the tensor name without `.weight`), each either
// `false` (the module stays dense) or its own {"bits", "group_size"}. `quantization_config` (top level or in
// text_config) is read when `quantization` is absent.
#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace vavilov {

struct QuantSpec {
  int bits = 4;
  int64_t group = 64;
};

struct MlxQuantization {
  QuantSpec defaults;
  std::map<std::string, std::optional<QuantSpec>> overrides;  // nullopt: `false`, the module is not quantized

  // The precision of a module (tensor name without `.weight`); nullopt when an override keeps it dense.
  std::optional<QuantSpec> for_module(const std::string& module) const;
};

// Parses the section from config.json text; nullopt when the checkpoint declares no quantization. Bad bits
// (MLX affine allows 2, 3, 4, 5, 6, 8), group sizes (32, 64, 128), modes other than "affine" or malformed entries
// are errors naming the file and field.
std::optional<MlxQuantization> parse_mlx_quantization(const std::string& config_text, const std::string& path);

// Reads DIRECTORY/config.json.
std::optional<MlxQuantization> load_mlx_quantization(const std::string& directory);

}  // namespace vavilov
