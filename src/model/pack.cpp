#include "model/pack.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>

#include "core/error.h"
#include "core/interrupt.h"
#include "core/threads.h"
#include "io/checksum.h"
#include "io/packed_store.h"
#include "io/staged_directory.h"
#include "model/packed_model.h"
#include "model/quantize.h"

namespace vavilov {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr uint64_t kAlignment = 4096;      // tensors and records start on pages (mmap, O_DIRECT reads)
constexpr uint64_t kPartAlignment = 64;    // parts inside a record start on cache lines
constexpr size_t kWriteChunk = 64u << 20;  // large tensors are written, and interrupts polled, in pieces
const char* kDenseFile = "dense.bin";
const char* kNgramFile = "ngram.bin";

uint64_t align_up(uint64_t value, uint64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

// Asks the kernel to start reading mapped source bytes now, so reading the next piece overlaps with writing (or
// quantizing) this one instead of faulting page by page afterwards.
void prefetch(const void* data, size_t bytes) {
  constexpr uintptr_t kPage = 4096;
  auto begin = reinterpret_cast<uintptr_t>(data) & ~(kPage - 1);
  auto end = reinterpret_cast<uintptr_t>(data) + bytes;
  if (bytes > 0) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_WILLNEED);
}

struct Source {
  std::unique_ptr<Model> model;
  json config;
  std::vector<std::string> extra_files;  // full paths of files copied beside the store
};

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  check(in.good(), "{}: cannot read", path);
  json parsed = json::parse(in, nullptr, false);
  check(!parsed.is_discarded() && parsed.is_object(), "{}: not a JSON object", path);
  return parsed;
}

// The files a checkpoint directory carries beside its weights that the engine or a user reads: tokenizer, chat
// template, generation config, model card. Weights in other formats, test outputs and the like stay behind.
bool is_metadata_file(const std::string& name) {
  for (const char* suffix : {".json", ".jinja", ".txt", ".model", ".tiktoken", ".md"})
    if (name.ends_with(suffix)) return name != "model.safetensors.index.json";
  return false;
}

std::vector<std::string> checkpoint_extras(const std::string& directory) {
  std::vector<std::string> extras;
  for (const auto& entry : fs::directory_iterator(directory)) {
    std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && is_metadata_file(name)) extras.push_back(entry.path().string());
  }
  std::sort(extras.begin(), extras.end());
  return extras;
}

Source open_source(const std::string& path) {
  Source source;
  if (is_packed_store(path)) {
    source.model = load_packed_model(path, ExpertPrecision{});
    const Manifest& m = source.model->packed->manifest();
    source.config = m.config;
    for (const auto& extra : m.extra_files) source.extra_files.push_back((fs::path(path) / extra.name).string());
  } else {
    source.model = load_checkpoint(path);
    source.config = read_json_file((fs::path(path) / "config.json").string());
    source.extra_files = checkpoint_extras(path);
  }
  return source;
}

// --- planning -------------------------------------------------------------------------------------------------

struct ByteInterval {
  const std::byte* begin;
  const std::byte* end;
};

void add_matrix_bytes(const Matrix& m, std::vector<ByteInterval>& out) {
  for (std::span<const std::byte> range : m.storage()) out.push_back({range.data(), range.data() + range.size()});
}

// Every layer's routed experts, the MTP layer's last.
std::vector<const std::vector<FeedForwardWeights>*> expert_layers(const Model& model) {
  std::vector<const std::vector<FeedForwardWeights>*> layers;
  for (const auto& layer : model.layers) layers.push_back(&layer.moe.experts);
  if (model.mtp) layers.push_back(&model.mtp->layer.moe.experts);
  return layers;
}

