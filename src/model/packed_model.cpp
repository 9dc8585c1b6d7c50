#include "model/packed_model.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "io/packed_store.h"

namespace vavilov {

namespace {

const std::vector<int> kMostPreciseFirst = {kDensePrecision, 4, 3, 2};
// Loads below the first size page in silently; above the second they report outside a terminal too.
constexpr uint64_t kVisibleLoadBytes = 256ull << 20;
constexpr uint64_t kLargeLoadBytes = 1ull << 30;

std::string precision_name(int bits) { return bits == kDensePrecision ? "dense" : fmt::format("q{}", bits); }

// Records of every expert file, indexed by (layer, expert) for the lookups below.
using RecordIndex = std::map<std::pair<int, int>, std::vector<std::pair<const ExpertFile*, const ExpertRecord*>>>;

RecordIndex index_records(const Manifest& m) {
  RecordIndex index;
  for (const auto& e : m.experts)
    for (const auto& r : e.records) index[{r.layer, r.expert}].push_back({&e, &r});
  return index;
}

std::pair<const ExpertFile*, const ExpertRecord*> choose_record(const RecordIndex& index,
                                                                const ExpertPrecision& precision, int layer, int expert,
                                                                const std::string& store) {
  auto found = index.find({layer, expert});
  auto with_bits = [&](int bits) -> std::pair<const ExpertFile*, const ExpertRecord*> {
    if (found == index.end()) return {nullptr, nullptr};
    for (const auto& candidate : found->second)
      if (candidate.first->bits == bits) return candidate;
    return {nullptr, nullptr};
  };
  auto exact = precision.per_expert.find({layer, expert});
  if (exact != precision.per_expert.end()) {
    auto chosen = with_bits(exact->second);
    check(chosen.first != nullptr, "{}: layer {} expert {}: no {} record in the store", store, layer, expert,
          precision_name(exact->second));
    return chosen;
  }
  for (int bits : precision.preference.empty() ? kMostPreciseFirst : precision.preference) {
    auto chosen = with_bits(bits);
    if (chosen.first) return chosen;
  }
  std::string wanted;
  for (int bits : precision.preference) wanted += (wanted.empty() ? "" : ", ") + precision_name(bits);
  fail("{}: layer {} expert {}: no record{} in the store", store, layer, expert,
       wanted.empty() ? "" : " in precision " + wanted);
}

// The record's part for one matrix as the engine's Matrix, its logical shape checked against the config.
Matrix record_matrix(const PackedStore& store, const ExpertFile& file, const ExpertRecord& record,
                     const std::string& matrix, int64_t rows, int64_t cols) {
  const std::byte* base = store.record_data(file, record);
  std::string name =
      fmt::format("{}/{}[layer {} expert {}].{}", store.directory(), file.file, record.layer, record.expert, matrix);
  if (file.bits == kDensePrecision) {
    const RecordPart& w = *file.part(matrix, "weight");
    check(w.shape == std::vector<int64_t>{rows, cols}, "{}: expected shape [{}, {}], the manifest's parts say [{}, {}]",
          name, rows, cols, w.shape[0], w.shape[1]);
    return Matrix{name, file.dtype, rows, cols, base + w.offset};
  }
  const RecordPart &codes = *file.part(matrix, "codes"), &scales = *file.part(matrix, "scales"),
                   &biases = *file.part(matrix, "biases");
  check(cols % kQuantGroup == 0 && scales.shape == std::vector<int64_t>{rows, cols / kQuantGroup},
        "{}: expected a [{}, {}] matrix, the manifest's scales are [{}, {}]", name, rows, cols, scales.shape[0],
        scales.shape[1]);
  return Matrix{name,
                file.dtype,
                rows,
                cols,
                base + codes.offset,
                file.bits,
                reinterpret_cast<const uint16_t*>(base + scales.offset),
                reinterpret_cast<const uint16_t*>(base + biases.offset)};
}

std::vector<FeedForwardWeights> layer_experts(const PackedStore& store, const RecordIndex& index,
                                              const ExpertPrecision& precision, const ModelConfig& c, int layer) {
  std::vector<FeedForwardWeights> experts;
  const int64_t h = c.hidden_size, inner = c.moe_intermediate_size;
  for (int e = 0; e < c.num_experts; ++e) {
    auto [file, record] = choose_record(index, precision, layer, e, store.directory());
    check(file->dtype == DType::BF16 || file->bits == kDensePrecision,
          "{}: {}: quantized experts need BF16 scales and biases, the manifest says {}", store.directory(), file->file,
          dtype_name(file->dtype));
    experts.push_back({record_matrix(store, *file, *record, "gate", inner, h),
                       record_matrix(store, *file, *record, "up", inner, h),
                       record_matrix(store, *file, *record, "down", h, inner)});
  }
  return experts;
}

// Every (layer, expert) the manifest lists must be one the model has.
void check_record_range(const Manifest& m, const ModelConfig& c, bool has_mtp, const std::string& store) {
  const int layers = c.num_layers + (has_mtp ? 1 : 0);
  for (const auto& e : m.experts)
    for (const auto& r : e.records)
      check(r.layer < layers && r.expert < c.num_experts,
            "{}: {}: record layer {} expert {} is outside the model ({} layers with experts, {} experts each)", store,
            e.file, r.layer, r.expert, layers, c.num_experts);
}

}  // namespace

std::unique_ptr<Model> load_packed_model(const std::string& directory, const ExpertPrecision& precision) {
  auto store = std::make_shared<PackedStore>(directory);
  const Manifest& m = store->manifest();
  auto model = std::make_unique<Model>();
  model->directory = directory;
  std::string manifest_path = (std::filesystem::path(directory) / kManifestName).string();
  model->config = parse_model_config(m.config.dump(), manifest_path + ": config");
  model->store = std::make_unique<TensorStore>(directory, store->tensor_views());
  read_weights(*model, false);
  check_record_range(m, model->config, model->mtp.has_value(), directory);
  RecordIndex index = index_records(m);
  for (int i = 0; i < model->config.num_layers; ++i)
    model->layers[size_t(i)].moe.experts = layer_experts(*store, index, precision, model->config, i);
  if (model->mtp)
    model->mtp->layer.moe.experts = layer_experts(*store, index, precision, model->config, model->config.num_layers);
  model->packed = std::move(store);
  return model;
}

namespace {

struct ByteRange {
  const std::byte* data;
  size_t bytes;
};

std::vector<ByteRange> weight_ranges(Model& model) {
  std::vector<ByteRange> ranges;
  for_each_matrix(model, [&](Matrix& m) {
    for (std::span<const std::byte> range : m.storage()) ranges.push_back({range.data(), range.size()});
  });
  for (const auto& layer : model.layers)
    if (layer.ple)
      for (const auto& shard : layer.ple->table_shards)
        ranges.push_back({shard.data, size_t(shard.rows) * shard.row_bytes()});
  return ranges;
}

// Touches one byte per page; the kernel's readahead (asked for up front) turns this into large sequential reads.
uint64_t touch_pages(const ByteRange& range) {
  constexpr size_t kPage = 4096;
  auto address = reinterpret_cast<uintptr_t>(range.data);
  uintptr_t aligned = address & ~uintptr_t(kPage - 1);
  ::madvise(reinterpret_cast<void*>(aligned), range.bytes + (address - aligned), MADV_WILLNEED);
  uint64_t sum = 0;
  for (size_t offset = 0; offset < range.bytes; offset += kPage) sum += uint64_t(range.data[offset]);
  return sum;
}

}  // namespace

void page_in_weights(Model& model, ProgressMode mode) {
  std::vector<ByteRange> ranges = weight_ranges(model);
  uint64_t total = 0;
  for (const auto& r : ranges) total += r.bytes;
  if (mode == ProgressMode::Terminal && total < kVisibleLoadBytes) mode = ProgressMode::Quiet;
  if (mode == ProgressMode::Terminal && total >= kLargeLoadBytes) mode = ProgressMode::Auto;
  Progress progress("loading " + model.directory, total, mode);
  constexpr size_t kChunk = 64u << 20;  // progress granularity
  volatile uint64_t sink = 0;
  for (const auto& r : ranges)
    for (size_t offset = 0; offset < r.bytes; offset += kChunk) {
      ByteRange piece{r.data + offset, std::min(kChunk, r.bytes - offset)};
      sink = sink + touch_pages(piece);
      progress.add(piece.bytes);
    }
  progress.finish();
}

}  // namespace vavilov
