// libFuzzer target for parse_manifest, the packed store's manifest.json parser. Only vavilov::Error may escape;
// anything else (nlohmann exceptions, sanitizer reports) is a finding. An accepted manifest is re-checked against
// the invariants the loader relies on (every range inside its file, aligned, sized by shape and dtype, no two
// ranges of one file overlapping), so accepting a bad manifest is a finding too.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.h"
#include "io/packed_store.h"

namespace {

uint64_t shape_bytes(const std::vector<int64_t>& shape, vavilov::DType dtype) {
  uint64_t n = vavilov::dtype_size(dtype);
  for (int64_t d : shape) {
    if (d < 0) std::abort();
    n *= uint64_t(d);  // dimensions below 2^31, at most 8: cannot wrap once accepted
  }
  return n;
}

void check_invariants(const vavilov::Manifest& m) {
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> ranges;
  for (const auto& t : m.tensors) {
    const vavilov::StoreFile* file = m.file(t.file);
    if (!file || t.offset % m.alignment || t.offset > file->bytes || t.bytes > file->bytes - t.offset) std::abort();
    if (shape_bytes(t.shape, t.dtype) != t.bytes) std::abort();
    ranges[t.file].push_back({t.offset, t.offset + t.bytes});
  }
  for (const auto& e : m.experts) {
    const vavilov::StoreFile* file = m.file(e.file);
    if (!file || e.record_bytes == 0 || e.record_bytes % m.alignment) std::abort();
    for (const char* matrix : {"gate", "up", "down"})
      if (!e.part(matrix, e.bits ? "codes" : "weight")) std::abort();
    for (const auto& p : e.parts)
      if (p.offset > e.record_bytes || p.bytes > e.record_bytes - p.offset || shape_bytes(p.shape, p.dtype) != p.bytes)
        std::abort();
    for (const auto& r : e.records) {
      if (r.offset % m.alignment || r.offset > file->bytes || e.record_bytes > file->bytes - r.offset) std::abort();
      ranges[e.file].push_back({r.offset, r.offset + e.record_bytes});
    }
  }
  for (auto& [file, list] : ranges) {
    if (list.size() > 512) continue;  // quadratic; keep iterations fast
    for (const auto& a : list)
      for (const auto& b : list)
        if (&a != &b && a.first < a.second && b.first < b.second && a.first < b.second && b.first < a.second)
          std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    check_invariants(vavilov::parse_manifest(text, "fuzz/manifest.json"));
  } catch (const vavilov::Error&) {
  }
  return 0;
}