// The routed experts' bytes as sorted, merged intervals: a source tensor lying wholly inside them (per-expert or
// fused experts alike) goes into expert records, not dense.bin.
std::vector<ByteInterval> expert_bytes(const Model& model) {
  std::vector<ByteInterval> intervals;
  for (const auto* experts : expert_layers(model))
    for (const auto& e : *experts)
      for (const Matrix* m : {&e.gate, &e.up, &e.down}) add_matrix_bytes(*m, intervals);
  std::sort(intervals.begin(), intervals.end(), [](auto& a, auto& b) { return a.begin < b.begin; });
  std::vector<ByteInterval> merged;
  for (const auto& i : intervals) {
    if (!merged.empty() && i.begin <= merged.back().end)
      merged.back().end = std::max(merged.back().end, i.end);
    else
      merged.push_back(i);
  }
  return merged;
}

bool inside(const std::vector<ByteInterval>& merged, const TensorView& view) {
  auto after = std::upper_bound(merged.begin(), merged.end(), view.data,
                                [](const std::byte* p, const ByteInterval& i) { return p < i.begin; });
  if (after == merged.begin()) return false;
  const ByteInterval& i = *(after - 1);
  return view.data >= i.begin && view.data + view.bytes <= i.end;
}

struct PlannedTensor {
  StoredTensor stored;
  const std::byte* data;
};

struct Plan {
  Manifest manifest;
  std::vector<PlannedTensor> dense, ngram;
  std::vector<std::string> extra_paths;
  uint64_t total_bytes = 0;
};

std::vector<PlannedTensor> lay_out(std::vector<const TensorView*> views, const std::string& file, uint64_t& size) {
  std::vector<PlannedTensor> planned;
  size = 0;
  for (const TensorView* v : views) {
    size = align_up(size, kAlignment);
    planned.push_back({StoredTensor{v->name, file, v->dtype, v->shape, size, v->bytes, 0}, v->data});
    size += v->bytes;
  }
  size = align_up(size, kAlignment);
  return planned;
}

void split_tensors(const Model& model, Plan& plan) {
  std::set<const std::byte*> table_shards;
  for (const auto& layer : model.layers)
    if (layer.ple)
      for (const auto& shard : layer.ple->table_shards) table_shards.insert(shard.data);
  std::vector<ByteInterval> experts = expert_bytes(model);
  std::vector<const TensorView*> dense, ngram;
  for (const auto& [name, view] : model.store->tensors()) {
    if (view.bytes > 0 && table_shards.count(view.data))
      ngram.push_back(&view);
    else if (view.bytes == 0 || !inside(experts, view))
      dense.push_back(&view);
  }
  uint64_t dense_size = 0, ngram_size = 0;
  plan.dense = lay_out(dense, kDenseFile, dense_size);
  plan.manifest.files.push_back({kDenseFile, dense_size});
  if (!ngram.empty()) {
    plan.ngram = lay_out(ngram, kNgramFile, ngram_size);
    plan.manifest.files.push_back({kNgramFile, ngram_size});
  }
}

RecordPart add_part(ExpertFile& file, uint64_t& offset, std::string matrix, std::string kind, DType dtype,
                    std::vector<int64_t> shape) {
  uint64_t bytes = dtype_size(dtype);
  for (int64_t d : shape) bytes *= uint64_t(d);
  offset = align_up(offset, kPartAlignment);
  RecordPart part{std::move(matrix), std::move(kind), dtype, std::move(shape), offset, bytes};
  offset += bytes;
  file.parts.push_back(part);
  return part;
}

