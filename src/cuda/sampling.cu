#include <cooperative_groups.h>

#include <cfloat>
#include <climits>

#include "cuda/launch.cuh"
#include "cuda/sampling.cuh"

namespace vavilov::cuda {

namespace {

namespace cg = cooperative_groups;

// A row is one cluster of kCluster blocks of kThreads threads (a multiprocessor each): block `rank` owns the ids
// [rank·span, (rank + 1)·span), and what the row needs as a whole (a maximum, a sum, a prefix in id order, a digit
// histogram) is combined over the cluster's shared memory in rank order.
constexpr int kThreads = 1024, kWarps = kThreads / 32, kDigits = 256, kCluster = 16;
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

// The per-warp digit sums of a radix level, in a fixed order: each warp takes 32 consecutive tokens at a time, the
// lanes of a digit add up in lane order, and the warps' sums are added in warp order.
struct MassShared {
  double warp_digits[kWarps][kDigits];
  double staged[kWarps][32];
};

struct Shared {
  double values[kWarps];
  double slot, result;           // this block's part of a cluster-wide combine, and the combined value
  int counts[kDigits];           // this block's digit counts of a radix level
  double digit_mass[kDigits];    // this block's digit masses of a radix level
  double digit_totals[kDigits];  // the cluster's (counts or masses)
  int chosen;
  MassShared mass;
};

struct Team {
  cg::cluster_group cluster;
  int rank;
  int64_t begin, end;  // this block's ids
  Shared& s;
};

__device__ Team make_team(int64_t vocab, Shared& s) {
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int64_t span = (vocab + kCluster - 1) / kCluster;
  const int64_t begin = min(vocab, rank * span);
  return {cluster, rank, begin, min(vocab, begin + span), s};
}

// The block's sum of v (a butterfly in each warp, then the warps in warp order): the same bits whatever the
// schedule; every thread gets it.
__device__ double block_sum(double v, Shared& s) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kAll, v, offset);
  __syncthreads();
  if (threadIdx.x % 32 == 0) s.values[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < kWarps; ++w) total += s.values[w];
  return total;
}

// The sum of v over the block's threads before this one.
__device__ double block_exclusive_scan(double v, Shared& s) {
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

// op over the blocks' values in rank order (every value is exact in a double: sums, counts, ids, floats); every
// thread of the cluster gets it. `upto` < kCluster: only the ranks before it (a prefix).
template <typename Op>
__device__ double team_combine(double block_value, Team& t, double first, Op op, int upto = kCluster) {
  if (threadIdx.x == 0) t.s.slot = block_value;
  t.cluster.sync();
  if (threadIdx.x == 0) {
    double acc = first;
    for (int r = 0; r < upto; ++r) acc = op(acc, *t.cluster.map_shared_rank(&t.s.slot, r));
    t.s.result = acc;
  }
  t.cluster.sync();
  return t.s.result;
}

__device__ double team_sum(double v, Team& t) {
  return team_combine(block_sum(v, t.s), t, 0.0, [](double a, double b) { return a + b; });
}

__device__ double team_max(double v, Team& t) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmax(v, __shfl_xor_sync(kAll, v, offset));
  __syncthreads();
  if (threadIdx.x % 32 == 0) t.s.values[threadIdx.x / 32] = v;
  __syncthreads();
  double block = -INFINITY;
  for (int w = 0; w < kWarps; ++w) block = fmax(block, t.s.values[w]);
  return team_combine(block, t, -INFINITY, [](double a, double b) { return fmax(a, b); });
}

// The sum of v over the threads before this one in id order (the lower ranks', then this block's).
__device__ double team_exclusive_scan(double v, Team& t) {
  const double within = block_exclusive_scan(v, t.s), total = block_sum(v, t.s);
  return team_combine(
             total, t, 0.0, [](double a, double b) { return a + b; }, t.rank) +
         within;
}

// Thread t's run of the block's ids in id order.
struct Run {
  int64_t begin, end;
};

__device__ Run thread_run(const Team& t) {
  const int64_t chunk = (t.end - t.begin + kThreads - 1) / kThreads;
  const int64_t begin = min(t.end, t.begin + int64_t(threadIdx.x) * chunk);
  return {begin, min(t.end, begin + chunk)};
}

