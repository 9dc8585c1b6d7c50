#pragma once
// The packed store: a model laid out for streaming routed experts. A directory holding
//   manifest.json      format name and version, the model config, and where every byte lives (below)
//   dense.bin          every tensor except routed experts and the n-gram table, each aligned, mmappable
//   ngram.bin          the PLE n-gram table (absent when the model has none)
//   experts-<p>.bin    one fixed-size aligned record per (layer, expert) with that expert's gate, up and down
//                      (codes, scales, biases) side by side; one file per precision p (q4, q3, q2, or the
//                      checkpoint's float dtype, e.g. bf16)
//   tokenizer files etc. copied from the checkpoint directory
// A file may hold records for only some experts, so mixed precision per expert is a matter of which file holds
// which (layer, expert). The MTP head's layer has index config.num_layers. docs/PACKED_STORE.md has the schema.
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/progress.h"
#include "io/mapped_file.h"
#include "io/safetensors.h"

namespace vavilov {

inline constexpr std::string_view kStoreFormat = "vavilov-packed-store";
inline constexpr int kStoreVersion = 1;
inline constexpr std::string_view kManifestName = "manifest.json";

// A data file of the store and its exact size.
struct StoreFile {
  std::string name;
  uint64_t bytes = 0;
};

// A file copied beside the store (tokenizer, chat template), checked as a whole.
struct ExtraFile {
  std::string name;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
};

struct StoredTensor {
  std::string name, file;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t offset = 0, bytes = 0;
  uint64_t checksum = 0;
};

// One piece of every record in an expert file: `matrix` gate/up/down, `kind` codes/scales/biases (quantized)
// or weight (dense); offset is relative to the record's start.
struct RecordPart {
  std::string matrix, kind;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t offset = 0, bytes = 0;
};

struct ExpertRecord {
  int layer = 0, expert = 0;
  uint64_t offset = 0;
  uint64_t checksum = 0;
};

struct ExpertFile {
  std::string file;
  int bits = 0;               // 4, 3, 2; 0: dense in `dtype`
  DType dtype = DType::BF16;  // dense element type, or the type of scales and biases
  uint64_t record_bytes = 0;
  std::vector<RecordPart> parts;
  std::vector<ExpertRecord> records;

  const RecordPart* part(std::string_view matrix, std::string_view kind) const;
};

struct Manifest {
  int version = kStoreVersion;
  uint64_t alignment = 4096;  // of every tensor and record offset
  nlohmann::json config;      // config.json of the checkpoint, as it was
  std::vector<StoreFile> files;
  std::vector<ExtraFile> extra_files;
  std::vector<StoredTensor> tensors;
  std::vector<ExpertFile> experts;

  const StoreFile* file(std::string_view name) const;
};

// Name of an expert file: experts-q4.bin, or experts-bf16.bin for dense records.
std::string expert_file_name(int bits, DType dense_dtype);

// Parses and validates the manifest text: structure, types, version, names, alignment, every range inside its
// file, no overlaps. `source` names the file in errors, which also name the field.
Manifest parse_manifest(std::string_view text, std::string_view source);
std::string manifest_to_json(const Manifest& manifest);

// True when `path` is a directory with a manifest.json (a store rather than a checkpoint).
bool is_packed_store(const std::string& path);

// An open store: manifest parsed, every data file mapped and its size checked against the manifest.
class PackedStore {
 public:
  explicit PackedStore(const std::string& directory);

  const Manifest& manifest() const { return manifest_; }
  const std::string& directory() const { return directory_; }
  // Dense and n-gram tensors under their checkpoint names.
  std::map<std::string, TensorView> tensor_views() const;
  const std::byte* record_data(const ExpertFile& file, const ExpertRecord& record) const;

 private:
  const MappedFile& mapped(const std::string& name) const;

  std::string directory_;
  Manifest manifest_;
  std::map<std::string, std::unique_ptr<MappedFile>> files_;
};

// Recomputes every checksum of the store in `directory` (tensors, expert records, extra files). Returns one line
// per mismatch, naming the file and the tensor or record; empty when all match.
std::vector<std::string> verify_store(const std::string& directory, ProgressMode progress);

}  // namespace vavilov
