#include "model/mlx_quantization.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace vavilov {

using nlohmann::json;

namespace {

QuantSpec parse_spec(const json& entry, const QuantSpec& fallback, const std::string& path, const std::string& field) {
  check(entry.is_object(), "{}: {}: expected false or an object with bits and group_size", path, field);
  QuantSpec spec = fallback;
  if (entry.contains("mode")) {
    const json& mode = entry["mode"];
    check(mode.is_string() && mode.get<std::string>() == "affine",
          "{}: {}.mode: only MLX affine quantization is supported", path, field);
  }
  if (entry.contains("bits")) {
    const json& bits = entry["bits"];
    check(bits.is_number_integer(), "{}: {}.bits: expected an integer", path, field);
    spec.bits = bits.get<int>();
  }
  if (entry.contains("group_size")) {
    const json& group = entry["group_size"];
    check(group.is_number_integer(), "{}: {}.group_size: expected an integer", path, field);
    spec.group = group.get<int64_t>();
  }
  check(spec.bits >= 2 && spec.bits <= 8 && spec.bits != 7, "{}: {}.bits: {} is not an MLX affine width (2-6, 8)", path,
        field, spec.bits);
  check(spec.group == 32 || spec.group == 64 || spec.group == 128, "{}: {}.group_size: {} is not 32, 64 or 128", path,
        field, spec.group);
  return spec;
}

// mlx-lm writes `quantization` and mirrors it as `quantization_config`; a `quantization_config` with a
// `quant_method` belongs to another format (FP8, NVFP4, ...) and is not MLX's.
const json* find_section(const json& config) {
  if (config.contains("quantization")) return &config["quantization"];
  for (const json* scope : {&config, config.contains("text_config") ? &config["text_config"] : nullptr}) {
    if (scope == nullptr || !scope->is_object() || !scope->contains("quantization_config")) continue;
    const json& section = (*scope)["quantization_config"];
    if (section.is_object() && section.contains("quant_method")) return nullptr;
    return &section;
  }
  return nullptr;
}

}  // namespace

std::optional<QuantSpec> MlxQuantization::for_module(const std::string& module) const {
  auto it = overrides.find(module);
  return it == overrides.end() ? std::optional<QuantSpec>(defaults) : it->second;
}

std::optional<MlxQuantization> parse_mlx_quantization(const std::string& config_text, const std::string& path) {
  json config = json::parse(config_text, nullptr, false);
  check(!config.is_discarded() && config.is_object(), "{}: not a JSON object", path);
  const json* section = find_section(config);
  if (section == nullptr || section->is_null()) return std::nullopt;
  check(section->is_object(), "{}: quantization: expected an object", path);
  MlxQuantization out;
  out.defaults = parse_spec(*section, QuantSpec{}, path, "quantization");
  for (const auto& [key, value] : section->items()) {
    if (key == "bits" || key == "group_size" || key == "mode") continue;
    std::string field = "quantization[\"" + key + "\"]";
    if (value.is_boolean())
      out.overrides[key] = value.get<bool>() ? std::optional<QuantSpec>(out.defaults) : std::nullopt;
    else
      out.overrides[key] = parse_spec(value, out.defaults, path, field);
  }
  return out;
}

std::optional<MlxQuantization> load_mlx_quantization(const std::string& directory) {
  std::filesystem::path path = std::filesystem::path(directory) / "config.json";
  std::ifstream in(path, std::ios::binary);
  check(in.good(), "{}: cannot open the model config", path.string());
  std::stringstream text;
  text << in.rdbuf();
  return parse_mlx_quantization(text.str(), path.string());
}

}  // namespace vavilov
