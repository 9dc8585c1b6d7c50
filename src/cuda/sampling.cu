#include <cfloat>
#include <climits>

#include "cuda/sampling.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32, kDigits = 256;
constexpr unsigned kAll = 0xffffffffu;

// engine::Rng::uniform (SplitMix64, 53 bits): the same doubles in the same order as the host's generator.
__device__ double next_uniform(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return double(z >> 11) * 0x1.0p-53;
}

// The filters' order as an unsigned key: a larger key is a larger logit (−0 ties with +0, as in engine::ByLogit).
__device__ uint32_t order_key(float logit) {
  const uint32_t bits = __float_as_uint(logit == 0.0f ? 0.0f : logit);
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// Block-wide reductions and scans over one value a thread, in a fixed order (a butterfly in each warp, then the
// warps' results in warp order): the same inputs give the same bits whatever the schedule. Every thread calls them.
struct BlockShared {
  double values[kWarps];
  float floats[kWarps];
  int ints[kWarps];
};

__device__ double block_sum(double v, BlockShared& s) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kAll, v, offset);
  __syncthreads();
  if (threadIdx.x % 32 == 0) s.values[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < kWarps; ++w) total += s.values[w];
  return total;
}

__device__ float block_max(float v, BlockShared& s) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(kAll, v, offset));
  __syncthreads();
  if (threadIdx.x % 32 == 0) s.floats[threadIdx.x / 32] = v;
  __syncthreads();
  float best = -INFINITY;
  for (int w = 0; w < kWarps; ++w) best = fmaxf(best, s.floats[w]);
  return best;
}

__device__ int block_min(int v, BlockShared& s) {
  v = __reduce_min_sync(kAll, v);
  __syncthreads();
  if (threadIdx.x % 32 == 0) s.ints[threadIdx.x / 32] = v;
  __syncthreads();
  int least = INT_MAX;
  for (int w = 0; w < kWarps; ++w) least = min(least, s.ints[w]);
  return least;
}

// The sum of v over the threads before this one.
__device__ double block_exclusive_scan(double v, BlockShared& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  double inclusive = v;
  for (int offset = 1; offset < 32; offset *= 2) {
    const double other = __shfl_up_sync(kAll, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  __syncthreads();
  if (lane == 31) s.values[warp] = inclusive;
  __syncthreads();
  double before = 0;
  for (int w = 0; w < warp; ++w) before += s.values[w];
  return before + inclusive - v;
}

// Thread t's run of ids in id order: [t·chunk, (t+1)·chunk) ∩ [0, vocab).
struct Run {
  int64_t begin, end;
};

__device__ Run thread_run(int64_t vocab) {
  const int64_t chunk = (vocab + kThreads - 1) / kThreads;
  const int64_t begin = min(vocab, int64_t(threadIdx.x) * chunk);
  return {begin, min(vocab, begin + chunk)};
}

__device__ int block_max_int(int v, BlockShared& s) {
  v = __reduce_max_sync(kAll, v);
  __syncthreads();
  if (threadIdx.x % 32 == 0) s.ints[threadIdx.x / 32] = v;
  __syncthreads();
  int most = INT_MIN;
  for (int w = 0; w < kWarps; ++w) most = max(most, s.ints[w]);
  return most;
}

// engine::draw over weight(id) with uniform u: the first id (in id order) where the running sum passes u · total; the
// last id of positive weight when rounding leaves the target past the end. The run that holds the target is the last
// run of positive weight starting at or before it (one run, whatever the scan's rounding). Every thread calls it; all
// get the id.
template <typename Weight>
__device__ int32_t block_draw(const Weight& weight, int64_t vocab, double u, BlockShared& s, int* chosen) {
  const Run run = thread_run(vocab);
  double local = 0;
  for (int64_t i = run.begin; i < run.end; ++i) {
    const double w = weight(i);
    if (w > 0) local += w;
  }
  const double target = u * block_sum(local, s);
  const double before = block_exclusive_scan(local, s);
  if (threadIdx.x == 0) *chosen = -1;
  const int owner = block_max_int(local > 0 && before <= target ? int(threadIdx.x) : -1, s);
  if (int(threadIdx.x) == owner) {
    double left = target - before;
    int64_t pick = -1;
    for (int64_t i = run.begin; i < run.end; ++i) {
      const double w = weight(i);
      if (w <= 0) continue;
      pick = i;
      if (left < w) break;
      left -= w;
    }
    *chosen = int(pick);
  }
  __syncthreads();
  const int pick = *chosen;
  __syncthreads();
  return pick;
}

struct SelectShared {
  BlockShared block;
  int counts[kDigits];
  double digit_mass[kDigits];
  uint32_t prefix;
  int64_t above_count;
  double above_mass;
  int chosen;
};

// The key K of the k-th token in the filters' order and how many tokens have a larger key (radix select, 8 bits a
// level, counts added by shared atomics: integers, so in any order).
__device__ void select_kth_key(const float* adjusted, int64_t vocab, int64_t k, SelectShared& s) {
  uint32_t prefix = 0, mask = 0;
  int64_t above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < kDigits; d += kThreads) s.counts[d] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
      const uint32_t key = order_key(adjusted[i]);
      if ((key & mask) == prefix) atomicAdd(&s.counts[(key >> shift) & 0xff], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int d = kDigits - 1;
      while (d > 0 && above + s.counts[d] < k) above += s.counts[d--];
      s.chosen = d;
      s.above_count = above;
    }
    __syncthreads();
    prefix |= uint32_t(s.chosen) << shift;
    mask |= 0xffu << shift;
    above = s.above_count;
    __syncthreads();
  }
  if (threadIdx.x == 0) s.prefix = prefix;
  __syncthreads();
}

