// Can ONE persistent kernel run a decode step's chain of dependent phases near the copy bandwidth, where a graph of
// dependent launches pays ~1.7 µs a link (chain_bench)? A synthetic Flash-Next Q4 step is ~590 dependent phases of
// 0–24 MB of weights (and a 357 MB lm_head); step_profile() models it from the per-layer byte budget. Two ways to run
// the same phases, each block folding its share of a phase's words and adding a value another block wrote in the
// phase before (so every phase depends on the whole previous one):
//
//   launches: one dependent launch a phase (launch.cuh) in a CUDA graph, 4 blocks of 256 threads a multiprocessor
//             (2 or 8 too), each thread's first 8 (4, 16) 16-byte loads issued before the wait (as the decode GEMVs);
//   ring:     one block a multiprocessor for the whole chain. Its producer warp streams the block's contiguous share
//             of each phase into a ring of shared memory with bulk copies (cp.async.bulk, completing on an mbarrier a
//             slot), as far ahead as the ring has room: weights depend on nothing, so they stream while the consumer
//             warps wait for the phase before (a counter every block increments with release semantics after its
//             phase). The consumers then fold the phase's words from shared memory and free each slot.
//   ring, tagged: the same ring, but no counter: a phase hands its output to the next as a vector of 64-bit words
//             that each carry the pass's epoch beside the value, and the next phase's blocks reload the words until
//             all carry it (consume_tagged): a GEMV's output vector handed over with no counter or fence on the
//             path (measured slower than the counter: every block's polls of the whole vector).
//
// Three step profiles: step_profile(), the links of today's kernels; minimal_step_profile(), the same bytes in the
// fewest dependent phases the model's mathematics allows — what any design, one kernel or many, must chain; and
// verify3_minimal_profile(), a 3-draft verify step in those phases.
//
// Values are checked against a host evaluation of the same chain. Prints per profile the time, the copy floor (bytes
// / copy bandwidth) and the fraction of it, and writes JSON.
// Usage: ring_bench OUT.json
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "check.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {
double measure_copy_bandwidth_gbs();  // cuda/bench.h, whose other declarations need C++20 (CUDA sources build as C++17)
}

namespace {

using vavilov::cuda::allow_dependents;
using vavilov::cuda::launch_dependent;
using vavilov::cuda::wait_for_producers;

struct Phases {
  const uint4* weights;   // every phase's 16-byte words, phase after phase
  const uint64_t* start;  // [count + 1] word offsets of the phases
  int count;
  uint32_t* values;  // [count + 1][blocks]: what each block wrote after each phase (row 0 zero)
  int blocks;
};

__device__ __host__ inline uint32_t fill_word_fold(uint64_t i) {
  return uint32_t(i) ^ uint32_t(i * 7 + 1) ^ uint32_t(i * 13 + 5) ^ uint32_t(i >> 3);
}

__global__ void fill(uint4* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = make_uint4(uint32_t(i), uint32_t(i * 7 + 1), uint32_t(i * 13 + 5), uint32_t(i >> 3));
}

__device__ __host__ inline uint32_t chain_value(uint32_t block_fold, uint32_t previous) {
  return block_fold * 2654435761u + previous;
}

// ---- launches: a dependent launch a phase ----

constexpr int kLaunchThreads = 256;

// kEarly: each thread's 16-byte loads in flight, the first of them issued before the wait.
template <int kEarly>
__global__ void __launch_bounds__(kLaunchThreads) launch_phase_kernel(Phases ph, int p) {
  const uint64_t begin = ph.start[p], end = ph.start[p + 1];
  const uint64_t stride = uint64_t(gridDim.x) * kLaunchThreads;
  const uint64_t first = begin + uint64_t(blockIdx.x) * kLaunchThreads + threadIdx.x;
  uint4 early[kEarly];
#pragma unroll
  for (int u = 0; u < kEarly; ++u)
    early[u] = first + u * stride < end ? __ldg(ph.weights + first + u * stride) : make_uint4(0, 0, 0, 0);
  wait_for_producers();
  allow_dependents();
  uint32_t acc = 0;
#pragma unroll
  for (int u = 0; u < kEarly; ++u) acc ^= early[u].x ^ early[u].y ^ early[u].z ^ early[u].w;
  for (uint64_t i = first + kEarly * stride; i < end; i += kEarly * stride) {
    uint4 v[kEarly];
#pragma unroll
    for (int u = 0; u < kEarly; ++u)
      v[u] = i + u * stride < end ? __ldg(ph.weights + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kEarly; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  __shared__ uint32_t folded[kLaunchThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, offset);
  if (threadIdx.x % 32 == 0) folded[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t block = 0;
    for (int w = 0; w < kLaunchThreads / 32; ++w) block ^= folded[w];
    const uint32_t previous = __ldcg(ph.values + size_t(p) * ph.blocks + (blockIdx.x + 1) % unsigned(ph.blocks));
    ph.values[size_t(p + 1) * ph.blocks + blockIdx.x] = chain_value(block, previous);
  }
}

// ---- ring: one persistent kernel ----

constexpr int kRingThreads = 512, kConsumerWarps = kRingThreads / 32 - 1, kMaxSlots = 32;

__device__ uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count) : "memory");
}

