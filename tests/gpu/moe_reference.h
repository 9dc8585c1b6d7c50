#pragma once
// The spec's MoE block in double precision on the host, for the GPU MoE tests (test_cuda_moe.cpp,
// test_cuda_expert_decode.cpp): softmax router, top-k by probability (equal ones: the lower index first), the picks'
// weights renormalised to sum 1, Σ w_e·down_e(silu(gate_e·x)·up_e·x) + σ(shared_gate·x)·shared(x), over the
// matrices' exact (dequantised) values. Each output also gets Σ |terms| of its sums, the scale of its rounding errors.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "cuda/device_model.h"
#include "device_matrices.h"

namespace vavilov::test {

// A MoE block's matrices on the device and on the host.
struct TestMoe {
  TestMatrix router, shared_gate, shared_up, shared_down, shared_scale;
  std::vector<TestMatrix> gate, up, down;
  cuda::DeviceMoe device;
};

// m.device from m's matrices: the expert descriptor arrays copied to the device, the formats as given.
inline void describe_on_device(TestMoe& m, DeviceMemory& memory, cuda::WeightFormat gate_up, cuda::WeightFormat down) {
  const auto descriptors = [&](const std::vector<TestMatrix>& matrices) {
    std::vector<cuda::DeviceMatrix> device;
    for (const TestMatrix& matrix : matrices) device.push_back(matrix.device);
    return memory.copy(device);
  };
  m.device.router = m.router.device;
  m.device.shared_gate = m.shared_scale.device;
  m.device.shared = {m.shared_gate.device, m.shared_up.device, m.shared_down.device};
  m.device.expert_gate = descriptors(m.gate);
  m.device.expert_up = descriptors(m.up);
  m.device.expert_down = descriptors(m.down);
  m.device.gate_up_format = gate_up;
  m.device.down_format = down;
}

// A Q4 MoE block of random weights (hidden, expert inner and shared-expert inner widths, `experts` experts), described
// on the device.
inline TestMoe random_q4_moe(DeviceMemory& memory, std::mt19937& rng, int hidden, int inner, int shared_inner,
                             int experts) {
  const auto random = [&](int rows, int cols, float scale) {
    return make_matrix(memory, cuda::WeightFormat::Q4, normal_values(rng, size_t(rows) * size_t(cols), scale), rows,
                       cols);
  };
  TestMoe m;
  m.router = random(experts, hidden, 0.05f);
  m.shared_gate = random(shared_inner, hidden, 0.03f);
  m.shared_up = random(shared_inner, hidden, 0.03f);
  m.shared_down = random(hidden, shared_inner, 0.05f);
  m.shared_scale = random(1, hidden, 0.03f);
  for (int e = 0; e < experts; ++e) {
    m.gate.push_back(random(inner, hidden, 0.03f));
    m.up.push_back(random(inner, hidden, 0.03f));
    m.down.push_back(random(hidden, inner, 0.05f));
  }
  describe_on_device(m, memory, cuda::WeightFormat::Q4, cuda::WeightFormat::Q4);
  return m;
}

inline std::vector<double> reference_product(const TestMatrix& w, const double* x) {
  std::vector<double> y(size_t(w.rows));
  for (int r = 0; r < w.rows; ++r) {
    const float* row = w.exact.data() + size_t(r) * size_t(w.cols);
    double sum = 0;
    for (int c = 0; c < w.cols; ++c) sum += double(row[c]) * x[c];
    y[size_t(r)] = sum;
  }
  return y;
}

// Router probabilities of one row.
inline std::vector<double> router_probabilities(const TestMoe& m, const double* x) {
  std::vector<double> p = reference_product(m.router, x);
  const double peak = *std::max_element(p.begin(), p.end());
  double sum = 0;
  for (double& v : p) sum += (v = std::exp(v - peak));
  for (double& v : p) v /= sum;
  return p;
}

// Experts by probability, descending (equal ones: the lower index first).
inline std::vector<int> probability_ranking(const std::vector<double>& p) {
  std::vector<int> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[size_t(a)] > p[size_t(b)]; });
  return order;
}

// weight·down(silu(gate·x) ⊙ up·x) added into y, weight·Σ |down terms| into magnitude.
inline void add_feed_forward(const TestMatrix& gate, const TestMatrix& up, const TestMatrix& down, const double* x,
                             double weight, double* y, double* magnitude) {
  const std::vector<double> g = reference_product(gate, x), u = reference_product(up, x);
  std::vector<double> a(g.size());
  for (size_t i = 0; i < a.size(); ++i) a[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
  for (int d = 0; d < down.rows; ++d) {
    double sum = 0, size = 0;
    for (int i = 0; i < down.cols; ++i)
      sum += down.at(d, i) * a[size_t(i)], size += std::abs(down.at(d, i) * a[size_t(i)]);
    y[d] += weight * sum;
    magnitude[d] += weight * size;
  }
}

struct MoeReference {
  std::vector<std::set<int>> picks;  // per row
  std::vector<double> pick_margin;   // per row: the top_k-th probability over the next one (≥ 1)
  std::vector<double> y, magnitude;  // [rows, hidden]
};

// The block for `rows` rows of x [rows, hidden].
inline MoeReference reference_moe(const TestMoe& m, const std::vector<double>& x, int rows, int top_k) {
  const int hidden = m.router.cols;
  MoeReference ref;
  ref.y.assign(size_t(rows) * size_t(hidden), 0.0);
  ref.magnitude = ref.y;
  for (int r = 0; r < rows; ++r) {
    const double* xr = x.data() + size_t(r) * size_t(hidden);
    double* y = ref.y.data() + size_t(r) * size_t(hidden);
    double* magnitude = ref.magnitude.data() + size_t(r) * size_t(hidden);
    const std::vector<double> p = router_probabilities(m, xr);
    const std::vector<int> order = probability_ranking(p);
    double total = 0;
    for (int j = 0; j < top_k; ++j) total += p[size_t(order[size_t(j)])];
    for (int j = 0; j < top_k; ++j) {
      const int e = order[size_t(j)];
      add_feed_forward(m.gate[size_t(e)], m.up[size_t(e)], m.down[size_t(e)], xr, p[size_t(e)] / total, y, magnitude);
    }
    const double scale = 1.0 / (1.0 + std::exp(-reference_product(m.shared_scale, xr)[0]));
    add_feed_forward(m.shared_gate, m.shared_up, m.shared_down, xr, scale, y, magnitude);
    ref.picks.emplace_back(order.begin(), order.begin() + top_k);
    ref.pick_margin.push_back(size_t(top_k) < order.size()
                                  ? p[size_t(order[size_t(top_k - 1)])] / p[size_t(order[size_t(top_k)])]
                                  : INFINITY);
  }
  return ref;
}

}  // namespace vavilov::test
