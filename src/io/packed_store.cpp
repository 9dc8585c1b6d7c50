#include "io/packed_store.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "core/error.h"
#include "io/checksum.h"

namespace vavilov {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMaxAlignment = 1ull << 30;
constexpr uint64_t kPartAlignment = 64;  // within a record: whole cache lines, 16-byte GPU loads
constexpr uint64_t kMaxManifestBytes = 1ull << 30;

// Field access with errors naming the manifest and the field's path ("experts[1].records[7].offset").
class Fields {
 public:
  Fields(const json& object, std::string path, std::string_view source)
      : object_(object), path_(std::move(path)), source_(source) {
    check(object.is_object(), "{}: {}: expected an object", source_, path_);
  }

  std::string where(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }

  const json& get(std::string_view key) const {
    auto it = object_.find(key);
    check(it != object_.end(), "{}: {}: missing", source_, where(key));
    return *it;
  }
  uint64_t u64(std::string_view key) const {
    const json& value = get(key);
    check(value.is_number_unsigned(), "{}: {}: expected a non-negative integer", source_, where(key));
    return value.get<uint64_t>();
  }
  int integer(std::string_view key, int min, int max) const {
    const json& value = get(key);
    check(value.is_number_integer() &&
              (value.is_number_unsigned() ? value.get<uint64_t>() <= uint64_t(max)
                                          : value.get<int64_t>() >= min && value.get<int64_t>() <= max),
          "{}: {}: expected an integer in [{}, {}]", source_, where(key), min, max);
    return int(value.get<int64_t>());
  }
  std::string string(std::string_view key) const {
    const json& value = get(key);
    check(value.is_string(), "{}: {}: expected a string", source_, where(key));
    return value.get<std::string>();
  }
  const json& array(std::string_view key) const {
    const json& value = get(key);
    check(value.is_array(), "{}: {}: expected an array", source_, where(key));
    return value;
  }
  DType dtype(std::string_view key) const {
    std::string name = string(key);
    DType dtype;
    check(dtype_from_name(name, dtype), "{}: {}: unknown dtype {}", source_, where(key), name);
    return dtype;
  }
  uint64_t checksum(std::string_view key) const {
    uint64_t value = 0;
    check(parse_checksum_hex(string(key), value), "{}: {}: expected 16 lowercase hex digits", source_, where(key));
    return value;
  }
  std::vector<int64_t> shape(std::string_view key) const {
    std::vector<int64_t> shape;
    for (const json& d : array(key)) {
      check(d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t(std::numeric_limits<int32_t>::max()),
            "{}: {}: dimensions must be integers in [0, 2^31)", source_, where(key));
      shape.push_back(d.get<int64_t>());
    }
    check(shape.size() <= 8, "{}: {}: more than 8 dimensions", source_, where(key));
    return shape;
  }

 private:
  const json& object_;
  std::string path_;
  std::string_view source_;
};

std::string item_path(std::string_view array, size_t index) { return fmt::format("{}[{}]", array, index); }

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name.size() <= 255 && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
}

// Bytes a tensor of this shape and dtype needs; fails on overflow (dimensions are below 2^31, at most 8 of them).
uint64_t tensor_bytes(const std::vector<int64_t>& shape, DType dtype, std::string_view source,
                      const std::string& where) {
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape) {
    check(d == 0 || n <= std::numeric_limits<uint64_t>::max() / uint64_t(d), "{}: {}: size overflows", source, where);
    n *= uint64_t(d);
  }
  return n;
}

bool fits(uint64_t offset, uint64_t bytes, uint64_t size) { return offset <= size && bytes <= size - offset; }

struct Range {
  uint64_t begin, end;
  std::string what;
};

// No two non-empty ranges of one file may share a byte.
void check_disjoint(std::vector<Range> ranges, std::string_view source, const std::string& file) {
  std::erase_if(ranges, [](const Range& r) { return r.begin == r.end; });
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i)
    check(ranges[i].begin >= ranges[i - 1].end, "{}: {} and {} overlap in {}", source, ranges[i - 1].what,
          ranges[i].what, file);
}

