#include "cuda/moe_block.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "cuda/linear.cuh"
#include "cuda/product_groups.h"

namespace vavilov::cuda {

namespace {

bool gemv_reads_all(const DeviceMatrix* device, int count, int rows, int cols) {
  std::vector<DeviceMatrix> host(static_cast<size_t>(count));
  cuda_check(cudaMemcpy(host.data(), device, host.size() * sizeof(DeviceMatrix), cudaMemcpyDeviceToHost),
             "MoE decode plan");
  return std::all_of(host.begin(), host.end(),
                     [&](const DeviceMatrix& m) { return m.rows == rows && m.cols == cols && gemv_reads(m); });
}

// Whether expert_decode.cuh reads the block: Q4 experts (gemv_reads_all checked their shapes) and a Q4 shared expert.
bool fuses(const DeviceMoe& w, const MoeShape& s) {
  const auto q4 = [](const DeviceMatrix& m, int rows, int cols) {
    return m.format == WeightFormat::Q4 && m.group == kQuantGroup && m.rows == rows && m.cols == cols && gemv_reads(m);
  };
  return w.gate_up_format == WeightFormat::Q4 && w.down_format == WeightFormat::Q4 &&
         q4(w.shared.gate, s.shared_inner, s.hidden) && q4(w.shared.up, s.shared_inner, s.hidden) &&
         q4(w.shared.down, s.hidden, s.shared_inner);
}

// MoeDecodePlan::fused_max_rows, or VAVILOV_MOE_FUSED_ROWS (0–4; 0: never fused) for A/B measurements.
int fused_max_rows() {
  static const int rows = [] {
    const char* value = std::getenv("VAVILOV_MOE_FUSED_ROWS");
    if (!value) return MoeDecodePlan{}.fused_max_rows;
    const std::string text = value;
    check(text.size() == 1 && text[0] >= '0' && text[0] - '0' <= kMaxGemvRows,
          "VAVILOV_MOE_FUSED_ROWS={}: expected 0 to {}", text, kMaxGemvRows);
    return text[0] - '0';
  }();
  return rows;
}

ExpertDecode expert_decode_arguments(const DeviceMoe& w, const MoeShape& shape, const MoeBuffers& b) {
  ExpertDecode p;
  p.shared_gate = w.shared.gate;
  p.shared_up = w.shared.up;
  p.shared_down = w.shared.down;
  p.hidden = shape.hidden;
  p.inner = shape.inner;
  p.shared_inner = shape.shared_inner;
  p.route = shape.route;
  p.x = b.input;
  p.logits = b.router;
  p.shared_scale = b.shared_scale;
  p.route_ids = b.route_ids;
  p.route_weights = b.route_weights;
  p.slots = {b.slot_of, b.slot_of + kMaxGemvRows * shape.route.top_k, b.slot_weights};
  p.slots.gate = w.expert_gate;
  p.slots.up = w.expert_up;
  p.slots.down = w.expert_down;
  p.slots.matrices = b.descriptors;
  p.partials = b.expert_partials;
  p.y = b.output;
  return p;
}

// run_products, then expert_decode.cuh's routing, products and combine (or y_fixed's sums).
void decode_fused(const MoeDecodePlan& plan, int rows, unsigned long long* output_fixed, cudaStream_t stream) {
  run_products(plan.fused_inputs, rows, stream);  // router, shared-expert gate
  ExpertDecode experts = plan.experts;
  experts.y_fixed = output_fixed;
  cuda_check(expert_decode(experts, rows, stream), "MoE experts");
}

// settled_x: every matrix's activations when the Q4 kernel may stage them before its wait (gemv_q4_experts).
void run_gemv(WeightFormat format, const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch,
              GemvDescriptors descriptors, cudaStream_t stream, const float* settled_x = nullptr) {
  const cudaError_t status =
      format == WeightFormat::Q4
          ? gemv_q4_experts(matrices, count, max_rows, max_cols, batch, stream, descriptors, settled_x)
          : gemv_bf16(matrices, count, max_rows, max_cols, batch, stream, descriptors);
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
size_t moe_slot_weight_count(int top_k) { return size_t(kMaxGemvRows * top_k * kMaxGemvRows); }

MoeDecodePlan plan_moe_decode(const DeviceMoe& w, const MoeShape& shape, const MoeBuffers& buffers) {
  MoeDecodePlan plan;
  const int experts = shape.route.experts;
  plan.decodes = shape.route.top_k <= kMaxMoeTopK && experts <= kMaxMoeExperts &&
                 gemv_reads_all(w.expert_gate, experts, shape.inner, shape.hidden) &&
                 gemv_reads_all(w.expert_up, experts, shape.inner, shape.hidden) &&
                 gemv_reads_all(w.expert_down, experts, shape.hidden, shape.inner);
  if (!plan.decodes) return plan;
  plan.fused = buffers.expert_partials && fuses(w, shape);
  plan.fused_max_rows = fused_max_rows();
  if (plan.fused) {
    plan.experts = expert_decode_arguments(w, shape, buffers);
    plan.fused_inputs =
        make_product_group(buffers.input, {{w.router, buffers.router}, {w.shared_gate, buffers.shared_scale}});
  }
  plan.shared_down_joins = w.shared.down.format == w.down_format && gemv_reads(w.shared.down);
  plan.swiglu_in_down = w.down_format == WeightFormat::Q4;
  plan.inputs = make_product_group(buffers.input, {{w.router, buffers.router},
                                                   {w.shared.gate, buffers.shared_gate},
                                                   {w.shared.up, buffers.shared_up},
                                                   {w.shared_gate, buffers.shared_scale}});
  return plan;
}

bool moe_decode_takes_fixed(const MoeDecodePlan& plan, int rows) {
  return plan.fused && rows <= plan.fused_max_rows && expert_decode_takes_fixed(plan.experts, rows);
}

void moe_decode(const DeviceMoe& w, const MoeShape& shape, const MoeDecodePlan& plan, const MoeBuffers& buffers,
                int rows, cudaStream_t stream, unsigned long long* output_fixed) {
  check(!output_fixed || moe_decode_takes_fixed(plan, rows), "MoE decode: a fixed-point output this pass cannot write");
  if (plan.fused && rows <= plan.fused_max_rows) return decode_fused(plan, rows, output_fixed, stream);
  const int top_k = shape.route.top_k, selections = rows * top_k, slots = kMaxGemvRows * top_k;
  run_products(plan.inputs, rows, stream);

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
  experts.swiglu_in_down = plan.swiglu_in_down;
  if (plan.shared_down_joins) {
    experts.shared_down = gemv_matrix(w.shared.down, buffers.shared_gate, buffers.output);
    if (plan.swiglu_in_down) experts.shared_down.x_up = buffers.shared_up;
  }
  moe_route_and_plan(shape.route, buffers.router, rows, buffers.route_ids, buffers.route_weights, experts, stream);

  // gate/up reads the descriptors that the routing just wrote only after its wait, but its input (the block's, written
  // before the input products and the routing, which wait before they let their dependents start) may be staged
  // before it; down's descriptors were written two or three launches back, and gate/up (and SwiGLU) let their
  // dependents start only after their own waits, so down reads them and starts its weight loads before its wait
  // (launch.cuh's two-deep rule).
  run_gemv(w.gate_up_format, experts.gate_up, 2 * selections, shape.inner, shape.hidden, rows,
           GemvDescriptors::written_in_pass, stream, buffers.input);
  const int64_t shared_values = int64_t(rows) * shape.shared_inner;
  if (!plan.swiglu_in_down)
    swiglu_slots(buffers.expert_gate, buffers.expert_up, int64_t(rows) * shape.inner, buffers.slot_of, selections,
                 buffers.shared_gate, buffers.shared_up, shared_values, stream);
  else if (!plan.shared_down_joins)  // the shared expert's down runs through linear(), which reads plain activations
    swiglu(buffers.shared_gate, buffers.shared_up, shared_values, stream);
  if (plan.shared_down_joins) {
    run_gemv(w.down_format, experts.down_products, selections + 1, shape.hidden,
             std::max(shape.inner, shape.shared_inner), rows, GemvDescriptors::written_two_back, stream);
  } else {
    run_gemv(w.down_format, experts.down_products, selections, shape.hidden, shape.inner, rows,
             GemvDescriptors::written_two_back, stream);
    linear(w.shared.down, buffers.shared_gate, rows, buffers.output, stream);
  }
  moe_combine_slots(buffers.output, buffers.shared_scale, buffers.route_weights, buffers.slot_of, buffers.expert_out,
                    rows, top_k, shape.hidden, stream);
}

}  // namespace vavilov::cuda
