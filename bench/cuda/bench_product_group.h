#pragma once
// cuda::ProductGroup for the GEMV benchmark, whose .cu builds as C++17 while product_groups.h needs the engine's C++20
// headers: the same grouped launches the decode step makes (sequence.cpp), behind a C++17 interface.
#include <cuda_runtime.h>

#include <memory>
#include <utility>
#include <vector>

#include "cuda/device_matrix.h"

namespace vavilov::bench {

class BenchProductGroup {
 public:
  // y = W·x for each (W, y), all W with the same columns (cuda::make_product_group).
  BenchProductGroup(const float* x, std::vector<std::pair<cuda::DeviceMatrix, float*>> products);
  ~BenchProductGroup();
  BenchProductGroup(BenchProductGroup&&) noexcept;
  // Every product for `rows` rows of x (cuda::run_products).
  void run(int rows, cudaStream_t stream) const;

 private:
  struct Group;
  std::unique_ptr<Group> group_;
};

}  // namespace vavilov::bench
