#include "cuda/product_groups.h"

#include <algorithm>

#include "cuda/linear.cuh"
#include "cuda/moe.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kMaxStagedCols = 12288;  // 4.125 · 4 rows · cols bytes of shared memory must fit (gemv.cuh)

bool has_format(const std::vector<std::pair<DeviceMatrix, float*>>& products, WeightFormat format) {
  return std::count_if(products.begin(), products.end(),
                       [&](const auto& p) { return p.first.format == format && gemv_reads(p.first); }) > 1;
}

}  // namespace

bool gemv_reads(const DeviceMatrix& m) {
  const auto address = reinterpret_cast<uintptr_t>(m.data);
  if (m.format == WeightFormat::Q4) return m.cols % kQuantGroup == 0 && m.cols <= kMaxStagedCols && address % 8 == 0;
  if (m.format == WeightFormat::BF16) return m.cols % 8 == 0 && address % 16 == 0;
  return false;
}

ProductGroup make_product_group(const float* x, std::vector<std::pair<DeviceMatrix, float*>> products) {
  ProductGroup group;
  group.x = x;
  group.cols = products.empty() ? 0 : products.front().first.cols;
  const bool aligned =
      reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
      std::all_of(products.begin(), products.end(), [&](const auto& p) { return p.first.cols == group.cols; });
  // Only formats with two or more products gain from a grouped launch.
  const bool group_q4 = aligned && has_format(products, WeightFormat::Q4);
  const bool group_bf16 = aligned && has_format(products, WeightFormat::BF16);
  std::vector<GemvMatrix> q4, bf16;
  for (const auto& [m, y] : products) {
    const bool readable = gemv_reads(m);
    if (readable && group_q4 && m.format == WeightFormat::Q4) {
      q4.push_back(gemv_matrix(m, x, y));
      group.q4_rows.push_back(m.rows);
      group.q4_max_rows = std::max(group.q4_max_rows, m.rows);
    } else if (readable && group_bf16 && m.format == WeightFormat::BF16) {
      bf16.push_back(gemv_matrix(m, x, y));
      group.bf16_max_rows = std::max(group.bf16_max_rows, m.rows);
    } else {
      group.others.emplace_back(m, y);
    }
  }
  group.q4_count = int(q4.size());
  group.bf16_count = int(bf16.size());
  q4.insert(q4.end(), bf16.begin(), bf16.end());
  if (!q4.empty()) {
    const size_t bytes = q4.size() * sizeof(GemvMatrix);
    group.descriptors = device_alloc(bytes, "product group");
    cuda_check(cudaMemcpy(group.descriptors.get(), q4.data(), bytes, cudaMemcpyHostToDevice), "product group");
  }
  group.products = std::move(products);
  return group;
}

void run_products(const ProductGroup& group, int rows, cudaStream_t stream) {
  if (rows == 0) return;
  if (rows > kMaxGemvRows) {
    for (const auto& [m, y] : group.products) linear(m, group.x, rows, y, stream);
    return;
  }
  // Written once when the sequence was made: the GEMV kernels may read them before the previous kernel ends.
  const auto* descriptors = static_cast<const GemvMatrix*>(group.descriptors.get());
  constexpr auto fixed = GemvDescriptors::fixed;
  if (group.q4_count)
    cuda_check(
        gemv_q4_fixed(descriptors, group.q4_rows.data(), group.q4_count, group.q4_max_rows, group.cols, rows, stream),
        "grouped products");
  if (group.bf16_count)
    cuda_check(
        gemv_bf16(descriptors + group.q4_count, group.bf16_count, group.bf16_max_rows, group.cols, rows, stream, fixed),
        "grouped products");
  for (const auto& [m, y] : group.others) linear(m, group.x, rows, y, stream);
}

}  // namespace vavilov::cuda
