#pragma once
// Matrix products that read the same activations (a layer's GDN or attention input projections, a hyper-connection
// read's mix_down and inject, PLE's key and value projections) as one grouped GEMV launch per weight format for passes
// of 1–4 rows, instead of one launch per matrix. Input and output addresses are fixed workspace memory for the
// sequence's life, so the descriptors are written to the device once, when the sequence is made; running a group
// allocates nothing and never synchronises (graph-capturable). Longer passes (prefill) and matrices the GEMV kernels
// do not read take cuda::linear, one product each.
#include <cuda_runtime.h>

#include <utility>
#include <vector>

#include "cuda/device_model.h"

namespace vavilov::cuda {

// Whether the grouped GEMV kernels read m: Q4 in whole groups with 8-byte aligned codes and a width whose activations
// fit their shared-memory staging at 4 rows, or BF16 with 16-byte aligned rows of a multiple of 8 columns.
bool gemv_reads(const DeviceMatrix& m);

// y = W·x for each (W, y) of a group, all W with the same columns.
struct ProductGroup {
  const float* x = nullptr;
  int cols = 0;
  DeviceAllocation descriptors;  // Q4 products, then BF16 ones (GemvMatrix)
  int q4_count = 0, bf16_count = 0, q4_max_rows = 0, bf16_max_rows = 0;
  std::vector<int> q4_rows;  // each Q4 product's height (the grouped launch's grid holds only their row blocks)
  std::vector<std::pair<DeviceMatrix, float*>> products;  // every product, for passes of more rows
  std::vector<std::pair<DeviceMatrix, float*>> others;    // products in formats the GEMV kernels do not read
};

// Writes the descriptors of the group's GEMV-readable products to the device (a format with a single product keeps
// linear()'s by-value launch, whose work split fits that one matrix). Synchronous: call once per sequence.
ProductGroup make_product_group(const float* x, std::vector<std::pair<DeviceMatrix, float*>> products);

// Every product of the group for `rows` rows of x.
void run_products(const ProductGroup& group, int rows, cudaStream_t stream);

}  // namespace vavilov::cuda