// Top-k: zero weight for every token past the k first (keys above K, then the `need` lowest ids of key K).
__device__ void keep_first_k(const float* adjusted, double* weight, int64_t vocab, int64_t k, SelectShared& s) {
  select_kth_key(adjusted, vocab, k, s);
  const uint32_t cut = s.prefix;
  const int64_t need = k - s.above_count;
  const Run run = thread_run(vocab);
  double ties = 0;
  for (int64_t i = run.begin; i < run.end; ++i) ties += order_key(adjusted[i]) == cut;
  int64_t rank = int64_t(block_exclusive_scan(ties, s.block));  // exact: counts far below 2^53
  for (int64_t i = run.begin; i < run.end; ++i) {
    const uint32_t key = order_key(adjusted[i]);
    if (key < cut || (key == cut && rank++ >= need)) weight[i] = 0;
  }
  __syncthreads();
}

// The per-warp digit sums of one level, in a fixed order: each warp takes 32 consecutive tokens at a time, the lanes
// of a digit add up in lane order, and the warps' sums are added in warp order.
struct MassShared {
  double warp_digits[kWarps][kDigits];
  double staged[kWarps][32];
};

// Top-p: keeps the shortest prefix (in the filters' order) whose weight reaches `target`, zero weight elsewhere.
// Radix by mass: each level picks the digit where the running mass (from the largest key down) reaches the target;
// the tokens of the final key are walked in id order.
__device__ void keep_mass(const float* adjusted, double* weight, int64_t vocab, double target, SelectShared& s,
                          MassShared& m) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t prefix = 0, mask = 0;
  double above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = lane; d < kDigits; d += 32) m.warp_digits[warp][d] = 0;
    __syncwarp();
    for (int64_t base = int64_t(warp) * 32; base < vocab; base += kThreads) {
      const int64_t i = base + lane;
      int digit = -1;
      double w = 0;
      if (i < vocab) {
        const uint32_t key = order_key(adjusted[i]);
        w = weight[i];
        if ((key & mask) == prefix && w > 0) digit = int((key >> shift) & 0xff);
      }
      m.staged[warp][lane] = w;
      __syncwarp();
      const unsigned peers = __match_any_sync(kAll, digit);
      if (digit >= 0 && lane == __ffs(peers) - 1) {
        double sum = 0;
        for (unsigned rest = peers; rest; rest &= rest - 1) sum += m.staged[warp][__ffs(rest) - 1];
        m.warp_digits[warp][digit] += sum;
      }
      __syncwarp();
    }
    __syncthreads();
    for (int d = threadIdx.x; d < kDigits; d += kThreads) {
      double sum = 0;
      for (int w = 0; w < kWarps; ++w) sum += m.warp_digits[w][d];
      s.digit_mass[d] = sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      // The digit where the running mass reaches the target; should rounding keep it below everywhere, the lowest
      // digit that holds weight (everything is then kept down to it).
      double running = above;
      int d = kDigits - 1, lowest = -1;
      for (int e = 0; e < kDigits; ++e)
        if (s.digit_mass[e] > 0) {
          lowest = e;
          break;
        }
      while (d > 0 && running + s.digit_mass[d] < target) {
        if (d == lowest) break;
        running += s.digit_mass[d--];
      }
      s.chosen = d;
      s.above_mass = running;
    }
    __syncthreads();
    prefix |= uint32_t(s.chosen) << shift;
    mask |= 0xffu << shift;
    above = s.above_mass;
    __syncthreads();
  }
  const Run run = thread_run(vocab);
  double tie_mass = 0;
  for (int64_t i = run.begin; i < run.end; ++i)
    if (order_key(adjusted[i]) == prefix) tie_mass += weight[i];
  double kept = above + block_exclusive_scan(tie_mass, s.block);
  for (int64_t i = run.begin; i < run.end; ++i) {
    const uint32_t key = order_key(adjusted[i]);
    if (key < prefix) {
      weight[i] = 0;
    } else if (key == prefix) {
      if (kept < target)
        kept += weight[i];
      else
        weight[i] = 0;
    }
  }
  __syncthreads();
}