__device__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

__device__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}

__device__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred ready;\n"
      "retry:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
      "@!ready bra retry;\n"
      "}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}

__device__ void bulk_copy_to_shared(void* destination, const void* source, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(destination)),
               "l"(source), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}

__device__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ uint32_t load_relaxed(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ void add_release(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// How the blocks wait for each other between phases (all through one thread a block):
//   kPollAcquire:   arrive with a release reduction on one counter, poll it with acquire loads;
//   kPollRelaxed:   the same, polling with relaxed loads and one acquire fence once the count is reached;
//   kNone:          no waiting at all (values then race): how fast the ring streams without dependencies.
// (A third, the last arriver storing the phase count to a flag line of each block, measured 25-70 % slower than
// kPollAcquire: bench/results/2026-12-01-h200-persistent-ring-chain.json.)
//   kTagged:        no counter: every phase hands over a vector of 64-bit words, each a value with the pass's epoch in
//                   its upper half (one single-copy-atomic store), and the next phase's blocks reload the words they
//                   need until every one carries the epoch — the handover of a GEMV's output vector as such, with no
//                   release, acquire or arrival on the path (see consume_tagged).
enum Barrier : int { kPollAcquire = 0, kPollRelaxed = 1, kNone = 2, kTagged = 3 };

struct Sync {
  uint32_t* arrivals;  // phases finished, summed over the blocks
  Barrier barrier;
  uint64_t* vectors;  // kTagged: [count + 1][vector_words] tagged words, what each phase handed over (row 0 unused)
  int vector_words;
  uint32_t epoch;  // kTagged: this pass's tag (passes never reuse one, so the rows need no clearing between them)
};

// Returns once every block has finished `phases_done` phases.
__device__ void wait_for_phases(const Sync& sync, uint32_t phases_done, int blocks) {
  const uint32_t target = phases_done * uint32_t(blocks);
  switch (sync.barrier) {
    case kPollAcquire:
      while (load_acquire(sync.arrivals) < target) {
      }
      break;
    case kPollRelaxed:
      while (load_relaxed(sync.arrivals) < target) {
      }
      fence_acq_rel();
      break;
    case kNone:
      break;
  }
}

// This block has finished its phase (its outputs are stored).
__device__ void arrive(const Sync& sync) {
  if (sync.barrier != kNone) add_release(sync.arrivals, 1);
}

__device__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory"); }

// Block b's contiguous share of phase p: words [begin, end).
struct Share {
  uint64_t begin, end;
};
__device__ __host__ inline uint64_t lesser(uint64_t a, uint64_t b) { return a < b ? a : b; }

// The phases' word offsets, copied into shared memory at the start (a global load a phase sat on the consumers' path).
constexpr int kMaxPhases = 1024;
__shared__ uint64_t phase_start[kMaxPhases + 1];

__device__ Share share_of(const Phases& ph, int p) {
  const uint64_t begin = phase_start[p], words = phase_start[p + 1] - begin;
  const uint64_t per_block = (words + ph.blocks - 1) / ph.blocks;
  const uint64_t lo = lesser(words, per_block * blockIdx.x), hi = lesser(words, lo + per_block);
  return {begin + lo, begin + hi};
}

// Walks the ring's slots in the order both sides use: `round` counts how often the ring wrapped.
struct RingCursor {
  int slot = 0;
  uint32_t round = 0;
  __device__ void advance(int slots) {
    if (++slot == slots) slot = 0, ++round;
  }
};

__device__ void prefetch_to_l2(const void* source, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(source), "r"(bytes) : "memory");
}

// The block's share of phase p into L2 (bulk prefetches of at most a piece each).
__device__ void prefetch_share(const Phases& ph, int p, uint32_t piece_words) {
  if (p >= ph.count) return;
  const Share s = share_of(ph, p);
  for (uint64_t w = s.begin; w < s.end; w += piece_words)
    prefetch_to_l2(ph.weights + w, uint32_t(lesser(piece_words, s.end - w) * 16));
}

// Streams the block's shares into the ring; with l2_ahead > 0 it also asks L2 for the share of the phase l2_ahead
// after the one it copies, so that DRAM keeps streaming beyond what the ring holds.
__device__ void produce(const Phases& ph, unsigned char* ring, uint32_t piece_words, int slots, uint64_t* full,
                        uint64_t* empty, int l2_ahead) {
  RingCursor at;
  for (int p = 0; p < l2_ahead; ++p) prefetch_share(ph, p, piece_words);
  for (int p = 0; p < ph.count; ++p) {
    if (l2_ahead > 0) prefetch_share(ph, p + l2_ahead, piece_words);
    const Share s = share_of(ph, p);
    for (uint64_t w = s.begin; w < s.end; w += piece_words, at.advance(slots)) {
      const uint32_t bytes = uint32_t(lesser(piece_words, s.end - w) * 16);
      if (at.round > 0) mbarrier_wait(&empty[at.slot], (at.round - 1) & 1);
      mbarrier_expect_bytes(&full[at.slot], bytes);
      bulk_copy_to_shared(ring + size_t(at.slot) * piece_words * 16, ph.weights + w, bytes, &full[at.slot]);
    }
  }
}

// This consumer thread's fold of its part of the block's share of phase p, piece by piece as the ring delivers it;
// frees each slot.
__device__ uint32_t fold_share(const Phases& ph, int p, const unsigned char* ring, uint32_t piece_words, int slots,
                               uint64_t* full, uint64_t* empty, RingCursor& at) {
  const int c = threadIdx.x - 32, lane = threadIdx.x % 32;
  const Share s = share_of(ph, p);
  uint32_t acc = 0;
  for (uint64_t w = s.begin; w < s.end; w += piece_words, at.advance(slots)) {
    const uint32_t words = uint32_t(lesser(piece_words, s.end - w));
    mbarrier_wait(&full[at.slot], at.round & 1);
    const uint4* piece = reinterpret_cast<const uint4*>(ring + size_t(at.slot) * piece_words * 16);
    for (uint32_t i = c; i < words; i += kConsumerWarps * 32) {
      const uint4 v = piece[i];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncwarp();
    if (lane == 0) mbarrier_arrive(&empty[at.slot]);
  }
  return acc;
}

__device__ void consume(const Phases& ph, const unsigned char* ring, uint32_t piece_words, int slots, uint64_t* full,
                        uint64_t* empty, const Sync& sync) {
  __shared__ uint32_t folded[kConsumerWarps];
  const int c = threadIdx.x - 32, lane = threadIdx.x % 32;
  RingCursor at;
  for (int p = 0; p < ph.count; ++p) {
    if (p > 0) {
      if (c == 0) wait_for_phases(sync, uint32_t(p), ph.blocks);
      consumers_sync();
    }
    uint32_t acc = fold_share(ph, p, ring, piece_words, slots, full, empty, at);
    for (int offset = 16; offset > 0; offset >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, offset);
    if (lane == 0) folded[c / 32] = acc;
    consumers_sync();
    if (c == 0) {
      uint32_t block = 0;
      for (int w = 0; w < kConsumerWarps; ++w) block ^= folded[w];
      const uint32_t previous = __ldcg(ph.values + size_t(p) * ph.blocks + (blockIdx.x + 1) % unsigned(ph.blocks));
      ph.values[size_t(p + 1) * ph.blocks + blockIdx.x] = chain_value(block, previous);
      arrive(sync);
    }
  }
}

__device__ uint64_t load_relaxed_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ void store_relaxed_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// All of a vector's loads go out before the first spin; a consumer thread holds at most this many words.
constexpr int kMaxTaggedWordsPerThread = 8;

// Block b's slice of a handed-over vector: words [b * per_block, ...).
__device__ __host__ inline int vector_slice_words(int vector_words, int blocks) {
  return (vector_words + blocks - 1) / blocks;
}

// The block's XOR of its consumer threads' values, in every consumer thread (two barriers: one to publish, one so
// that the next call's stores cannot overtake this call's reads).
__device__ uint32_t consumers_fold(uint32_t acc, uint32_t* folded) {
  const int c = threadIdx.x - 32, lane = threadIdx.x % 32;
  for (int offset = 16; offset > 0; offset >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, offset);
  if (lane == 0) folded[c / 32] = acc;
  consumers_sync();
  uint32_t block = 0;
  for (int w = 0; w < kConsumerWarps; ++w) block ^= folded[w];
  consumers_sync();
  return block;
}

// kTagged: each phase folds the whole vector the phase before handed over (spinning on each word until it carries
// this pass's epoch), folds its share of the weights, and writes its slice of the phase's own vector.
__device__ void consume_tagged(const Phases& ph, const unsigned char* ring, uint32_t piece_words, int slots,
                               uint64_t* full, uint64_t* empty, const Sync& sync) {
  __shared__ uint32_t folded[kConsumerWarps];
  const int c = threadIdx.x - 32;
  const int per_block = vector_slice_words(sync.vector_words, ph.blocks);
  RingCursor at;
  for (int p = 0; p < ph.count; ++p) {
    uint32_t input = 0;
    if (p > 0) {
      const uint64_t* row = sync.vectors + size_t(p) * sync.vector_words;
      uint64_t word[kMaxTaggedWordsPerThread];
#pragma unroll
      for (int k = 0; k < kMaxTaggedWordsPerThread; ++k) {
        const int i = c + k * kConsumerWarps * 32;
        word[k] = i < sync.vector_words ? load_relaxed_u64(row + i) : uint64_t(sync.epoch) << 32;
      }
#pragma unroll
      for (int k = 0; k < kMaxTaggedWordsPerThread; ++k) {
        while (uint32_t(word[k] >> 32) != sync.epoch) word[k] = load_relaxed_u64(row + c + k * kConsumerWarps * 32);
        input ^= uint32_t(word[k]);
      }
      input = consumers_fold(input, folded);
    }
    const uint32_t acc = fold_share(ph, p, ring, piece_words, slots, full, empty, at);
    const uint32_t block = consumers_fold(acc, folded);
    uint64_t* out = sync.vectors + size_t(p + 1) * sync.vector_words;
    const int first = int(blockIdx.x) * per_block;
    if (c < per_block && first + c < sync.vector_words)
      store_relaxed_u64(out + first + c, uint64_t(sync.epoch) << 32 | chain_value(block ^ uint32_t(first + c), input));
  }
}

__global__ void __launch_bounds__(kRingThreads, 1)
    ring_kernel(Phases ph, uint32_t piece_words, int slots, Sync sync, int l2_ahead) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t full[kMaxSlots], empty[kMaxSlots];
  for (int p = threadIdx.x; p <= ph.count; p += blockDim.x) phase_start[p] = ph.start[p];
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) produce(ph, ring, piece_words, slots, full, empty, l2_ahead);
    return;
  }
  if (sync.barrier == kTagged)
    consume_tagged(ph, ring, piece_words, slots, full, empty, sync);
  else
    consume(ph, ring, piece_words, slots, full, empty, sync);
}