std::vector<StoreFile> parse_files(const Fields& top, std::string_view source) {
  std::vector<StoreFile> files;
  std::set<std::string> names;
  const json& array = top.array("files");
  for (size_t i = 0; i < array.size(); ++i) {
    Fields f(array[i], item_path("files", i), source);
    StoreFile file{f.string("name"), f.u64("bytes")};
    check(is_plain_file_name(file.name) && file.name != kManifestName, "{}: {}: not a plain file name: {}", source,
          f.where("name"), file.name);
    check(names.insert(file.name).second, "{}: {}: file {} is listed twice", source, f.where("name"), file.name);
    files.push_back(file);
  }
  return files;
}

std::vector<ExtraFile> parse_extra_files(const Fields& top, std::string_view source, const Manifest& m) {
  std::vector<ExtraFile> extras;
  const json& array = top.array("extra_files");
  std::set<std::string> names;
  for (size_t i = 0; i < array.size(); ++i) {
    Fields f(array[i], item_path("extra_files", i), source);
    ExtraFile extra{f.string("name"), f.u64("bytes"), f.checksum("xxh3")};
    check(is_plain_file_name(extra.name) && extra.name != kManifestName && !m.file(extra.name) &&
              names.insert(extra.name).second,
          "{}: {}: not a plain file name, or one already used: {}", source, f.where("name"), extra.name);
    extras.push_back(extra);
  }
  return extras;
}

const StoreFile& data_file(const Manifest& m, const Fields& f, std::string_view source) {
  std::string name = f.string("file");
  const StoreFile* file = m.file(name);
  check(file != nullptr, "{}: {}: {} is not listed in files", source, f.where("file"), name);
  return *file;
}

std::vector<StoredTensor> parse_tensors(const Fields& top, std::string_view source, const Manifest& m) {
  std::vector<StoredTensor> tensors;
  std::set<std::string> names;
  const json& array = top.array("tensors");
  for (size_t i = 0; i < array.size(); ++i) {
    Fields f(array[i], item_path("tensors", i), source);
    StoredTensor t;
    t.name = f.string("name");
    check(!t.name.empty() && names.insert(t.name).second, "{}: {}: empty or repeated tensor name '{}'", source,
          f.where("name"), t.name);
    const StoreFile& file = data_file(m, f, source);
    t.file = file.name;
    t.dtype = f.dtype("dtype");
    t.shape = f.shape("shape");
    t.offset = f.u64("offset");
    t.bytes = f.u64("bytes");
    t.checksum = f.checksum("xxh3");
    uint64_t needed = tensor_bytes(t.shape, t.dtype, source, f.where("shape"));
    check(t.bytes == needed, "{}: {}: tensor {} needs {} bytes for its shape and dtype, bytes says {}", source,
          f.where("bytes"), t.name, needed, t.bytes);
    check(t.offset % m.alignment == 0, "{}: {}: tensor {} offset {} is not a multiple of the alignment {}", source,
          f.where("offset"), t.name, t.offset, m.alignment);
    check(fits(t.offset, t.bytes, file.bytes), "{}: {}: tensor {} bytes [{}, +{}) lie outside {} ({} bytes)", source,
          f.where("offset"), t.name, t.offset, t.bytes, file.name, file.bytes);
    tensors.push_back(std::move(t));
  }
  return tensors;
}

// The parts every record must have, and how their shapes relate: codes [rows, cols·bits/32] (U32), scales and
// biases [rows, cols/64] (the file's dtype); dense weights [rows, cols] (the file's dtype).
void check_part_set(const ExpertFile& e, std::string_view source, const std::string& where) {
  for (const char* matrix : {"gate", "up", "down"}) {
    if (e.bits == 0) {
      const RecordPart* w = e.part(matrix, "weight");
      check(w && w->dtype == e.dtype && w->shape.size() == 2, "{}: {}: needs a {} weight part of dtype {}, 2-D", source,
            where, matrix, dtype_name(e.dtype));
      continue;
    }
    const RecordPart *codes = e.part(matrix, "codes"), *scales = e.part(matrix, "scales"),
                     *biases = e.part(matrix, "biases");
    check(codes && scales && biases, "{}: {}: {} needs codes, scales and biases parts", source, where, matrix);
    check(codes->dtype == DType::U32 && scales->dtype == e.dtype && biases->dtype == e.dtype,
          "{}: {}: {} parts must be U32 codes and {} scales and biases", source, where, matrix, dtype_name(e.dtype));
    check(codes->shape.size() == 2 && scales->shape == biases->shape && scales->shape.size() == 2 &&
              codes->shape[0] == scales->shape[0] && codes->shape[1] * 32 == scales->shape[1] * 64 * e.bits,
          "{}: {}: {} codes shape and scales/biases shapes do not describe one {}-bit matrix with groups of 64", source,
          where, matrix, e.bits);
  }
}