// engine/sampling.cpp's adjust_into for one token: its biases in order, then the penalties.
__device__ float adjust(float logit, const LogitAdjustment& a, const float* biases, const DeviceSamplingOptions& o) {
  for (int b = a.bias_begin; b < a.bias_end; ++b) logit += biases[b];
  if (a.seen && o.repetition != 1) logit = logit > 0 ? logit / o.repetition : logit * o.repetition;
  if (a.generated > 0) logit -= o.frequency * float(a.generated) + o.presence;
  return logit;
}

struct DistributionShared {
  SelectShared select;
  MassShared mass;
};

__global__ void __launch_bounds__(kThreads, 1)
    distribution_kernel(DistributionRows rows, int64_t vocab, DeviceSamplingOptions o) {
  extern __shared__ unsigned char raw[];
  DistributionShared& s = *reinterpret_cast<DistributionShared*>(raw);
  BlockShared& block = s.select.block;
  const int r = blockIdx.x;
  const float* logits = rows.logits + r * rows.logits_stride;
  float* adjusted = rows.adjusted + r * vocab;
  double* weight = rows.probs + r * vocab;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) adjusted[i] = logits[i];
  __syncthreads();
  for (int e = rows.row_begin[r] + threadIdx.x; e < rows.row_begin[r + 1]; e += kThreads) {
    const LogitAdjustment a = rows.adjustments[e];
    adjusted[a.id] = adjust(adjusted[a.id], a, rows.biases, o);
  }
  __syncthreads();
  float top = -INFINITY;
  int nan = INT_MAX;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    const float x = adjusted[i];
    if (x != x) nan = min(nan, int(i));
    top = fmaxf(top, x);
  }
  nan = block_min(nan, block);
  top = block_max(top, block);
  if (nan != INT_MAX || top == -INFINITY) {
    if (threadIdx.x == 0) rows.status[r] = nan != INT_MAX ? nan : kSampleAllBanned;
    return;
  }
  // Weight 1 marks a survivor of top-k until the weights replace the marks; top-k keeps the largest logit.
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) weight[i] = 1;
  __syncthreads();
  if (o.top_k > 0 && o.top_k < vocab) keep_first_k(adjusted, weight, vocab, o.top_k, s.select);
  double local = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    double w = weight[i];
    if (w > 0) w = exp((double(adjusted[i]) - top) / o.temperature);
    weight[i] = w;
    local += w;
  }
  const double total = block_sum(local, block);
  __syncthreads();
  if (o.top_p < 1) keep_mass(adjusted, weight, vocab, double(o.top_p) * total, s.select, s.mass);
  local = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    double w = weight[i];
    if (w < double(o.min_p)) weight[i] = w = 0;  // · the largest weight, exp(0) = 1
    local += w;
  }
  const double kept = block_sum(local, block);
  if (!(kept > 0 && kept <= DBL_MAX)) {
    if (threadIdx.x == 0) rows.status[r] = kSampleNoMass;
    return;
  }
  const double scale = 1 / kept;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) weight[i] *= scale;
  if (threadIdx.x == 0) rows.status[r] = kSampleOk;
}

__device__ bool is_stop(int32_t token, const int64_t* stops, int count) {
  for (int i = 0; i < count; ++i)
    if (stops[i] == token) return true;
  return false;
}