// One record's parts: gate, up, down in that order; codes, scales, biases of each side by side.
ExpertFile plan_expert_file(int bits, DType dense_dtype, const ModelConfig& c, int layers) {
  ExpertFile file;
  file.bits = bits;
  file.dtype = bits ? DType::BF16 : dense_dtype;
  file.file = expert_file_name(bits, dense_dtype);
  const int64_t h = c.hidden_size, inner = c.moe_intermediate_size;
  uint64_t offset = 0;
  for (auto [matrix, rows, cols] : {std::tuple{"gate", inner, h}, {"up", inner, h}, {"down", h, inner}}) {
    if (bits == 0) {
      add_part(file, offset, matrix, "weight", dense_dtype, {rows, cols});
      continue;
    }
    add_part(file, offset, matrix, "codes", DType::U32, {rows, cols * bits / 32});
    add_part(file, offset, matrix, "scales", DType::BF16, {rows, cols / kQuantGroup});
    add_part(file, offset, matrix, "biases", DType::BF16, {rows, cols / kQuantGroup});
  }
  file.record_bytes = align_up(offset, kAlignment);
  for (int layer = 0; layer < layers; ++layer)
    for (int e = 0; e < c.num_experts; ++e)
      file.records.push_back({layer, e, uint64_t(layer * c.num_experts + e) * file.record_bytes, 0});
  return file;
}

std::string bits_name(int bits) { return bits ? fmt::format("{}", bits) : "dense"; }

// The source experts' dtype, the same for all; quantizing needs whole groups of 64 columns.
DType check_experts_packable(const Model& model, const std::vector<int>& bits_list) {
  const ModelConfig& c = model.config;
  check(c.num_experts > 0 && !model.layers.empty(), "{}: the model has no routed experts to pack", model.directory);
  const Matrix& first = model.layers.front().moe.experts.front().gate;
  for (const auto* experts : expert_layers(model))
    for (const auto& e : *experts)
      for (const Matrix* m : {&e.gate, &e.up, &e.down})
        check(m->dtype == first.dtype && m->bits == first.bits, "{}: expert matrix {} is {}/{} bits, {} is {}/{} bits",
              model.directory, m->name, dtype_name(m->dtype), m->bits, first.name, dtype_name(first.dtype), first.bits);
  std::set<int> seen;
  for (int bits : bits_list) {
    check(seen.insert(bits).second, "--experts: precision {} is given twice", bits_name(bits));
    check(bits == 0 || bits == 2 || bits == 3 || bits == 4, "--experts: {} is not 4, 3, 2 or dense", bits);
    check(bits != 0 || !first.quantized(), "--experts dense: the source experts are already {}-bit quantized",
          first.bits);
    check(bits == 0 || (c.hidden_size % kQuantGroup == 0 && c.moe_intermediate_size % kQuantGroup == 0),
          "--experts {}: expert matrices are [{} x {}] and [{} x {}]; quantizing needs columns in multiples of {} "
          "(use --experts dense)",
          bits, c.moe_intermediate_size, c.hidden_size, c.hidden_size, c.moe_intermediate_size, kQuantGroup);
  }
  check(!bits_list.empty(), "--experts: give at least one precision");
  return first.dtype;
}

Plan make_plan(const Source& source, const PackOptions& options) {
  const Model& model = *source.model;
  Plan plan;
  plan.manifest.alignment = kAlignment;
  plan.manifest.config = source.config;
  split_tensors(model, plan);
  DType expert_dtype = check_experts_packable(model, options.expert_bits);
  int layers = int(expert_layers(model).size());
  for (int bits : options.expert_bits) {
    ExpertFile file = plan_expert_file(bits, expert_dtype, model.config, layers);
    plan.manifest.files.push_back({file.file, file.record_bytes * file.records.size()});
    plan.manifest.experts.push_back(std::move(file));
  }
  for (const auto& f : plan.manifest.files) plan.total_bytes += f.bytes;
  for (const auto& path : source.extra_files) {
    uint64_t bytes = fs::file_size(path);
    plan.manifest.extra_files.push_back({fs::path(path).filename().string(), bytes, 0});
    plan.extra_paths.push_back(path);
    plan.total_bytes += bytes;
  }
  return plan;
}

// --- writing --------------------------------------------------------------------------------------------------

class Writer {
 public:
  Writer(StagedDirectory& out, Progress& progress, const PackOptions& options)
      : out_(out), progress_(progress), options_(options) {}