// ---- host ----

float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

// Weight MB of a synthetic Flash-Next Q4 step's links (0.5625 B a weight): a hyper-connection read's mix down and mix
// up 1.8 each; GDN inputs 23.7 (qkv 10240 × 2560, z 6144 × 2560, b, a), the recurrence 6.3 (its fp32 state read and
// written), out 8.85; attention q/k/v/index 20.2, o 8.85; router + shared gate 0.74; one expert's gate, up and down
// 2.76 (gate/up of 10 routed + the shared expert 20.3, their down 10.1); lm_head 357 (248320 × 2560); the MTP head's
// fc_embedding + fc_hidden 7.4.
constexpr double kMixDown = 1.8, kMixUp = 1.8, kGdnInputs = 23.7, kGdnState = 6.3, kOut = 8.85, kAttentionInputs = 20.2,
                 kRouter = 0.74, kExpert = 2.76, kGateUp = 20.3, kDown = 10.1, kLmHead = 357, kMtpFc = 7.4;

using Megabytes = std::vector<double>;

void append(Megabytes& mb, const Megabytes& phases) { mb.insert(mb.end(), phases.begin(), phases.end()); }

// A 1-row step, link by link as today's kernels make it (the trace, docs/CUDA.md): attention has five kernels of no
// weights (inputs, pooling, selection, scores, values), the MoE a routing kernel; the final read, lm_head and the two
// argmax kernels. 581 phases.
Megabytes step_profile() {
  const Megabytes read = {kMixDown, kMixUp}, moe = {kRouter, 0, kGateUp, kDown};
  const Megabytes gdn = {kGdnInputs, kGdnState, kOut}, attention = {kAttentionInputs, 0, 0, 0, 0, 0, kOut};
  Megabytes mb;
  for (int layer = 0; layer < 48; ++layer) {
    append(mb, read);
    append(mb, layer % 4 == 3 ? attention : gdn);
    append(mb, read);
    append(mb, moe);
  }
  append(mb, read);
  append(mb, {kLmHead, 0, 0});
  return mb;
}