std::vector<RecordPart> parse_parts(const Fields& ef, std::string_view source, const ExpertFile& e) {
  std::vector<RecordPart> parts;
  const json& array = ef.array("parts");
  std::set<std::pair<std::string, std::string>> seen;
  std::vector<Range> ranges;
  for (size_t i = 0; i < array.size(); ++i) {
    Fields f(array[i], ef.where(item_path("parts", i)), source);
    RecordPart p{f.string("matrix"), f.string("kind"), f.dtype("dtype"),
                 f.shape("shape"),   f.u64("offset"),  f.u64("bytes")};
    bool known_matrix = p.matrix == "gate" || p.matrix == "up" || p.matrix == "down";
    bool known_kind =
        e.bits == 0 ? p.kind == "weight" : (p.kind == "codes" || p.kind == "scales" || p.kind == "biases");
    check(known_matrix && known_kind && seen.emplace(p.matrix, p.kind).second,
          "{}: {}: unknown or repeated part {} {} for a {}-bit file", source, f.where("kind"), p.matrix, p.kind,
          e.bits);
    check(p.bytes == tensor_bytes(p.shape, p.dtype, source, f.where("shape")),
          "{}: {}: part size does not match its shape and dtype", source, f.where("bytes"));
    check(p.offset % kPartAlignment == 0 && fits(p.offset, p.bytes, e.record_bytes),
          "{}: {}: part must start at a multiple of {} and lie inside the {}-byte record", source, f.where("offset"),
          kPartAlignment, e.record_bytes);
    ranges.push_back({p.offset, p.offset + p.bytes, fmt::format("part {} {}", p.matrix, p.kind)});
    parts.push_back(std::move(p));
  }
  check_disjoint(ranges, source, "a record of " + e.file);
  return parts;
}

ExpertFile parse_expert_file(const json& item, const std::string& path, std::string_view source, const Manifest& m) {
  Fields f(item, path, source);
  ExpertFile e;
  e.file = data_file(m, f, source).name;
  e.bits = f.integer("bits", 0, 8);
  check(e.bits == 0 || e.bits == 2 || e.bits == 3 || e.bits == 4, "{}: {}: {} bits is not supported (4, 3, 2 or 0)",
        source, f.where("bits"), e.bits);
  e.dtype = f.dtype("dtype");
  check(is_float(e.dtype), "{}: {}: expected a float dtype", source, f.where("dtype"));
  e.record_bytes = f.u64("record_bytes");
  check(e.record_bytes > 0 && e.record_bytes % m.alignment == 0,
        "{}: {}: must be a positive multiple of the alignment {}", source, f.where("record_bytes"), m.alignment);
  e.parts = parse_parts(f, source, e);
  check_part_set(e, source, f.where("parts"));
  const json& records = f.array("records");
  std::set<std::pair<int, int>> seen;
  const uint64_t file_bytes = m.file(e.file)->bytes;
  for (size_t i = 0; i < records.size(); ++i) {
    Fields r(records[i], f.where(item_path("records", i)), source);
    ExpertRecord record{r.integer("layer", 0, 1 << 20), r.integer("expert", 0, 1 << 20), r.u64("offset"),
                        r.checksum("xxh3")};
    check(seen.emplace(record.layer, record.expert).second, "{}: {}: layer {} expert {} appears twice in {}", source,
          r.where("expert"), record.layer, record.expert, e.file);
    check(record.offset % m.alignment == 0 && fits(record.offset, e.record_bytes, file_bytes),
          "{}: {}: record at {} must be aligned to {} and lie inside {} ({} bytes)", source, r.where("offset"),
          record.offset, m.alignment, e.file, file_bytes);
    e.records.push_back(record);
  }
  return e;
}