  void poll() const {
    bool stop = options_.interrupted ? options_.interrupted() : interrupt_requested();
    check(!stop, "{}: interrupted; the partial store was removed", out_.target());
  }

  void write(FileWriter& file, const void* data, size_t bytes) {
    const auto* p = static_cast<const std::byte*>(data);
    for (size_t done = 0; done < bytes;) {
      poll();
      size_t chunk = std::min(kWriteChunk, bytes - done);
      prefetch(p + done + chunk, std::min(kWriteChunk, bytes - done - chunk));
      file.write(p + done, chunk);
      progress_.add(chunk);
      done += chunk;
    }
  }

  void pad(FileWriter& file, uint64_t alignment) {
    uint64_t before = file.offset();
    file.pad_to(alignment);
    progress_.add(file.offset() - before);
  }

  std::unique_ptr<FileWriter> open(const std::string& name) {
    return std::make_unique<FileWriter>(out_.staged_path(name), out_.target() + "/" + name);
  }

  void write_tensors(const std::string& name, std::vector<PlannedTensor>& tensors, uint64_t size) {
    auto file = open(name);
    for (size_t i = 0; i < tensors.size(); ++i) {
      PlannedTensor& t = tensors[i];
      if (i + 1 < tensors.size())
        prefetch(tensors[i + 1].data, std::min<size_t>(tensors[i + 1].stored.bytes, kWriteChunk));
      pad(*file, kAlignment);
      write(*file, t.data, t.stored.bytes);
      t.stored.checksum = checksum(t.data, t.stored.bytes);
    }
    pad(*file, kAlignment);
    check(file->offset() == size, "{}: wrote {} bytes, planned {}", name, file->offset(), size);
    file->close();
  }

 private:
  StagedDirectory& out_;
  Progress& progress_;
  const PackOptions& options_;
};

// A matrix at `bits`: its own codes when already at that precision (bit for bit), else quantized from fp32.
QuantizedRows quantized(const Matrix& m, int bits, std::vector<float>& scratch) {
  if (m.bits == bits && m.group64_affine()) {
    QuantizedRows q;
    size_t words = size_t(m.rows) * m.row_bytes() / 4, groups = size_t(m.rows) * size_t(m.cols / kQuantGroup);
    q.codes.resize(words);
    std::memcpy(q.codes.data(), m.data, words * 4);
    q.scales.assign(m.scales, m.scales + groups);
    q.biases.assign(m.biases, m.biases + groups);
    return q;
  }
  scratch.resize(size_t(m.rows * m.cols));
  parallel_for(size_t(m.rows), 16, [&](size_t begin, size_t end) {
    for (auto r = int64_t(begin); r < int64_t(end); ++r) {
      if (m.quantized())
        dequantize_row(m, r, scratch.data() + r * m.cols);
      else
        to_f32(m.dtype, m.row(r), scratch.data() + r * m.cols, size_t(m.cols));
    }
  });
  return quantize_rows(scratch.data(), m.rows, m.cols, bits);
}

void fill_record(const ExpertFile& file, const FeedForwardWeights& expert, std::vector<std::byte>& record,
                 std::vector<float>& scratch) {
  std::fill(record.begin(), record.end(), std::byte{0});
  for (auto [name, matrix] : {std::pair{"gate", &expert.gate}, {"up", &expert.up}, {"down", &expert.down}}) {
    if (file.bits == 0) {
      const RecordPart& w = *file.part(name, "weight");
      std::memcpy(record.data() + w.offset, matrix->data, w.bytes);
      continue;
    }
    QuantizedRows q = quantized(*matrix, file.bits, scratch);
    const RecordPart &codes = *file.part(name, "codes"), &scales = *file.part(name, "scales"),
                     &biases = *file.part(name, "biases");
    std::memcpy(record.data() + codes.offset, q.codes.data(), codes.bytes);
    std::memcpy(record.data() + scales.offset, q.scales.data(), scales.bytes);
    std::memcpy(record.data() + biases.offset, q.biases.data(), biases.bytes);
  }
}