// A layer in the fewest dependent phases the model's mathematics allows (docs/qwen4_exp spec; each phase needs the
// whole output of the one before): a hyper-connection read is two (u = silu(Wd x̂) needs all of x̂, G = sigmoid(Wu u)
// all of u); the GDN mixer three (inputs, a head's conv and recurrence — head-local but on other multiprocessors than
// most of the head's inputs —, out), attention three (q/k/v/index, attention over the cache at a short context where
// every block is selected, o); the MoE one after its read, with the router's product folded into the read's second
// phase (each block adds its slice's part of the logits) and each expert's down folded into the blocks that computed
// its rows of h. `experts_mb`: the MoE phase's routed and shared experts.
void append_minimal_layer(Megabytes& mb, bool attention, double experts_mb) {
  append(mb, {kMixDown, kMixUp});
  append(mb, attention ? Megabytes{kAttentionInputs, 0, kOut} : Megabytes{kGdnInputs, kGdnState, kOut});
  append(mb, {kMixDown, kMixUp + kRouter, experts_mb});
}

// The final read, lm_head and argmax.
void append_minimal_head(Megabytes& mb) { append(mb, {kMixDown, kMixUp, kLmHead, 0}); }

// step_profile()'s bytes in the fewest phases: 48 × 8 + 4 = 388.
Megabytes minimal_step_profile(double experts_mb) {
  Megabytes mb;
  for (int layer = 0; layer < 48; ++layer) append_minimal_layer(mb, layer % 4 == 3, experts_mb);
  append_minimal_head(mb);
  return mb;
}