// engine::draw over weight(id) with uniform u: the first id (in id order) where the running sum passes u · total; the
// last id of positive weight when rounding leaves the target past the end. The run that holds the target is the last
// run of positive weight starting at or before it (one run, whatever the scans' rounding). Every thread of the
// cluster calls it; all get the id.
template <typename Weight>
__device__ int32_t team_draw(const Weight& weight, double u, Team& t) {
  const Run run = thread_run(t);
  double local = 0;
  for (int64_t i = run.begin; i < run.end; ++i) {
    const double w = weight(i);
    if (w > 0) local += w;
  }
  const double target = u * team_sum(local, t);
  const double before = team_exclusive_scan(local, t);
  const int mine = local > 0 && before <= target ? t.rank * kThreads + int(threadIdx.x) : -1;
  const int owner = int(team_max(double(mine), t));
  int64_t pick = -1;
  if (mine == owner && owner >= 0) {
    double left = target - before;
    for (int64_t i = run.begin; i < run.end; ++i) {
      const double w = weight(i);
      if (w <= 0) continue;
      pick = i;
      if (left < w) break;
      left -= w;
    }
  }
  return int32_t(team_max(double(pick), t));
}

// Radix select over the row's keys, 8 bits a level from the top: at each level the block histograms the digit of the
// keys that match the chosen prefix (count: tokens; else their weight), the cluster adds the blocks' histograms in
// rank order, and choose(totals) picks the digit (the same in every block: the same sums). Returns the key.
template <bool Count, typename Choose>
__device__ uint32_t radix_select(const float* adjusted, const double* weight, Team& t, const Choose& choose) {
  Shared& s = t.s;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t prefix = 0, mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    if constexpr (Count) {
      for (int d = threadIdx.x; d < kDigits; d += kThreads) s.counts[d] = 0;
      __syncthreads();
      for (int64_t i = t.begin + threadIdx.x; i < t.end; i += kThreads) {
        const uint32_t key = order_key(adjusted[i]);
        if ((key & mask) == prefix) atomicAdd(&s.counts[(key >> shift) & 0xff], 1);  // integers: any order
      }
      __syncthreads();
    } else {
      for (int d = lane; d < kDigits; d += 32) s.mass.warp_digits[warp][d] = 0;
      __syncwarp();
      for (int64_t base = t.begin + int64_t(warp) * 32; base < t.end; base += kThreads) {
        const int64_t i = base + lane;
        int digit = -1;
        double w = 0;
        if (i < t.end) {
          const uint32_t key = order_key(adjusted[i]);
          w = weight[i];
          if ((key & mask) == prefix && w > 0) digit = int((key >> shift) & 0xff);
        }
        s.mass.staged[warp][lane] = w;
        __syncwarp();
        const unsigned peers = __match_any_sync(kAll, digit);
        if (digit >= 0 && lane == __ffs(peers) - 1) {
          double sum = 0;
          for (unsigned rest = peers; rest; rest &= rest - 1) sum += s.mass.staged[warp][__ffs(rest) - 1];
          s.mass.warp_digits[warp][digit] += sum;
        }
        __syncwarp();
      }
      __syncthreads();
      for (int d = threadIdx.x; d < kDigits; d += kThreads) {
        double sum = 0;
        for (int w = 0; w < kWarps; ++w) sum += s.mass.warp_digits[w][d];
        s.digit_mass[d] = sum;
      }
    }
    t.cluster.sync();
    for (int d = threadIdx.x; d < kDigits; d += kThreads) {
      double total = 0;
      for (int r = 0; r < kCluster; ++r)
        total += Count ? double(*t.cluster.map_shared_rank(&s.counts[d], r))
                       : *t.cluster.map_shared_rank(&s.digit_mass[d], r);
      s.digit_totals[d] = total;
    }
    t.cluster.sync();  // every block has read the others' histograms, which the next level overwrites
    if (threadIdx.x == 0) s.chosen = choose(s.digit_totals);
    __syncthreads();
    prefix |= uint32_t(s.chosen) << shift;
    mask |= 0xffu << shift;
    __syncthreads();
  }
  return prefix;
}

// Top-k: zero weight for every token past the k first (keys above the k-th's, then its key's lowest ids).
__device__ void keep_first_k(const float* adjusted, double* weight, int64_t k, Team& t) {
  double above = 0;  // tokens with a larger key than the chosen prefix's, over the levels so far
  const uint32_t cut = radix_select<true>(adjusted, weight, t, [&](const double* counts) {
    int d = kDigits - 1;
    while (d > 0 && above + counts[d] < double(k)) above += counts[d--];
    return d;
  });
  // `above` lives in thread 0, which chose: share it.
  const int64_t need = k - int64_t(team_max(threadIdx.x == 0 ? above : -1.0, t));
  const Run run = thread_run(t);
  double ties = 0;
  for (int64_t i = run.begin; i < run.end; ++i) ties += order_key(adjusted[i]) == cut;
  int64_t rank = int64_t(team_exclusive_scan(ties, t));  // exact: counts far below 2^53
  for (int64_t i = run.begin; i < run.end; ++i) {
    const uint32_t key = order_key(adjusted[i]);
    if (key < cut || (key == cut && rank++ >= need)) weight[i] = 0;
  }
  __syncthreads();
}

