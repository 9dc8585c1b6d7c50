// libFuzzer target for parse_safetensors_header. The first 8 bytes of the input are the size of the data
// section (little-endian), the rest is the header JSON, so the fuzzer steers offsets against the data size.
// Only vavilov::Error may escape; anything else (nlohmann exceptions, sanitizer reports) is a finding. An
// accepted header is re-checked against the format's invariants, so a wrong "valid" answer is a finding too.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "core/error.h"
#include "io/safetensors.h"

namespace {

void check_invariants(const std::vector<vavilov::TensorEntry>& entries, uint64_t data_size) {
  for (const auto& e : entries) {
    if (e.begin > e.end || e.end > data_size) std::abort();
    uint64_t numel = 1;
    for (int64_t d : e.shape) {
      if (d < 0) std::abort();
      numel *= uint64_t(d);  // cannot wrap for an accepted entry unless a dimension is zero
    }
    if (numel * vavilov::dtype_size(e.dtype) != e.end - e.begin) std::abort();
  }
  for (const auto& a : entries)
    for (const auto& b : entries)
      if (&a != &b && a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t data_size = 0;
  std::memcpy(&data_size, data, 8);
  std::string_view header(reinterpret_cast<const char*>(data) + 8, size - 8);
  try {
    auto entries = vavilov::parse_safetensors_header(header, data_size, "fuzz.safetensors");
    if (entries.size() < 256) check_invariants(entries, data_size);  // quadratic; keep iterations fast
  } catch (const vavilov::Error&) {
  }
  return 0;
}
