#include "bench_product_group.h"

#include "cuda/product_groups.h"

namespace vavilov::bench {

struct BenchProductGroup::Group {
  cuda::ProductGroup group;
};

BenchProductGroup::BenchProductGroup(const float* x, std::vector<std::pair<cuda::DeviceMatrix, float*>> products)
    : group_(std::make_unique<Group>(Group{cuda::make_product_group(x, std::move(products))})) {}

BenchProductGroup::~BenchProductGroup() = default;
BenchProductGroup::BenchProductGroup(BenchProductGroup&&) noexcept = default;

void BenchProductGroup::run(int rows, cudaStream_t stream) const { cuda::run_products(group_->group, rows, stream); }

}  // namespace vavilov::bench
