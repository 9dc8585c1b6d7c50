// The prefill GEMMs' precision (and the GDN prefill's products): fp32 unless VAVILOV_GEMM_PRECISION names another
// (for measurements, gemm.cuh).
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "cuda/gemm.cuh"

namespace vavilov::cuda {

namespace {

GemmPrecision from_environment() {
  const char* value = std::getenv("VAVILOV_GEMM_PRECISION");
  const std::string name = value ? value : "fp32";
  if (name == "fp32") return GemmPrecision::Fp32;
  if (name == "tf32") return GemmPrecision::Tf32;
  if (name == "bf16") return GemmPrecision::Bf16;
  fail("VAVILOV_GEMM_PRECISION={}: expected fp32, tf32 or bf16", name);
}

GemmPrecision& current() {
  static GemmPrecision precision = from_environment();
  return precision;
}

}  // namespace

GemmPrecision gemm_precision() { return current(); }

void set_gemm_precision(GemmPrecision precision) { current() = precision; }

}  // namespace vavilov::cuda