// A 3-draft verify step in the same fewest phases: the 4-row trunk pass with each MoE phase streaming the union of the
// rows' experts (~39 routed at random routing, and the shared expert once), then the MTP head over the 4 rows and two
// chained 1-row MTP passes (each: its fc products, an attention layer, its final read, lm_head, argmax), each pass
// needing the one before. 427 phases.
Megabytes verify3_minimal_profile() {
  const auto experts = [](int routed) { return (routed + 1) * kExpert; };
  Megabytes mb = minimal_step_profile(experts(39));
  for (int routed : {39, 10, 10}) {
    append(mb, {kMtpFc});
    append_minimal_layer(mb, true, experts(routed));
    append_minimal_head(mb);
  }
  return mb;
}

struct Chain {
  Phases ph{};
  std::vector<uint64_t> start;
  uint64_t bytes = 0;
};

Chain make_chain(const std::vector<double>& megabytes, int blocks) {
  Chain c;
  c.start.push_back(0);
  for (double mb : megabytes) c.start.push_back(c.start.back() + uint64_t(mb * 1e6) / 16);
  c.bytes = c.start.back() * 16;
  uint4* weights;
  uint64_t* start;
  CHECK(cudaMalloc(&weights, std::max<uint64_t>(c.bytes, 16)));
  fill<<<1024, 256>>>(weights, c.start.back());
  CHECK(cudaGetLastError());
  CHECK(cudaMalloc(&start, c.start.size() * sizeof(uint64_t)));
  CHECK(cudaMemcpy(start, c.start.data(), c.start.size() * sizeof(uint64_t), cudaMemcpyHostToDevice));
  c.ph = {weights, start, int(megabytes.size()), nullptr, blocks};
  CHECK(cudaMalloc(&c.ph.values, sizeof(uint32_t) * (megabytes.size() + 1) * blocks));
  CHECK(cudaDeviceSynchronize());
  return c;
}

