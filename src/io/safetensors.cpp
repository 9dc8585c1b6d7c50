#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace vavilov {

using nlohmann::json;

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::shape_string() const {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

namespace {

uint64_t checked_numel(const std::vector<int64_t>& shape, std::string_view file, const std::string& name) {
  for (int64_t d : shape) check(d >= 0, "{}: tensor {}: negative dimension {}", file, name, d);
  // Any zero dimension makes an empty tensor, however large the others are.
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  uint64_t n = 1;
  for (int64_t d : shape) {
    check(n <= std::numeric_limits<uint64_t>::max() / uint64_t(d), "{}: tensor {}: shape overflows", file, name);
    n *= uint64_t(d);
  }
  return n;
}

TensorEntry parse_entry(const std::string& name, const json& info, uint64_t data_size, std::string_view file) {
  check(info.is_object(), "{}: tensor {}: header entry is not an object", file, name);
  check(info.contains("dtype") && info["dtype"].is_string(), "{}: tensor {}: missing dtype", file, name);
  check(info.contains("shape") && info["shape"].is_array(), "{}: tensor {}: missing shape", file, name);
  check(info.contains("data_offsets") && info["data_offsets"].is_array() && info["data_offsets"].size() == 2,
        "{}: tensor {}: data_offsets must be [begin, end]", file, name);
  TensorEntry entry{name, DType::F32, {}, 0, 0};
  std::string dtype = info["dtype"].get<std::string>();
  check(dtype_from_name(dtype, entry.dtype), "{}: tensor {}: unsupported dtype {}", file, name, dtype);
  for (const auto& d : info["shape"]) {
    check(d.is_number_integer(), "{}: tensor {}: shape entries must be integers", file, name);
    check(!d.is_number_unsigned() || d.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()),
          "{}: tensor {}: shape dimension {} is too large", file, name, d.get<uint64_t>());
    entry.shape.push_back(d.get<int64_t>());
  }
  for (const auto& o : info["data_offsets"])
    check(o.is_number_unsigned(), "{}: tensor {}: data_offsets must be non-negative integers", file, name);
  entry.begin = info["data_offsets"][0].get<uint64_t>();
  entry.end = info["data_offsets"][1].get<uint64_t>();
  check(entry.begin <= entry.end && entry.end <= data_size,
        "{}: tensor {}: data_offsets [{}, {}] outside the {} data bytes (truncated file?)", file, name, entry.begin,
        entry.end, data_size);
  uint64_t numel = checked_numel(entry.shape, file, name);
  uint64_t element = dtype_size(entry.dtype);
  check(numel <= std::numeric_limits<uint64_t>::max() / element && numel * element == entry.end - entry.begin,
        "{}: tensor {}: shape/dtype need {} bytes but data_offsets give {}", file, name, numel * element,
        entry.end - entry.begin);
  return entry;
}

// Empty tensors own no bytes, so they may sit anywhere (even inside another tensor's range). Every non-empty
// tensor is compared with the one reaching furthest so far, not only its sorted neighbour, so an empty tensor
// between two overlapping ones cannot hide the overlap.
void check_no_overlap(const std::vector<TensorEntry>& entries, std::string_view file) {
  std::vector<const TensorEntry*> by_offset;
  for (const auto& e : entries)
    if (e.begin != e.end) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  const TensorEntry* furthest = nullptr;
  for (const TensorEntry* e : by_offset) {
    check(!furthest || e->begin >= furthest->end, "{}: tensors {} and {} overlap", file, furthest ? furthest->name : "",
          e->name);
    if (!furthest || e->end > furthest->end) furthest = e;
  }
}

// A shard must be a plain file name inside the model directory.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name.find('/') == std::string::npos && name.find('\\') == std::string::npos &&
         name.find("..") == std::string::npos;
}

}  // namespace

std::vector<TensorEntry> parse_safetensors_header(std::string_view header_json, uint64_t data_size,
                                                  std::string_view file) {
  json header = json::parse(header_json.begin(), header_json.end(), nullptr, false);
  check(!header.is_discarded(), "{}: header is not valid JSON", file);
  check(header.is_object(), "{}: header is not a JSON object", file);
  std::vector<TensorEntry> entries;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      check(info.is_object(), "{}: __metadata__ must be an object", file);
      continue;
    }
    entries.push_back(parse_entry(name, info, data_size, file));
  }
  check_no_overlap(entries, file);
  return entries;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : map_(path) {
  check(map_.size() >= 8, "{}: truncated: {} bytes, no header", path, map_.size());
  uint64_t header_size = 0;
  std::memcpy(&header_size, map_.data(), 8);  // little-endian hosts only, as all our targets are
  check(header_size <= map_.size() - 8, "{}: header length {} exceeds the file size {} (truncated file?)", path,
        header_size, map_.size());
  std::string_view header(reinterpret_cast<const char*>(map_.data()) + 8, header_size);
  data_ = map_.data() + 8 + header_size;
  entries_ = parse_safetensors_header(header, map_.size() - 8 - header_size, path);
}

TensorView SafetensorsFile::view(const TensorEntry& entry) const {
  return TensorView{entry.name, map_.path(), entry.dtype, entry.shape, data_ + entry.begin, entry.end - entry.begin};
}

TensorStore::TensorStore(const std::string& directory) : directory_(directory) {
  namespace fs = std::filesystem;
  fs::path dir(directory);
  check(fs::is_directory(dir), "{}: not a model directory", directory);
  fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    std::ifstream in(index);
    json parsed = json::parse(in, nullptr, false);
    check(!parsed.is_discarded() && parsed.is_object(), "{}: not valid JSON", index.string());
    check(parsed.contains("weight_map") && parsed["weight_map"].is_object(), "{}: missing weight_map", index.string());
    std::set<std::string> shards;
    for (const auto& [name, file] : parsed["weight_map"].items()) {
      check(file.is_string(), "{}: weight_map[{}] is not a file name", index.string(), name);
      std::string shard = file.get<std::string>();
      check(is_plain_file_name(shard), "{}: weight_map[{}] names a file outside the directory: {}", index.string(),
            name, shard);
      shards.insert(shard);
    }
    for (const auto& shard : shards) add_file((dir / shard).string());
    for (const auto& [name, file] : parsed["weight_map"].items()) {
      std::string shard = (dir / file.get<std::string>()).string();
      auto it = tensors_.find(name);
      check(it != tensors_.end() && it->second.file == shard, "{}: tensor {} listed in the index is missing from {}",
            index.string(), name, shard);
    }
  } else {
    fs::path single = dir / "model.safetensors";
    check(fs::exists(single), "{}: no model.safetensors or model.safetensors.index.json", directory);
    add_file(single.string());
  }
}

void TensorStore::add_file(const std::string& path) {
  files_.push_back(std::make_unique<SafetensorsFile>(path));
  const auto& file = *files_.back();
  for (const auto& entry : file.entries()) {
    auto [it, inserted] = tensors_.emplace(entry.name, file.view(entry));
    check(inserted, "{}: tensor {} also appears in {}", path, entry.name, it->second.file);
  }
}

const TensorView* TensorStore::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const TensorView& TensorStore::get(const std::string& name) const {
  const TensorView* view = find(name);
  check(view != nullptr, "{}: missing tensor {}", directory_, name);
  return *view;
}

}  // namespace vavilov
