#include "cuda/moe_block.h"

#include <algorithm>

#include "cuda/linear.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kMaxStagedCols = 12288;  // 4.125 · 4 rows · cols bytes of shared memory must fit (gemv.cuh)

// Whether the GEMV kernels read m: Q4 in whole groups with 8-byte aligned codes and activations that fit their
// staging, or BF16 with 16-byte aligned rows.
bool gemv_reads(const DeviceMatrix& m) {
  const auto address = reinterpret_cast<uintptr_t>(m.data);
  if (m.format == WeightFormat::Q4) return m.cols % kQuantGroup == 0 && m.cols <= kMaxStagedCols && address % 8 == 0;
  if (m.format == WeightFormat::BF16) return m.cols % 8 == 0 && address % 16 == 0;
  return false;
}

bool gemv_reads_all(const DeviceMatrix* device, int count, int rows, int cols) {
  std::vector<DeviceMatrix> host(static_cast<size_t>(count));
  cuda_check(cudaMemcpy(host.data(), device, host.size() * sizeof(DeviceMatrix), cudaMemcpyDeviceToHost),
             "MoE decode plan");
  return std::all_of(host.begin(), host.end(),
                     [&](const DeviceMatrix& m) { return m.rows == rows && m.cols == cols && gemv_reads(m); });
}

void run_gemv(WeightFormat format, const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch,
              cudaStream_t stream) {
  const cudaError_t status = format == WeightFormat::Q4 ? gemv_q4(matrices, count, max_rows, max_cols, batch, stream)
                                                        : gemv_bf16(matrices, count, max_rows, max_cols, batch, stream);
  cuda_check(status, "MoE products");
}

}  // namespace

MoeShape moe_shape(const ModelConfig& c) {
  MoeShape s;
  s.hidden = int(c.hidden_size);
  s.inner = int(c.moe_intermediate_size);
  s.shared_inner = int(c.shared_expert_intermediate_size);
  s.route = {c.num_experts, c.num_experts_per_tok, c.norm_topk_prob};
  return s;
}

size_t moe_descriptor_count(int top_k) { return size_t(3 * kMaxGemvRows * top_k + 1); }
size_t moe_slot_count(int top_k) { return size_t(kMaxGemvRows * top_k + 1); }

MoeDecodePlan plan_moe_decode(const DeviceMoe& w, const MoeShape& shape, const MoeBuffers& buffers) {
  MoeDecodePlan plan;
  const int experts = shape.route.experts;
  plan.decodes = shape.route.top_k <= kMaxMoeTopK && experts <= kMaxMoeExperts &&
                 gemv_reads_all(w.expert_gate, experts, shape.inner, shape.hidden) &&
                 gemv_reads_all(w.expert_up, experts, shape.inner, shape.hidden) &&
                 gemv_reads_all(w.expert_down, experts, shape.hidden, shape.inner);
  if (!plan.decodes) return plan;
  plan.shared_down_joins = w.shared.down.format == w.down_format && gemv_reads(w.shared.down);
  std::vector<GemvMatrix> q4, bf16;
  const std::pair<const DeviceMatrix*, float*> inputs[] = {{&w.router, buffers.router},
                                                           {&w.shared.gate, buffers.shared_gate},
                                                           {&w.shared.up, buffers.shared_up},
                                                           {&w.shared_gate, buffers.shared_scale}};
  for (const auto& [m, y] : inputs) {
    if (!gemv_reads(*m)) {
      plan.other_inputs.emplace_back(*m, y);
    } else if (m->format == WeightFormat::Q4) {
      q4.push_back(gemv_matrix(*m, buffers.input, y));
      plan.q4_input_rows = std::max(plan.q4_input_rows, m->rows);
    } else {
      bf16.push_back(gemv_matrix(*m, buffers.input, y));
      plan.bf16_input_rows = std::max(plan.bf16_input_rows, m->rows);
    }
  }
  plan.q4_inputs = int(q4.size());
  plan.bf16_inputs = int(bf16.size());
  q4.insert(q4.end(), bf16.begin(), bf16.end());
  if (!q4.empty()) {
    const size_t bytes = q4.size() * sizeof(GemvMatrix);
    plan.input_descriptors = device_alloc(bytes, "MoE decode plan");
    cuda_check(cudaMemcpy(plan.input_descriptors.get(), q4.data(), bytes, cudaMemcpyHostToDevice), "MoE decode plan");
  }
  return plan;
}

void moe_decode(const DeviceMoe& w, const MoeShape& shape, const MoeDecodePlan& plan, const MoeBuffers& buffers,
                int rows, cudaStream_t stream) {
  const int top_k = shape.route.top_k, selections = rows * top_k, slots = kMaxGemvRows * top_k;
  const auto* inputs = static_cast<const GemvMatrix*>(plan.input_descriptors.get());
  if (plan.q4_inputs)
    run_gemv(WeightFormat::Q4, inputs, plan.q4_inputs, plan.q4_input_rows, shape.hidden, rows, stream);
  if (plan.bf16_inputs)
    run_gemv(WeightFormat::BF16, inputs + plan.q4_inputs, plan.bf16_inputs, plan.bf16_input_rows, shape.hidden, rows,
             stream);
  for (const auto& [m, y] : plan.other_inputs) linear(m, buffers.input, rows, y, stream);

  ExpertPlan experts;
  experts.gate = w.expert_gate;
  experts.up = w.expert_up;
  experts.down = w.expert_down;
  experts.inner = shape.inner;
  experts.hidden = shape.hidden;
  experts.x = buffers.input;
  experts.gate_out = buffers.expert_gate;
  experts.up_out = buffers.expert_up;
  experts.down_out = buffers.expert_out;
  experts.gate_up = buffers.descriptors;
  experts.down_products = buffers.descriptors + 2 * slots;
  experts.slot_of = buffers.slot_of;
  if (plan.shared_down_joins) experts.shared_down = gemv_matrix(w.shared.down, buffers.shared_gate, buffers.output);
  moe_route_and_plan(shape.route, buffers.router, rows, buffers.route_ids, buffers.route_weights, experts, stream);

  run_gemv(w.gate_up_format, experts.gate_up, 2 * selections, shape.inner, shape.hidden, rows, stream);
  swiglu_slots(buffers.expert_gate, buffers.expert_up, int64_t(rows) * shape.inner, buffers.slot_of, selections,
               buffers.shared_gate, buffers.shared_up, int64_t(rows) * shape.shared_inner, stream);
  if (plan.shared_down_joins) {
    run_gemv(w.down_format, experts.down_products, selections + 1, shape.hidden,
             std::max(shape.inner, shape.shared_inner), rows, stream);
  } else {
    run_gemv(w.down_format, experts.down_products, selections, shape.hidden, shape.inner, rows, stream);
    linear(w.shared.down, buffers.shared_gate, rows, buffers.output, stream);
  }
  moe_combine_slots(buffers.output, buffers.shared_scale, buffers.route_weights, buffers.slot_of, buffers.expert_out,
                    rows, top_k, shape.hidden, stream);
}

}  // namespace vavilov::cuda