void free_chain(Chain& c) {
  CHECK(cudaFree(const_cast<uint4*>(c.ph.weights)));
  CHECK(cudaFree(const_cast<uint64_t*>(c.ph.start)));
  CHECK(cudaFree(c.ph.values));
}

// Each block's fold of each phase's words, [count][blocks]; `block_of(offset in phase, words in phase)` says which
// block folds a word.
template <typename BlockOf>
std::vector<uint32_t> block_folds(const Chain& c, BlockOf block_of) {
  const int blocks = c.ph.blocks;
  std::vector<uint32_t> folds(size_t(c.ph.count) * blocks, 0);
  for (int p = 0; p < c.ph.count; ++p) {
    const uint64_t words = c.start[p + 1] - c.start[p];
    for (uint64_t i = 0; i < words; ++i)
      folds[size_t(p) * blocks + block_of(i, words)] ^= fill_word_fold(c.start[p] + i);
  }
  return folds;
}

// The counter chains' values: each block's value after each phase, [count + 1][blocks].
std::vector<uint32_t> expected_values(const Chain& c, const std::vector<uint32_t>& folds) {
  const int blocks = c.ph.blocks;
  std::vector<uint32_t> values(size_t(c.ph.count + 1) * blocks, 0);
  for (int p = 0; p < c.ph.count; ++p)
    for (int b = 0; b < blocks; ++b)
      values[size_t(p + 1) * blocks + b] =
          chain_value(folds[size_t(p) * blocks + b], values[size_t(p) * blocks + (b + 1) % blocks]);
  return values;
}

// The tagged chain's vectors, [count + 1][vector_words] (row 0 unused): consume_tagged on the host.
std::vector<uint32_t> expected_vectors(const Chain& c, const std::vector<uint32_t>& folds, int vector_words) {
  const int blocks = c.ph.blocks, per_block = vector_slice_words(vector_words, blocks);
  std::vector<uint32_t> vectors(size_t(c.ph.count + 1) * vector_words, 0);
  for (int p = 0; p < c.ph.count; ++p) {
    uint32_t input = 0;
    if (p > 0)
      for (int i = 0; i < vector_words; ++i) input ^= vectors[size_t(p) * vector_words + i];
    for (int i = 0; i < vector_words; ++i)
      vectors[size_t(p + 1) * vector_words + i] =
          chain_value(folds[size_t(p) * blocks + i / per_block] ^ uint32_t(i), input);
  }
  return vectors;
}

bool values_match(const Chain& c, const std::vector<uint32_t>& expected) {
  std::vector<uint32_t> got(expected.size());
  CHECK(cudaMemcpy(got.data(), c.ph.values, got.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  return got == expected;
}

constexpr int kRepeats = 5;

// kTagged's handed-over vector: a 1-row step's typical activation vector (the hidden size, 2560 fp32 values), read
// whole by every block of the next phase.
constexpr int kVectorWords = 2560;
static_assert(kVectorWords <= kMaxTaggedWordsPerThread * kConsumerWarps * 32, "a consumer thread's words");

struct Timed {
  double us;  // one pass over the whole chain
  bool same;
};

template <int kEarly>
Timed time_launches(const Chain& c, const std::vector<uint32_t>& expected) {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  CHECK(cudaMemsetAsync(c.ph.values, 0, sizeof(uint32_t) * c.ph.blocks, stream));
  for (int p = 0; p < c.ph.count; ++p)
    CHECK(launch_dependent(launch_phase_kernel<kEarly>, dim3(c.ph.blocks), dim3(kLaunchThreads), 0, stream, c.ph, p));
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaEventRecord(start, stream));
  for (int r = 0; r < kRepeats; ++r) CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaEventSynchronize(stop));
  const Timed t{elapsed_ms(start, stop) * 1e3 / kRepeats, values_match(c, expected)};
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(stream));
  return t;
}

