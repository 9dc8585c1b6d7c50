#pragma once
// The safetensors format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
// shape and byte range, then the data. Checkpoints are one file or shards listed by
// model.safetensors.index.json. Everything is validated before any byte of data is used.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "io/mapped_file.h"

namespace vavilov {

struct TensorView {
  std::string name;
  std::string file;  // where it came from, for error messages
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t bytes = 0;

  int64_t numel() const;
  int64_t dim(size_t i) const { return shape.at(i); }
  std::string shape_string() const;
};

struct TensorEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;  // byte range inside the data section
};

// Parses and validates a header against the size of the file it came from. `file` names it in errors.
std::vector<TensorEntry> parse_safetensors_header(std::string_view header_json, uint64_t data_size,
                                                  std::string_view file);

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::vector<TensorEntry>& entries() const { return entries_; }
  TensorView view(const TensorEntry& entry) const;
  const std::string& path() const { return map_.path(); }

 private:
  MappedFile map_;
  const std::byte* data_ = nullptr;
  std::vector<TensorEntry> entries_;
};

// All tensors of a model directory by name.
class TensorStore {
 public:
  explicit TensorStore(const std::string& directory);
  // Tensors whose memory someone else keeps mapped (a packed store); `directory` names them in errors.
  TensorStore(std::string directory, std::map<std::string, TensorView> tensors)
      : directory_(std::move(directory)), tensors_(std::move(tensors)) {}

  const TensorView* find(const std::string& name) const;
  const TensorView& get(const std::string& name) const;  // throws naming the tensor and directory
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::string& directory() const { return directory_; }

 private:
  void add_file(const std::string& path);

  std::string directory_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorView> tensors_;
};

}  // namespace vavilov