// Top-p: keeps the shortest prefix (in the filters' order) whose weight reaches `target`, zero weight elsewhere. Each
// level picks the digit where the running mass (from the largest key down) reaches the target (should rounding keep
// it below everywhere, the lowest digit that holds weight: everything is then kept down to it); the tokens of the
// final key are walked in id order.
__device__ void keep_mass(const float* adjusted, double* weight, double target, Team& t) {
  double above = 0;
  const uint32_t cut = radix_select<false>(adjusted, weight, t, [&](const double* mass) {
    int lowest = kDigits - 1;
    for (int e = 0; e < kDigits; ++e)
      if (mass[e] > 0) {
        lowest = e;
        break;
      }
    int d = kDigits - 1;
    while (d > lowest && above + mass[d] < target) above += mass[d--];
    return d;
  });
  double kept = team_max(threadIdx.x == 0 ? above : -1.0, t);
  const Run run = thread_run(t);
  double tie_mass = 0;
  for (int64_t i = run.begin; i < run.end; ++i)
    if (order_key(adjusted[i]) == cut) tie_mass += weight[i];
  kept += team_exclusive_scan(tie_mass, t);
  for (int64_t i = run.begin; i < run.end; ++i) {
    const uint32_t key = order_key(adjusted[i]);
    if (key < cut) {
      weight[i] = 0;
    } else if (key == cut) {
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

__global__ void __launch_bounds__(kThreads, 1)
    distribution_kernel(DistributionRows rows, int64_t vocab, DeviceSamplingOptions o) {
  extern __shared__ unsigned char raw[];
  Team t = make_team(vocab, *reinterpret_cast<Shared*>(raw));
  const int r = blockIdx.x / kCluster;
  const float* logits = rows.logits + r * rows.logits_stride;
  float* adjusted = rows.adjusted + r * vocab;
  double* weight = rows.probs + r * vocab;
  for (int64_t i = t.begin + threadIdx.x; i < t.end; i += kThreads) adjusted[i] = logits[i];
  __syncthreads();
  for (int e = rows.row_begin[r] + threadIdx.x; e < rows.row_begin[r + 1]; e += kThreads) {
    const LogitAdjustment a = rows.adjustments[e];
    if (a.id >= t.begin && a.id < t.end) adjusted[a.id] = adjust(adjusted[a.id], a, rows.biases, o);
  }
  __syncthreads();
  float top = -INFINITY;
  double nan = INFINITY;
  for (int64_t i = t.begin + threadIdx.x; i < t.end; i += kThreads) {
    const float x = adjusted[i];
    if (x != x) nan = fmin(nan, double(i));
    top = fmaxf(top, x);
  }
  nan = -team_max(-nan, t);
  top = float(team_max(top, t));
  if (nan != INFINITY || top == -INFINITY) {
    if (t.rank == 0 && threadIdx.x == 0) rows.status[r] = nan != INFINITY ? int32_t(nan) : kSampleAllBanned;
    return;
  }
  // Weight 1 marks a survivor of top-k until the weights replace the marks; top-k keeps the largest logit.
  for (int64_t i = t.begin + threadIdx.x; i < t.end; i += kThreads) weight[i] = 1;
  __syncthreads();
  if (o.top_k > 0 && o.top_k < vocab) keep_first_k(adjusted, weight, o.top_k, t);
  double local = 0;
  for (int64_t i = t.begin + threadIdx.x; i < t.end; i += kThreads) {
    double w = weight[i];
    if (w > 0) w = exp((double(adjusted[i]) - top) / o.temperature);
    weight[i] = w;
    local += w;
  }
  const double total = team_sum(local, t);
  if (o.top_p < 1) keep_mass(adjusted, weight, double(o.top_p) * total, t);
  local = 0;
  for (int64_t i = t.begin + threadIdx.x; i < t.end; i += kThreads) {
    double w = weight[i];
    if (w < double(o.min_p)) weight[i] = w = 0;  // · the largest weight, exp(0) = 1
    local += w;
  }
  const double kept = team_sum(local, t);
  if (!(kept > 0 && kept <= DBL_MAX)) {
    if (t.rank == 0 && threadIdx.x == 0) rows.status[r] = kSampleNoMass;
    return;
  }
  const double scale = 1 / kept;
  for (int64_t i = t.begin + threadIdx.x; i < t.end; i += kThreads) weight[i] *= scale;
}

__device__ bool is_stop(int32_t token, const int64_t* stops, int count) {
  for (int i = 0; i < count; ++i)
    if (stops[i] == token) return true;
  return false;
}

// The generator's state and the count of uniforms drawn live in device memory (SamplerState), so that the kernels of
// a captured step advance them in turn; every block reads them first and rank 0 writes them back last.
__device__ void save_generator(const Team& t, SamplerState* generator, uint64_t state, int used) {
  t.cluster.sync();  // every block has read the state
  if (t.rank == 0 && threadIdx.x == 0) generator->state = state, generator->uniforms += used;
}

__global__ void __launch_bounds__(kThreads, 1)
    verify_kernel(const double* p, const double* q, const int32_t* tokens, int rows, int64_t vocab,
                  const int64_t* stops, int stop_count, SamplerState* generator, SampledVerifyOutcome* outcome) {
  extern __shared__ unsigned char raw[];
  Team t = make_team(vocab, *reinterpret_cast<Shared*>(raw));
  uint64_t state = generator->state;
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
        for (int64_t i = t.begin + threadIdx.x; i < t.end; i += kThreads) local += residual(i);
        const bool empty = !(team_sum(local, t) > 0);
        ++used;
        const double u = next_uniform(state);
        token = empty ? team_draw([&](int64_t i) { return pr[i]; }, u, t) : team_draw(residual, u, t);
      }
    } else {
      ++used;
      token = team_draw([&](int64_t i) { return pr[i]; }, next_uniform(state), t);
    }
    if (t.rank == 0 && threadIdx.x == 0) outcome->emitted[r] = token;
    if (r + 1 == rows || token != tokens[r + 1] || is_stop(token, stops, stop_count)) break;
  }
  if (t.rank == 0 && threadIdx.x == 0) {
    outcome->kept = r + 1;
    for (int later = r + 1; later < rows; ++later) outcome->emitted[later] = tokens[later];  // any valid id
  }
  save_generator(t, generator, state, used);
}