// The words a tagged pass handed over, as the pass with `epoch` wrote them.
bool vectors_match(const uint64_t* device_vectors, const std::vector<uint32_t>& expected, int vector_words,
                   uint32_t epoch) {
  std::vector<uint64_t> got(expected.size());
  CHECK(cudaMemcpy(got.data(), device_vectors, got.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  for (size_t i = vector_words; i < got.size(); ++i)
    if (got[i] != (uint64_t(epoch) << 32 | expected[i])) return false;
  return true;
}

struct Expected {
  std::vector<uint32_t> values;   // the counter barriers'
  std::vector<uint32_t> vectors;  // kTagged's
  int vector_words;
};

Timed time_ring(const Chain& c, const Expected& expected, uint32_t piece_kb, int slots, Barrier barrier, int l2_ahead) {
  if (c.ph.count > kMaxPhases) {
    std::fprintf(stderr, "ring_bench: %d phases, the ring kernel takes at most %d\n", c.ph.count, kMaxPhases);
    std::exit(1);
  }
  uint32_t* arrivals;
  CHECK(cudaMalloc(&arrivals, sizeof(uint32_t)));
  Sync sync{arrivals, barrier, nullptr, expected.vector_words, 0};
  const size_t vector_bytes = sizeof(uint64_t) * (c.ph.count + 1) * expected.vector_words;
  CHECK(cudaMalloc(&sync.vectors, vector_bytes));
  CHECK(cudaMemset(sync.vectors, 0, vector_bytes));
  const size_t ring_bytes = size_t(piece_kb) * 1024 * slots;
  CHECK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(ring_bytes)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Phases ph = c.ph;
  uint32_t piece_words = piece_kb * 1024 / 16;
  int slot_count = slots;
  void* args[] = {&ph, &piece_words, &slot_count, &sync, &l2_ahead};
  auto pass = [&] {
    ++sync.epoch;  // the launch copies the arguments
    CHECK(cudaMemsetAsync(arrivals, 0, sizeof(uint32_t), stream));
    CHECK(cudaMemsetAsync(c.ph.values, 0, sizeof(uint32_t) * c.ph.blocks, stream));
    CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(ring_kernel), dim3(c.ph.blocks), dim3(kRingThreads), args,
                                      ring_bytes, stream));
  };
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  pass();
  CHECK(cudaEventRecord(start, stream));
  for (int r = 0; r < kRepeats; ++r) pass();
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaEventSynchronize(stop));
  const bool same = barrier == kTagged
                        ? vectors_match(sync.vectors, expected.vectors, expected.vector_words, sync.epoch)
                        : values_match(c, expected.values);
  const Timed t{elapsed_ms(start, stop) * 1e3 / kRepeats, same};
  CHECK(cudaStreamDestroy(stream));
  CHECK(cudaFree(arrivals));
  CHECK(cudaFree(sync.vectors));
  return t;
}

