#pragma once
// The MoE decode block's scratch buffers for the GPU MoE tests, sized for `rows` rows of a shape.
#include "cuda/moe_block.h"
#include "device_matrices.h"

namespace vavilov::test {

inline cuda::MoeBuffers make_moe_buffers(DeviceMemory& memory, const cuda::MoeShape& shape, int rows) {
  const size_t r = size_t(rows), top_k = size_t(shape.route.top_k), slots = size_t(cuda::kMaxGemvRows) * top_k;
  cuda::MoeBuffers b;
  b.input = memory.zeros<float>(r * shape.hidden);
  b.output = memory.zeros<float>(r * shape.hidden);
  b.router = memory.zeros<float>(r * shape.route.experts);
  b.route_weights = memory.zeros<float>(r * top_k);
  b.route_ids = memory.zeros<int>(r * top_k);
  b.shared_gate = memory.zeros<float>(r * shape.shared_inner);
  b.shared_up = memory.zeros<float>(r * shape.shared_inner);
  b.shared_scale = memory.zeros<float>(r);
  b.expert_gate = memory.zeros<float>(slots * r * shape.inner);
  b.expert_up = memory.zeros<float>(slots * r * shape.inner);
  b.expert_out = memory.zeros<float>(slots * r * shape.hidden);
  b.descriptors = memory.zeros<cuda::GemvMatrix>(cuda::moe_descriptor_count(shape.route.top_k));
  b.slot_of = memory.zeros<int>(cuda::moe_slot_count(shape.route.top_k));
  b.slot_weights = memory.zeros<float>(cuda::moe_slot_weight_count(shape.route.top_k));
  b.expert_partials =
      memory.zeros<float>(cuda::expert_partial_count(shape.route.top_k, shape.inner, shape.shared_inner, shape.hidden));
  return b;
}

}  // namespace vavilov::test