void check_layout(const Manifest& m, std::string_view source) {
  std::map<std::string, std::vector<Range>> by_file;
  for (const auto& t : m.tensors) by_file[t.file].push_back({t.offset, t.offset + t.bytes, "tensor " + t.name});
  std::set<std::string> expert_files;
  for (const auto& e : m.experts) {
    check(expert_files.insert(e.file).second, "{}: experts: {} is described twice", source, e.file);
    for (const auto& r : e.records)
      by_file[e.file].push_back(
          {r.offset, r.offset + e.record_bytes, fmt::format("record layer {} expert {}", r.layer, r.expert)});
  }
  for (auto& [file, ranges] : by_file) check_disjoint(std::move(ranges), source, file);
}

}  // namespace

const RecordPart* ExpertFile::part(std::string_view matrix, std::string_view kind) const {
  for (const auto& p : parts)
    if (p.matrix == matrix && p.kind == kind) return &p;
  return nullptr;
}

const StoreFile* Manifest::file(std::string_view name) const {
  for (const auto& f : files)
    if (f.name == name) return &f;
  return nullptr;
}

std::string expert_file_name(int bits, DType dense_dtype) {
  if (bits != 0) return fmt::format("experts-q{}.bin", bits);
  std::string name(dtype_name(dense_dtype));
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return "experts-" + name + ".bin";
}

Manifest parse_manifest(std::string_view text, std::string_view source) {
  json parsed = json::parse(text.begin(), text.end(), nullptr, false);
  check(!parsed.is_discarded(), "{}: not valid JSON", source);
  Fields top(parsed, "", source);
  check(top.string("format") == kStoreFormat, "{}: format: expected \"{}\", this is not a packed store", source,
        kStoreFormat);
  Manifest m;
  m.version = top.integer("version", 0, std::numeric_limits<int>::max());
  check(m.version == kStoreVersion,
        "{}: version: store version {} is not supported (this build reads version {}); "
        "pack the checkpoint again",
        source, m.version, kStoreVersion);
  check(top.string("checksum") == kChecksumAlgorithm, "{}: checksum: expected \"{}\"", source, kChecksumAlgorithm);
  m.alignment = top.u64("alignment");
  check(m.alignment >= kPartAlignment && m.alignment <= kMaxAlignment && (m.alignment & (m.alignment - 1)) == 0,
        "{}: alignment: expected a power of two in [{}, {}], got {}", source, kPartAlignment, kMaxAlignment,
        m.alignment);
  m.config = top.get("config");
  check(m.config.is_object(), "{}: config: expected the model's config.json object", source);
  m.files = parse_files(top, source);
  m.extra_files = parse_extra_files(top, source, m);
  m.tensors = parse_tensors(top, source, m);
  const json& experts = top.array("experts");
  for (size_t i = 0; i < experts.size(); ++i)
    m.experts.push_back(parse_expert_file(experts[i], item_path("experts", i), source, m));
  check_layout(m, source);
  return m;
}

std::string manifest_to_json(const Manifest& m) {
  json files = json::array(), extras = json::array(), tensors = json::array(), experts = json::array();
  for (const auto& f : m.files) files.push_back({{"name", f.name}, {"bytes", f.bytes}});
  for (const auto& f : m.extra_files)
    extras.push_back({{"name", f.name}, {"bytes", f.bytes}, {"xxh3", checksum_hex(f.checksum)}});
  for (const auto& t : m.tensors)
    tensors.push_back({{"name", t.name},
                       {"file", t.file},
                       {"dtype", dtype_name(t.dtype)},
                       {"shape", t.shape},
                       {"offset", t.offset},
                       {"bytes", t.bytes},
                       {"xxh3", checksum_hex(t.checksum)}});
  for (const auto& e : m.experts) {
    json parts = json::array(), records = json::array();
    for (const auto& p : e.parts)
      parts.push_back({{"matrix", p.matrix},
                       {"kind", p.kind},
                       {"dtype", dtype_name(p.dtype)},
                       {"shape", p.shape},
                       {"offset", p.offset},
                       {"bytes", p.bytes}});
    for (const auto& r : e.records)
      records.push_back(
          {{"layer", r.layer}, {"expert", r.expert}, {"offset", r.offset}, {"xxh3", checksum_hex(r.checksum)}});
    experts.push_back({{"file", e.file},
                       {"bits", e.bits},
                       {"dtype", dtype_name(e.dtype)},
                       {"record_bytes", e.record_bytes},
                       {"parts", parts},
                       {"records", records}});
  }
  json out = {{"format", kStoreFormat},   {"version", m.version}, {"checksum", kChecksumAlgorithm},
              {"alignment", m.alignment}, {"config", m.config},   {"files", files},
              {"extra_files", extras},    {"tensors", tensors},   {"experts", experts}};
  return out.dump(1);
}