std::string entry(const std::string& name, double floor_us, const Timed& t) {
  const bool racing = name.find("no_dependency") != std::string::npos;  // its values are not meant to match
  std::printf("  %-40s %9.1f us  %5.1f %% of the copy floor  values %s\n", name.c_str(), t.us, 100 * floor_us / t.us,
              racing   ? "(not checked)"
              : t.same ? "ok"
                       : "WRONG");
  return "      {\"variant\": \"" + name + "\", \"us\": " + std::to_string(t.us) +
         ", \"fraction_of_copy_floor\": " + std::to_string(floor_us / t.us) +
         ", \"values_ok\": " + (t.same ? "true" : "false") + "}";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: ring_bench OUT.json\n");
    return 2;
  }
  cudaDeviceProp properties{};
  CHECK(cudaGetDeviceProperties(&properties, 0));
  const int sms = properties.multiProcessorCount;
  const double gbs = vavilov::cuda::measure_copy_bandwidth_gbs();
  std::printf("%s, %d multiprocessors, copy %.0f GB/s\n", properties.name, sms, gbs);
  std::string json = "{\n  \"gpu\": \"" + std::string(properties.name) +
                     "\",\n  \"copy_bandwidth_gbs\": " + std::to_string(gbs) + ",\n  \"profiles\": [\n";

  struct Profile {
    std::string name;
    std::vector<double> megabytes;
    bool step;  // runs the step's list of variants
  };
  std::vector<Profile> profiles = {{"flash_next_q4_step", step_profile(), true},
                                   {"flash_next_q4_minimal_chain", minimal_step_profile(kGateUp + kDown), true},
                                   {"flash_next_q4_verify3_minimal_chain", verify3_minimal_profile(), true}};
  for (double mb : {0.5, 2.0, 4.0, 8.0, 16.0})
    profiles.push_back({"uniform_" + std::to_string(mb).substr(0, 4) + "mb",
                        std::vector<double>(size_t(std::clamp(1024.0 / mb, 64.0, 1024.0)), mb), false});
  struct RingShape {
    uint32_t piece_kb;
    int slots;
  };
  struct RingRun {
    RingShape shape;
    Barrier barrier;
    int l2_ahead;
  };
  const char* barrier_names[] = {"poll_acquire", "poll_relaxed", "no_dependency", "tagged_vector"};
  const std::vector<RingRun> step_runs = {
      {{32, 6}, kPollAcquire, 0}, {{32, 6}, kTagged, 0}, {{16, 12}, kTagged, 0}, {{32, 6}, kNone, 0}};
  const std::vector<RingRun> uniform_runs = {{{32, 6}, kPollAcquire, 0}, {{32, 6}, kTagged, 0}, {{32, 6}, kNone, 0}};
  for (size_t i = 0; i < profiles.size(); ++i) {
    const Profile& profile = profiles[i];
    double total_mb = 0;
    for (double mb : profile.megabytes) total_mb += mb;
    const double floor_us = total_mb * 1e6 / (gbs * 1e3);  // MB: 10^6 bytes, as the profiles count
    std::printf("%s: %zu phases, %.0f MB, copy floor %.1f us\n", profile.name.c_str(), profile.megabytes.size(),
                total_mb, floor_us);
    json += "    {\"profile\": \"" + profile.name + "\", \"phases\": " + std::to_string(profile.megabytes.size()) +
            ", \"megabytes\": " + std::to_string(total_mb) + ", \"copy_floor_us\": " + std::to_string(floor_us) +
            ", \"runs\": [\n";
    std::vector<std::string> runs;
    // Launch shapes: blocks of 256 threads a multiprocessor and loads in flight a thread (the step profiles sweep
    // both, so that the bound does not rest on one launch shape).
    for (int per_sm : profile.step ? std::vector<int>{2, 4, 8} : std::vector<int>{4}) {
      const int blocks = per_sm * sms;
      Chain c = make_chain(profile.megabytes, blocks);
      const auto folds = block_folds(c, [&](uint64_t i, uint64_t) { return int((i / kLaunchThreads) % blocks); });
      const auto expected = expected_values(c, folds);
      const std::string shape = "launches_" + std::to_string(per_sm) + "x256_early";
      runs.push_back(entry(shape + "8", floor_us, time_launches<8>(c, expected)));
      if (profile.step) runs.push_back(entry(shape + "4", floor_us, time_launches<4>(c, expected)));
      if (profile.step && per_sm == 4) runs.push_back(entry(shape + "16", floor_us, time_launches<16>(c, expected)));
      free_chain(c);
    }
    Chain c = make_chain(profile.megabytes, sms);
    const auto folds = block_folds(c, [&](uint64_t i, uint64_t words) { return int(i / ((words + sms - 1) / sms)); });
    const Expected expected{expected_values(c, folds), expected_vectors(c, folds, kVectorWords), kVectorWords};
    for (const RingRun& run : profile.step ? step_runs : uniform_runs) {
      const std::string name = "ring_" + std::to_string(run.shape.piece_kb) + "kb_x" + std::to_string(run.shape.slots) +
                               "_" + barrier_names[run.barrier] + "_l2ahead" + std::to_string(run.l2_ahead);
      runs.push_back(entry(name, floor_us,
                           time_ring(c, expected, run.shape.piece_kb, run.shape.slots, run.barrier, run.l2_ahead)));
    }
    for (size_t r = 0; r < runs.size(); ++r) json += (r ? ",\n" : "") + runs[r];
    free_chain(c);
    json += std::string("\n    ]}") + (i + 1 < profiles.size() ? ",\n" : "\n");
  }
  json += "  ]\n}\n";
  FILE* out = std::fopen(argv[1], "w");
  if (!out) {
    std::fprintf(stderr, "ring_bench: cannot write %s\n", argv[1]);
    return 1;
  }
  std::fputs(json.c_str(), out);
  std::fclose(out);
  return 0;
}