__global__ void __launch_bounds__(kThreads, 1)
    verify_kernel(const double* p, const double* q, const int32_t* tokens, int rows, int64_t vocab,
                  const int64_t* stops, int stop_count, uint64_t state, SampledVerifyOutcome* outcome) {
  __shared__ BlockShared block;
  __shared__ int chosen;
  int used = 0, r = 0;
  for (;; ++r) {
    const double* pr = p + r * vocab;
    int32_t token;
    if (r + 1 < rows) {
      const double* qr = q + r * vocab;
      const int32_t x = tokens[r + 1];
      const double keep = fmin(1.0, pr[x] / qr[x]);
      ++used;
      token = x;
      if (!(next_uniform(state) < keep)) {
        const auto residual = [&](int64_t i) { return fmax(0.0, pr[i] - qr[i]); };
        double local = 0;
        const Run run = thread_run(vocab);
        for (int64_t i = run.begin; i < run.end; ++i) local += residual(i);
        const bool empty = !(block_sum(local, block) > 0);
        ++used;
        const double u = next_uniform(state);
        token = empty ? block_draw([&](int64_t i) { return pr[i]; }, vocab, u, block, &chosen)
                      : block_draw(residual, vocab, u, block, &chosen);
      }
    } else {
      ++used;
      token = block_draw([&](int64_t i) { return pr[i]; }, vocab, next_uniform(state), block, &chosen);
    }
    if (threadIdx.x == 0) outcome->emitted[r] = token;
    if (r + 1 == rows || token != tokens[r + 1] || is_stop(token, stops, stop_count)) break;
  }
  if (threadIdx.x == 0) outcome->kept = r + 1, outcome->uniforms = used;
}

__global__ void __launch_bounds__(kThreads, 1)
    draw_kernel(const double* probs, int64_t vocab, uint64_t state, int32_t* token) {
  __shared__ BlockShared block;
  __shared__ int chosen;
  const int32_t pick =
      block_draw([&](int64_t i) { return probs[i]; }, vocab, next_uniform(state), block, &chosen);
  if (threadIdx.x == 0) *token = pick;
}

__global__ void point_mass_kernel(double* probs, int64_t vocab, int32_t token) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vocab; i += int64_t(gridDim.x) * blockDim.x)
    probs[i] = i == token ? 1.0 : 0.0;
}

}  // namespace

cudaError_t sample_distributions(const DistributionRows& rows, int count, int64_t vocab,
                                 const DeviceSamplingOptions& options, cudaStream_t stream) {
  if (count <= 0 || vocab <= 0 || vocab > INT_MAX || !(options.temperature > 0)) return cudaErrorInvalidValue;
  constexpr size_t shared = sizeof(DistributionShared);
  static const cudaError_t opted_in =
      cudaFuncSetAttribute(distribution_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  if (opted_in != cudaSuccess) return opted_in;
  distribution_kernel<<<count, kThreads, shared, stream>>>(rows, vocab, options);
  return cudaGetLastError();
}

cudaError_t sampled_verify(const double* p, const double* q, const int32_t* tokens, int rows, int64_t vocab,
                           const int64_t* stops, int stop_count, uint64_t rng_state, SampledVerifyOutcome* outcome,
                           cudaStream_t stream) {
  if (rows < 1 || rows > 4 || vocab <= 0 || vocab > INT_MAX) return cudaErrorInvalidValue;
  verify_kernel<<<1, kThreads, 0, stream>>>(p, q, tokens, rows, vocab, stops, stop_count, rng_state, outcome);
  return cudaGetLastError();
}

cudaError_t sampled_draw(const double* probs, int64_t vocab, uint64_t rng_state, int32_t* token, cudaStream_t stream) {
  if (vocab <= 0 || vocab > INT_MAX) return cudaErrorInvalidValue;
  draw_kernel<<<1, kThreads, 0, stream>>>(probs, vocab, rng_state, token);
  return cudaGetLastError();
}

cudaError_t point_mass(double* probs, int64_t vocab, int32_t token, cudaStream_t stream) {
  if (token < 0 || token >= vocab) return cudaErrorInvalidValue;
  point_mass_kernel<<<64, 256, 0, stream>>>(probs, vocab, token);
  return cudaGetLastError();
}

}  // namespace vavilov::cuda