bool is_packed_store(const std::string& path) {
  std::error_code error;
  return fs::is_regular_file(fs::path(path) / kManifestName, error);
}

PackedStore::PackedStore(const std::string& directory) : directory_(directory) {
  std::string manifest_path = (fs::path(directory) / kManifestName).string();
  std::error_code error;
  uint64_t size = fs::file_size(manifest_path, error);
  check(!error, "{}: cannot read: {}", manifest_path, error.message());
  check(size <= kMaxManifestBytes, "{}: {} bytes is too large for a manifest", manifest_path, size);
  std::ifstream in(manifest_path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  check(in.good() || in.eof(), "{}: cannot read", manifest_path);
  manifest_ = parse_manifest(text.str(), manifest_path);
  for (const auto& file : manifest_.files) {
    std::string path = (fs::path(directory) / file.name).string();
    auto mapped = std::make_unique<MappedFile>(path);
    check(mapped->size() == file.bytes, "{}: {} bytes, but {} says {} (truncated or replaced file?)", path,
          mapped->size(), manifest_path, file.bytes);
    files_.emplace(file.name, std::move(mapped));
  }
}

const MappedFile& PackedStore::mapped(const std::string& name) const { return *files_.at(name); }

std::map<std::string, TensorView> PackedStore::tensor_views() const {
  std::map<std::string, TensorView> views;
  for (const auto& t : manifest_.tensors) {
    const MappedFile& file = mapped(t.file);
    views.emplace(t.name, TensorView{t.name, file.path(), t.dtype, t.shape, file.data() + t.offset, t.bytes});
  }
  return views;
}

const std::byte* PackedStore::record_data(const ExpertFile& file, const ExpertRecord& record) const {
  return mapped(file.file).data() + record.offset;
}

std::vector<std::string> verify_store(const std::string& directory, ProgressMode progress_mode) {
  PackedStore store(directory);
  const Manifest& m = store.manifest();
  uint64_t total = 0;
  for (const auto& t : m.tensors) total += t.bytes;
  for (const auto& e : m.experts) total += e.record_bytes * e.records.size();
  for (const auto& x : m.extra_files) total += x.bytes;
  Progress progress("verifying " + directory, total, progress_mode);
  std::vector<std::string> problems;
  auto compare = [&](const std::byte* data, uint64_t bytes, uint64_t expected, const std::string& what) {
    uint64_t actual = checksum(data, bytes);
    if (actual != expected)
      problems.push_back(fmt::format("{}: checksum mismatch: manifest {}, data {}", what, checksum_hex(expected),
                                     checksum_hex(actual)));
    progress.add(bytes);
  };
  const auto views = store.tensor_views();
  for (const auto& t : m.tensors) {
    const TensorView& view = views.at(t.name);
    compare(view.data, view.bytes, t.checksum, fmt::format("{}: tensor {}", view.file, t.name));
  }
  for (const auto& e : m.experts)
    for (const auto& r : e.records)
      compare(store.record_data(e, r), e.record_bytes, r.checksum,
              fmt::format("{}: record layer {} expert {}", (fs::path(directory) / e.file).string(), r.layer, r.expert));
  for (const auto& x : m.extra_files) {
    std::string path = (fs::path(directory) / x.name).string();
    MappedFile file(path);
    if (file.size() != x.bytes)
      problems.push_back(fmt::format("{}: {} bytes, manifest says {}", path, file.size(), x.bytes));
    else
      compare(file.data(), file.size(), x.checksum, path);
  }
  progress.finish();
  return problems;
}

}  // namespace vavilov