void prefetch_expert(const FeedForwardWeights& expert) {
  std::vector<ByteInterval> ranges;
  for (const Matrix* m : {&expert.gate, &expert.up, &expert.down}) add_matrix_bytes(*m, ranges);
  for (const auto& r : ranges) prefetch(r.begin, size_t(r.end - r.begin));
}

// All expert files are written in one pass over the experts, each expert read (and converted) once.
void write_experts(Writer& writer, const Model& model, Manifest& manifest) {
  std::vector<std::unique_ptr<FileWriter>> files;
  std::vector<std::vector<std::byte>> records;
  for (const auto& e : manifest.experts) {
    files.push_back(writer.open(e.file));
    records.emplace_back(e.record_bytes);
  }
  std::vector<const FeedForwardWeights*> order;
  for (const auto* experts : expert_layers(model))
    for (const auto& expert : *experts) order.push_back(&expert);
  std::vector<float> scratch;
  for (size_t index = 0; index < order.size(); ++index) {
    const FeedForwardWeights& expert = *order[index];
    if (index + 1 < order.size()) prefetch_expert(*order[index + 1]);
    for (size_t f = 0; f < manifest.experts.size(); ++f) {
      ExpertFile& file = manifest.experts[f];
      fill_record(file, expert, records[f], scratch);
      file.records[index].checksum = checksum(records[f].data(), records[f].size());
      writer.write(*files[f], records[f].data(), records[f].size());
    }
  }
  for (auto& f : files) f->close();
}

void copy_extras(Writer& writer, Plan& plan) {
  for (size_t i = 0; i < plan.extra_paths.size(); ++i) {
    MappedFile source(plan.extra_paths[i]);
    ExtraFile& extra = plan.manifest.extra_files[i];
    check(source.size() == extra.bytes, "{}: changed size while packing", source.path());
    auto file = writer.open(extra.name);
    writer.write(*file, source.data(), source.size());
    extra.checksum = checksum(source.data(), source.size());
    file->close();
  }
}

std::string parent_directory(const std::string& out) {
  fs::path parent = fs::path(out).lexically_normal().parent_path();
  if (!fs::path(out).lexically_normal().has_filename()) parent = parent.parent_path();
  return parent.empty() ? "." : parent.string();
}

}  // namespace

PackSummary pack_model(const std::string& model_path, const std::string& out, const PackOptions& options) {
  auto start = std::chrono::steady_clock::now();
  Source source = open_source(model_path);
  Plan plan = make_plan(source, options);
  std::string parent = parent_directory(out);
  StagedDirectory staged(out);  // refuses an existing output before the space check can mislead
  check_enough_space(parent, plan.total_bytes, options.free_space(parent));
  Progress progress("packing " + staged.target(), plan.total_bytes, options.progress);
  Writer writer(staged, progress, options);
  writer.write_tensors(kDenseFile, plan.dense, plan.manifest.files[0].bytes);
  for (auto& t : plan.dense) plan.manifest.tensors.push_back(t.stored);
  if (!plan.ngram.empty()) {
    writer.write_tensors(kNgramFile, plan.ngram, plan.manifest.file(kNgramFile)->bytes);
    for (auto& t : plan.ngram) plan.manifest.tensors.push_back(t.stored);
  }
  write_experts(writer, *source.model, plan.manifest);
  copy_extras(writer, plan);
  writer.poll();
  std::string manifest = manifest_to_json(plan.manifest);
  parse_manifest(manifest, out + "/" + std::string(kManifestName));  // what we write, we can read back
  auto manifest_file = writer.open(std::string(kManifestName));
  manifest_file->write(manifest.data(), manifest.size());
  manifest_file->close();
  staged.commit();
  progress.finish();
  return {plan.total_bytes + manifest.size(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

}  // namespace vavilov