__global__ void __launch_bounds__(kThreads, 1)
    draw_kernel(const double* probs, int64_t vocab, SamplerState* generator, int32_t* token) {
  extern __shared__ unsigned char raw[];
  Team t = make_team(vocab, *reinterpret_cast<Shared*>(raw));
  uint64_t state = generator->state;
  const int32_t pick = team_draw([&](int64_t i) { return probs[i]; }, next_uniform(state), t);
  if (t.rank == 0 && threadIdx.x == 0) *token = pick;
  save_generator(t, generator, state, 1);
}

__global__ void point_mass_kernel(double* probs, int64_t vocab, int32_t token) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vocab; i += int64_t(gridDim.x) * blockDim.x)
    probs[i] = i == token ? 1.0 : 0.0;
}

// Each kernel in clusters of kCluster blocks (16: above the portable 8, so allowed explicitly) with Shared in
// dynamic shared memory.
template <typename... Params, typename... Args>
cudaError_t launch_rows(void (*kernel)(Params...), int rows, cudaStream_t stream, Args&&... args) {
  static const cudaError_t allowed = [kernel] {
    const cudaError_t a = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    const cudaError_t b =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(Shared)));
    return a != cudaSuccess ? a : b;
  }();
  if (allowed != cudaSuccess) return allowed;
  return launch_clustered(kernel, dim3(unsigned(rows * kCluster)), dim3(kThreads), sizeof(Shared), stream,
                          dim3(kCluster, 1, 1), false, std::forward<Args>(args)...);
}

}  // namespace

cudaError_t sample_distributions(const DistributionRows& rows, int count, int64_t vocab,
                                 const DeviceSamplingOptions& options, cudaStream_t stream) {
  if (count <= 0 || vocab <= 0 || vocab > INT_MAX || !(options.temperature > 0)) return cudaErrorInvalidValue;
  return launch_rows(distribution_kernel, count, stream, rows, vocab, options);
}

cudaError_t sampled_verify(const double* p, const double* q, const int32_t* tokens, int rows, int64_t vocab,
                           const int64_t* stops, int stop_count, SamplerState* generator, SampledVerifyOutcome* outcome,
                           cudaStream_t stream) {
  if (rows < 1 || rows > 4 || vocab <= 0 || vocab > INT_MAX) return cudaErrorInvalidValue;
  return launch_rows(verify_kernel, 1, stream, p, q, tokens, rows, vocab, stops, stop_count, generator, outcome);
}

cudaError_t sampled_draw(const double* probs, int64_t vocab, SamplerState* generator, int32_t* token,
                         cudaStream_t stream) {
  if (vocab <= 0 || vocab > INT_MAX) return cudaErrorInvalidValue;
  return launch_rows(draw_kernel, 1, stream, probs, vocab, generator, token);
}

cudaError_t point_mass(double* probs, int64_t vocab, int32_t token, cudaStream_t stream) {
  if (token < 0 || token >= vocab) return cudaErrorInvalidValue;
  point_mass_kernel<<<64, 256, 0, stream>>>(probs, vocab, token);
  return cudaGetLastError();
}

}  // namespace vavilov::cuda
