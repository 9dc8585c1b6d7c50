// One sequence on the GPU: its state, scratch memory, and the trunk, MTP head and rollback steps, each a sequence of
// kernel launches mirroring the CPU engine (src/cpu/forward.cpp, layers.h, mtp.cpp). A pass of up to kRecordedRows
// rows runs as a CUDA graph (step_runner.h): everything it addresses stays put while the graph lives (attention caches
// and scratch grow before a pass, never inside it), and what changes from step to step — the position — is read
// from device memory.
#include <algorithm>
#include <array>
#include <functional>
#include <vector>

#include "core/error.h"
#include "cuda/argmax.cuh"
#include "cuda/attention.cuh"
#include "cuda/backend.h"
#include "cuda/device_model.h"
#include "cuda/device_sampler.h"
#include "cuda/expert_cache.h"
#include "cuda/expert_prefill.cuh"
#include "cuda/gated_deltanet.cuh"
#include "cuda/gemm.cuh"
#include "cuda/greedy_step.cuh"
#include "cuda/hyper_connection.cuh"
#include "cuda/kernel_trace.h"
#include "cuda/linear.cuh"
#include "cuda/moe_block.h"
#include "cuda/ops.cuh"
#include "cuda/ple.cuh"
#include "cuda/product_groups.h"
#include "cuda/quant_gemm.cuh"
#include "cuda/state_transfer.h"
#include "cuda/step_runner.h"

namespace vavilov::cuda {

int device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

namespace {

// Rows per pass through the layers; longer inputs run in chunks. 512 rows give the prefill GEMMs (gemm.cuh) enough
// rows per routed expert (512·k / experts ≈ 10 at Flash-Next's geometry) to be worth a tensor-core tile.
constexpr int kChunkRows = 512;
constexpr int kLogitRows = 64;       // rows per lm_head product when every row's logits are wanted (bounds the logits)
constexpr int kAttentionRows = 512;  // rows per attention pass (bounds the block scores and choices: rows × blocks)
constexpr int kAttentionPasses = kChunkRows / kAttentionRows;
constexpr int kRecordedRows = 4;   // rows whose recurrent state a pass can record for rollback; graphs up to this many
constexpr int kMaxDecodeRows = 4;  // passes of more rows take the prefill branches (grouped expert GEMMs)
static_assert(kRecordedRows <= kGdnDecodeMaxRows, "recorded rows run through the GDN decode kernel");

// The passes a sequence captures as graphs (kStep: a whole greedy verify step, greedy_step; kStepDrafts: the rest of
// its chained drafts after a fully accepted adaptive step; kSampledStep, kSampledStepDrafts: the same sampled,
// sampled_step).
enum PassKind { kTrunk, kHead, kHeadLogits, kStep, kStepDrafts, kSampledStep, kSampledStepDrafts };
static_assert(kRecordedRows <= kGreedyStepMaxRows, "a greedy step's rows are recorded rows");

// Scratch buffers of one pass of up to kChunkRows rows. Sized from the config; the attention scratch grows with the
// context.
struct Workspace {
  DeviceAllocation memory;
  int32_t* ids;
  int64_t* position;  // [kAttentionPasses]: of each attention pass's first row (the pass's first row at [0])
  float *stack, *normed, *low, *mix, *input, *inject, *output, *hidden;
  float *qkv, *z, *gate_b, *gate_a, *core, *gdn_chunks;  // gate_b, gate_a: in_proj_b, in_proj_a outputs
  float *q, *k, *v, *index_qk, *queries, *index_queries, *attended;
  float *router, *route_weights, *shared_gate_up, *shared_up, *shared_scale, *expert_gate, *expert_up, *expert_out;
  int* route_ids;
  // Prefill: slots grouped by expert (expert_prefill.cuh) and the grouped rows (gathered input, then down output).
  int *expert_counts, *expert_offsets, *expert_order, *expert_position;
  float* grouped_rows;          // or the split rows of the products on the codes (quant_gemm.cuh)
  GemvMatrix* moe_descriptors;  // a decode step's expert products, written on the device
  int* moe_slots;
  float* moe_slot_weights;
  float* moe_partials;  // the fused experts' down partials (expert_decode.cuh)
  // A 1-row MoE output in fixed point (expert_decode.cuh), all zero between passes: the read after it clears it.
  unsigned long long* output_fixed;
  int64_t* table_rows;
  float *embedding, *ple_keys, *ple_value, *ple_out, *ple_normed;
  float *logits, *mtp_row, *mtp_normed, *mtp_embedded;
  int32_t* greedy;  // [kLogitRows]: each logits row's argmax (argmax.cuh), with its scratch
  ArgmaxPartial* argmax_scratch;
  // A fused greedy step's outcome (greedy_step.cuh), its stop tokens, and the head stack its next draft comes from.
  GreedyStepState* step_state;
  GreedyStepStops* step_stops;
  float* step_stack;
  // Attention scratch for contexts up to `tokens` positions.
  DeviceAllocation attention_memory;
  int64_t tokens = 0;
  float* block_scores = nullptr;
  uint8_t* selected = nullptr;
  AttendScratch attend;  // sized for passes of kAttentionRows rows at any context
};

class Layout {
 public:
  template <typename T>
  void add(T*& slot, size_t count) {
    entries_.push_back({reinterpret_cast<void**>(&slot), total_});
    total_ += (count * sizeof(T) + 255) / 256 * 256;
  }
  DeviceAllocation allocate(const char* what) {
    DeviceAllocation memory = device_alloc(total_, what);
    for (const Entry& e : entries_) *e.slot = static_cast<char*>(memory.get()) + e.offset;
    return memory;
  }

 private:
  struct Entry {
    void** slot;
    size_t offset;
  };
  size_t total_ = 0;
  std::vector<Entry> entries_;
};

GdnShape gdn_shape(const ModelConfig& c) {
  return {c.linear_num_value_heads, c.linear_num_key_heads, c.linear_key_head_dim,
          c.linear_value_head_dim,  int(c.gdn_conv_dim()),  int(c.gdn_key_dim())};
}

AttentionShape attention_shape(const ModelConfig& c) {
  return {c.num_attention_heads,
          c.num_key_value_heads,
          c.head_dim,
          c.indexer_n_heads,
          c.indexer_head_dim,
          c.indexer_compress_ratio,
          c.indexer_budget / c.indexer_compress_ratio};
}

void make_workspace(const ModelConfig& c, Workspace& w) {
  const size_t r = kChunkRows, h = size_t(c.hidden_size), sh = size_t(c.hc_hidden()), s = size_t(c.hc_count);
  const size_t k = size_t(c.num_experts_per_tok);
  const size_t hd = size_t(c.head_dim), ihd = size_t(c.indexer_head_dim);
  Layout l;
  l.add(w.ids, r);
  l.add(w.position, kAttentionPasses);
  for (float** buffer : {&w.stack, &w.normed, &w.mix, &w.mtp_normed}) l.add(*buffer, r * sh);
  l.add(w.low, r * size_t(c.hc_lowrank));
  for (float** buffer : {&w.input, &w.output, &w.hidden, &w.mtp_row, &w.mtp_embedded}) l.add(*buffer, r * h);
  l.add(w.inject, r * s);
  l.add(w.qkv, r * size_t(c.gdn_conv_dim()));
  l.add(w.z, r * size_t(c.gdn_value_dim()));
  l.add(w.core, r * size_t(c.gdn_value_dim()));
  l.add(w.gate_b, r * size_t(c.linear_num_value_heads));
  l.add(w.gate_a, r * size_t(c.linear_num_value_heads));
  l.add(w.gdn_chunks, gdn_chunk_scratch_floats(gdn_shape(c), int(r)));
  l.add(w.q, r * size_t(c.num_attention_heads) * 2 * hd);
  l.add(w.k, r * size_t(c.num_key_value_heads) * hd);
  l.add(w.v, r * size_t(c.num_key_value_heads) * hd);
  l.add(w.index_qk, r * size_t(c.indexer_n_heads + 1) * ihd);
  l.add(w.queries, r * size_t(c.num_attention_heads) * hd);
  l.add(w.attended, r * size_t(c.num_attention_heads) * hd);
  l.add(w.index_queries, r * size_t(c.indexer_n_heads) * ihd);
  l.add(w.router, r * size_t(c.num_experts));
  l.add(w.route_weights, r * k);
  l.add(w.route_ids, r * k);
  l.add(w.shared_gate_up, r * size_t(c.shared_expert_intermediate_size));
  l.add(w.shared_up, r * size_t(c.shared_expert_intermediate_size));
  l.add(w.shared_scale, r);
  l.add(w.expert_gate, r * k * size_t(c.moe_intermediate_size));
  l.add(w.expert_up, r * k * size_t(c.moe_intermediate_size));
  l.add(w.expert_out, r * k * h);
  l.add(w.expert_counts, size_t(c.num_experts));
  l.add(w.expert_offsets, size_t(c.num_experts));
  l.add(w.expert_order, r * k);
  l.add(w.expert_position, r * k);
  // The gathered rows of the cuBLAS path, or the split rows of the products on the codes (gate/up's input, then
  // down's), never both in one layer.
  const size_t split_bytes =
      std::max(quant_split_bytes(int(r), int(h)), quant_split_bytes(int(r * k), int(c.moe_intermediate_size)));
  l.add(w.grouped_rows, std::max(r * k * h, (split_bytes + sizeof(float) - 1) / sizeof(float)));
  l.add(w.moe_descriptors, moe_descriptor_count(int(k)));
  l.add(w.moe_slots, moe_slot_count(int(k)));
  l.add(w.moe_slot_weights, moe_slot_weight_count(int(k)));
  l.add(w.moe_partials,
        expert_partial_count(int(k), int(c.moe_intermediate_size), int(c.shared_expert_intermediate_size), int(h)));
  l.add(w.output_fixed, h);
  l.add(w.table_rows, r * size_t(c.ngram_heads()));
  l.add(w.embedding, r * size_t(c.ple_embed_dim));
  for (float** buffer : {&w.ple_keys, &w.ple_out, &w.ple_normed}) l.add(*buffer, r * sh);
  l.add(w.ple_value, r * h);
  l.add(w.logits, size_t(kLogitRows) * size_t(c.vocab_size));
  l.add(w.greedy, kLogitRows);
  l.add(w.argmax_scratch, argmax_scratch_count(kLogitRows));
  l.add(w.step_state, 1);
  l.add(w.step_stops, 1);
  l.add(w.step_stack, sh);
  const AttentionShape attention = attention_shape(c);
  l.add(w.attend.values, attend_value_floats(attention, kAttentionRows));
  l.add(w.attend.stats, attend_stat_count(attention, kAttentionRows));
  l.add(w.attend.arrivals, attend_arrival_count(attention, kAttentionRows));
  w.memory = l.allocate("workspace");
  cuda_check(cudaMemset(w.attend.arrivals, 0, attend_arrival_count(attention, kAttentionRows) * sizeof(unsigned)),
             "workspace");
  cuda_check(cudaMemset(w.output_fixed, 0, h * sizeof(unsigned long long)), "workspace");
}

// Attention caches of one layer, grown by doubling.
struct AttentionCache {
  DeviceAllocation keys, values, index_keys, block_keys;
  int64_t capacity = 0;
};

// A recurrent state and what a rollback needs of a recorded pass: its copies after each recorded row ([kRecordedRows]
// of the same size; a rollback restores the copy of the last row it keeps), or for the GDN recurrence the state before
// the pass and each row's update (gdn_row_state_floats: a rollback replays the rows it keeps, gdn_replay).
struct RecurrentBuffer {
  DeviceAllocation now, rows;
  size_t bytes = 0;

  void make(size_t size, const char* what, size_t row_bytes = 0) {
    bytes = size;
    now = device_alloc(size, what);
    cuda_check(cudaMemset(now.get(), 0, size), what);
    rows = device_alloc(row_bytes ? row_bytes : size * kRecordedRows, what);
  }
  template <typename T>
  T* state() const {
    return static_cast<T*>(now.get());
  }
  template <typename T>
  T* recorded(bool record) const {
    return record ? static_cast<T*>(rows.get()) : nullptr;
  }
  void restore(size_t row, cudaStream_t stream) {
    if (!now) return;
    cuda_check(cudaMemcpyAsync(now.get(), static_cast<char*>(rows.get()) + row * bytes, bytes, cudaMemcpyDeviceToDevice,
                               stream),
               "rollback");
  }
};

struct LayerState {
  RecurrentBuffer gdn_conv, gdn_recurrent;  // [kernel−1, conv_dim], [heads, dk, dv]
  AttentionCache attention;
  RecurrentBuffer ple_previous, ple_conv;  // [ngram−1] int64, [(kernel−1)·ngram, S·H]
  MoeDecodePlan moe;
  // How a prefill chunk's routed experts run: grouped by expert on their codes (quant_gemm.cuh) or widened for cuBLAS
  // (gemm.cuh), else the per-slot products.
  enum class ExpertPrefill { OnCodes, Widened, PerSlot } expert_prefill = ExpertPrefill::PerSlot;
  // Products that share their input, one grouped launch per format in decode passes (product_groups.h): the GDN or
  // attention input projections, each hyper-connection read's mix_down and inject, PLE's key and value projections.
  ProductGroup mixer_inputs, attention_read, mlp_read, ple_inputs;

  // The recurrent buffers a rollback copies back (keep_rows, the fused step's rollback table); the GDN recurrence is
  // replayed instead (gdn_replay).
  std::array<RecurrentBuffer*, 3> copied_buffers() { return {&gdn_conv, &ple_previous, &ple_conv}; }
};

template <typename T>
T* ptr(const DeviceAllocation& a) {
  return static_cast<T*>(a.get());
}

LayerState new_layer_state(const ModelConfig& c, LayerKind kind, bool has_ple) {
  LayerState s;
  if (kind == LayerKind::GatedDeltaNet) {
    s.gdn_conv.make(size_t(c.linear_conv_kernel_dim - 1) * size_t(c.gdn_conv_dim()) * 4, "GDN state");
    s.gdn_recurrent.make(
        size_t(c.linear_num_value_heads) * size_t(c.linear_key_head_dim) * size_t(c.linear_value_head_dim) * 4,
        "GDN state", gdn_row_state_floats(gdn_shape(c), kRecordedRows) * 4);
  }
  if (has_ple) {
    const size_t context = size_t(c.ngram_size - 1);
    s.ple_previous.make(context * 8, "PLE state");
    std::vector<int64_t> eos(context, c.eos());
    cuda_check(cudaMemcpy(s.ple_previous.now.get(), eos.data(), context * 8, cudaMemcpyHostToDevice), "PLE state");
    s.ple_conv.make(size_t(c.ple_conv_kernel_size - 1) * size_t(c.ngram_size) * size_t(c.hc_hidden()) * 4, "PLE state");
  }
  return s;
}

// Pinned staging for one call's host inputs (ids, position, up to kRecordedRows MTP stacks) and outputs (logits,
// greedy ids and stacks of up to kRecordedRows rows); larger transfers go straight from and to pageable memory.
size_t staged_input_bytes(const ModelConfig& c) {
  return size_t(kChunkRows) * 4 + kAttentionPasses * 8 + size_t(kRecordedRows) * size_t(c.hc_hidden()) * 4 + 3 * 64;
}
size_t staged_output_bytes(const ModelConfig& c) {
  return size_t(kRecordedRows) * size_t(c.vocab_size + c.hc_hidden() + 1) * 4 + 3 * 64;
}

class CudaSequence final : public SequenceBackend {
 public:
  explicit CudaSequence(std::shared_ptr<const DeviceModel> model)
      : model_(std::move(model)),
        c_(model_->config),
        runner_(staged_input_bytes(c_), staged_output_bytes(c_), graphs_enabled_by_environment()),
        stream_(runner_.stream()) {
    check(c_.linear_key_head_dim <= kGdnMaxKeyDim && c_.linear_value_head_dim <= kGdnMaxValueDim,
          "{}: the GPU's Gated DeltaNet takes linear_key_head_dim ≤ {} and linear_value_head_dim ≤ {}, got {} and {}",
          model_->name, kGdnMaxKeyDim, kGdnMaxValueDim, c_.linear_key_head_dim, c_.linear_value_head_dim);
    for (int i = 0; i < c_.num_layers; ++i)
      layers_.push_back(new_layer_state(c_, c_.layer_kinds[size_t(i)], c_.is_ple_layer(i)));
    if (model_->mtp) mtp_state_ = new_layer_state(c_, LayerKind::SparseAttention, false);
    make_workspace(c_, work_);
    for (int i = 0; i < c_.num_layers; ++i) plan_layer(model_->layers[size_t(i)], layers_[size_t(i)]);
    final_read_ = read_products(model_->final_mixer);
    if (model_->mtp) {
      plan_layer(model_->mtp->layer, mtp_state_);
      mtp_final_read_ = read_products(model_->mtp->final_mixer);
    }
    make_rollback_table();
    // The state's memsets and the plans' uploads ran on the legacy stream, which the sequence's non-blocking stream
    // does not wait for.
    cuda_check(cudaDeviceSynchronize(), "sequence state");
  }
  ~CudaSequence() override { cudaStreamSynchronize(stream_); }

  int64_t position() const override { return position_; }

  void forward(std::span<const int32_t> ids, const TrunkOutputs& out) override {
    check(!ids.empty(), "forward: no tokens");
    for (int32_t id : ids)
      check(id >= 0 && id < c_.vocab_size, "token id {} is outside the vocabulary [0, {})", id, c_.vocab_size);
    check(!out.record_rows || ids.size() <= size_t(kRecordedRows), "the GPU records at most {} rows, got {}",
          kRecordedRows, ids.size());
    if (model_->expert_cache) model_->expert_cache->before_call(stream_);
    const int64_t n = int64_t(ids.size()), sh = c_.hc_hidden(), vocab = c_.vocab_size;
    recorded_from_ = out.record_rows ? position_ : -1;
    recorded_rows_ = out.record_rows ? n : 0;
    for (int64_t begin = 0; begin < n; begin += kChunkRows) {
      const int rows = int(std::min<int64_t>(kChunkRows, n - begin));
      const bool last = begin + rows == n;
      // Every row's logits (prompt scoring) come in kLogitRows-row products after the pass; otherwise the pass
      // computes the ones wanted itself. Greedy ids are the argmax of those logits, on the device.
      const bool lm_head = out.logits || out.greedy || out.keep_logits;
      const bool logits_after = lm_head && out.all_rows && rows > kLogitRows;
      const int logit_rows = !lm_head || logits_after || !(out.all_rows || last) ? 0 : out.all_rows ? rows : 1;
      const bool greedy = out.greedy && logit_rows;
      reserve_trunk(position_ + rows);
      stage(ids.subspan(size_t(begin), size_t(rows)), position_);
      run_pass({kTrunk, rows, out.record_rows, logit_rows, greedy},
               [&] { trunk_pass(rows, out.record_rows, logit_rows, greedy); });
      if (out.stacks) runner_.download(out.stacks + begin * sh, work_.stack, size_t(rows * sh) * 4);
      if (logit_rows && out.logits)
        runner_.download(out.logits + (out.all_rows ? begin * vocab : 0), work_.logits, size_t(logit_rows * vocab) * 4);
      if (greedy) runner_.download(out.greedy + (out.all_rows ? begin : 0), work_.greedy, size_t(logit_rows) * 4);
      for (int first = 0; logits_after && first < rows; first += kLogitRows) {
        const int count = std::min(kLogitRows, rows - first);
        logits_from_stacks(model_->final_mixer, final_read_, work_.stack + size_t(first) * size_t(sh), count, false);
        if (out.greedy) greedy_ids(count);
        if (out.logits) runner_.download(out.logits + (begin + first) * vocab, work_.logits, size_t(count * vocab) * 4);
        if (out.greedy) runner_.download(out.greedy + begin + first, work_.greedy, size_t(count) * 4);
      }
      runner_.finish();
      position_ += rows;
      kept_logit_rows_ = out.keep_logits && last ? logit_rows : 0;
    }
    cuda_check(cudaGetLastError(), "forward");
    // The step's picks are counted; the cache moves experts beside the next calls (expert_cache.h).
    if (model_->expert_cache) model_->expert_cache->between_calls(stream_);
  }

  void keep_rows(int64_t first_position, int64_t kept) override {
    check(kept >= 1 && first_position + kept <= position_ && recorded_from_ == first_position &&
              first_position + recorded_rows_ == position_,
          "keep_rows: cannot keep {} rows from position {}", kept, first_position);
    if (first_position + kept == position_) return;
    const size_t row = size_t(kept - 1);
    for (LayerState& layer : layers_)
      for (RecurrentBuffer* buffer : layer.copied_buffers()) buffer->restore(row, stream_);
    gdn_replay(gdn_shape(c_), static_cast<const GdnReplay*>(replay_table_.get()), replay_count_, nullptr, int(kept),
               int(recorded_rows_), stream_);
    position_ = first_position + kept;  // attention caches are truncated by the position alone
    recorded_rows_ = 0;
  }

  void mtp_forward(const float* stacks, std::span<const int32_t> next_ids, float* head_stacks,
                   MtpRows output) override {
    check(model_->mtp.has_value(), "{}: the checkpoint has no MTP head (mtp.* tensors)", model_->name);
    for (int32_t id : next_ids) check(id >= 0 && id < c_.vocab_size, "token id {} is outside the vocabulary", id);
    const int64_t n = int64_t(next_ids.size()), sh = c_.hc_hidden();
    if (model_->expert_cache) model_->expert_cache->before_call(stream_);
    kept_logit_rows_ = 0;
    for (int64_t begin = 0; begin < n; begin += kChunkRows) {
      const int rows = int(std::min<int64_t>(kChunkRows, n - begin));
      if (model_->mtp->layer.kind == LayerKind::SparseAttention)
        reserve_attention(mtp_state_.attention, mtp_position_ + rows);
      stage(next_ids.subspan(size_t(begin), size_t(rows)), mtp_position_);
      runner_.upload(work_.mtp_normed, stacks + begin * sh, size_t(rows * sh) * 4);
      run_pass({kHead, rows, false, 0}, [&] { head_pass(rows); });
      if (output == MtpRows::All)
        runner_.download(head_stacks + begin * sh, work_.stack, size_t(rows * sh) * 4);
      else if (begin + rows == n)
        runner_.download(head_stacks, work_.stack + size_t(rows - 1) * size_t(sh), size_t(sh) * 4);
      runner_.finish();
      mtp_position_ += rows;
    }
    cuda_check(cudaGetLastError(), "MTP head");
  }

  bool samples_on_device() const override { return true; }
  SampledVerify verify_sampled(std::span<const int32_t> rows, const SampleRequest& request) override {
    check(kept_logit_rows_ == int(rows.size()), "verify_sampled: the last pass kept {} rows of logits, not {}",
          kept_logit_rows_, rows.size());
    kept_logit_rows_ = 0;
    return sampler().verify(work_.logits, rows, request, runner_);
  }
  int32_t draft_sampled(const float* head_stack, int index, const SampleRequest& request) override {
    head_outputs(head_stack, 1, nullptr, nullptr);  // the draft's logits stay in work_.logits
    return sampler().draft(work_.logits, index, request, runner_);
  }
  void replace_draft(int index, int32_t token) override { sampler().replace(index, token, runner_); }

  void mtp_logits(const float* head_stacks, int64_t rows, float* logits) override {
    head_outputs(head_stacks, rows, logits, nullptr);
  }
  void mtp_greedy(const float* head_stacks, int64_t rows, int32_t* ids) override {
    head_outputs(head_stacks, rows, nullptr, ids);
  }

  // The whole step as one pass (one graph when graphs are on), one download and one synchronisation; the default
  // composition where the fused one does not apply (fused_step_applies).
  GreedyStepResult greedy_step(const GreedyStep& step) override {
    kept_logit_rows_ = 0;
    if (!fused_step_applies(step)) return SequenceBackend::greedy_step(step);
    return run_fused_step(step, false);
  }

  // greedy_step's graph with the tokens sampled on the device (sampling.cuh) instead of the argmax; not with penalties,
  // whose tokens (the step's emitted ones) the host would have to send before the drafts.
  bool sampled_step(const GreedyStep& step, const SampleRequest& request, SampledStepResult& result) override {
    kept_logit_rows_ = 0;
    const SamplingOptions& o = *request.options;
    if (!fused_step_applies(step) || step.accept_all || o.repetition_penalty != 1 || o.presence_penalty != 0 ||
        o.frequency_penalty != 0)
      return false;
    sampler().prepare(step.rows, request, runner_);
    if (sampler().generation() != sampler_generation_) sampler_generation_ = sampler().generation(), ++generation_;
    result.step = run_fused_step(step, true);
    result.uniforms = sampler().uniforms();
    return true;
  }

  // The fused step: one graph (two after a fully accepted adaptive step), one synchronisation; `sampled`: by the
  // prepared sampler instead of the argmax.
  GreedyStepResult run_fused_step(const GreedyStep& step, bool sampled) {
    for (int32_t id : step.rows)
      check(id >= 0 && id < c_.vocab_size, "token id {} is outside the vocabulary [0, {})", id, c_.vocab_size);
    check(mtp_position_ == position_, "greedy_step: the head is at {}, the trunk at {}", mtp_position_, position_);
    // Adaptive drafting wants fewer drafts after a rejection: the step's graph drafts that many, and a fully accepted
    // step runs the rest of its chained drafts as a second graph (a second synchronisation) rather than every step
    // paying for chained passes a rejection discards.
    const int rows = int(step.rows.size()), drafts = std::min(step.drafts, step.drafts_after_rejection);
    const int most = std::max(step.drafts, step.drafts_after_rejection);
    const int64_t first = position_;
    reserve_trunk(first + rows);
    // Head rows at first … first + rows − 1, chained drafts at committed + j − 1 ≤ first + rows + most − 2: the
    // capacity the composed calls would reserve when every draft is kept.
    reserve_attention(mtp_state_.attention, first + rows + most - 1);
    upload_stops(step.stops);
    stage(step.rows, first);
    GreedyStepState outcome{};
    // The pass's outcome (and the sampler's, with its rows' errors) after its one synchronisation.
    const auto collect = [&](const char* what) {
      runner_.download(&outcome, work_.step_state, sizeof outcome);
      if (sampled) sampler().download_outcome(DeviceSampler::kMaxRows, runner_);
      runner_.finish();
      cuda_check(cudaGetLastError(), what);
      if (sampled) sampler().check_status(DeviceSampler::kMaxRows);
    };
    run_pass({sampled ? kSampledStep : kStep, rows, true, drafts, step.accept_all},
             [&] { fused_step(rows, drafts, step.accept_all, sampled); });
    collect("greedy step");
    check(outcome.kept >= 1 && outcome.kept <= rows, "greedy step: the device kept {} of {} rows", outcome.kept, rows);
    const int wanted = outcome.kept == rows ? step.drafts : step.drafts_after_rejection;
    if (wanted > drafts) {  // kStepDrafts' shape: the first draft it makes (as rows) and the count (as logits)
      run_pass({sampled ? kSampledStepDrafts : kStepDrafts, drafts, false, wanted, false}, [&] {
        for (int j = drafts; j < wanted; ++j) draft_pass(j, sampled);
      });
      collect("greedy step drafts");
    }
    position_ = first + outcome.kept;  // rolled back on the device; attention caches are truncated by the position
    mtp_position_ = position_;
    recorded_from_ = -1;
    recorded_rows_ = 0;
    GreedyStepResult result;
    result.emitted.assign(outcome.emitted, outcome.emitted + outcome.kept);
    result.drafts.assign(outcome.drafts, outcome.drafts + wanted);
    return result;
  }

  void truncate_head(int64_t position) override {
    check(position >= 0 && position <= mtp_position_, "truncate_head: position {} is past the head's {}", position,
          mtp_position_);
    mtp_position_ = position;
  }

  // Device→host copies on the sequence's stream (state_transfer.h), synchronised before the state is returned.
  void export_state(SequenceState& state) override {
    state.position = position_;
    state.mtp_position = mtp_position_;
    state.layers.resize(layers_.size());
    for (size_t i = 0; i < layers_.size(); ++i)
      download_layer_state(c_, state_view(model_->layers[i].kind, layers_[i]), position_, state.layers[i], stream_);
    if (model_->mtp)
      download_layer_state(c_, state_view(model_->mtp->layer.kind, mtp_state_), mtp_position_, state.mtp, stream_);
    else
      state.mtp = {};
    cuda_check(cudaStreamSynchronize(stream_), "state export");
  }

  // The caches grow to the state's positions first (invalidating captured graphs as any growth does); the recorded
  // rows of the last pass no longer apply.
  void import_state(const SequenceState& state) override {
    check_state_fits(state, c_, model_->mtp.has_value());
    reserve_trunk(state.position);
    if (model_->mtp && model_->mtp->layer.kind == LayerKind::SparseAttention)
      reserve_attention(mtp_state_.attention, state.mtp_position);
    for (size_t i = 0; i < layers_.size(); ++i)
      upload_layer_state(c_, state_view(model_->layers[i].kind, layers_[i]), state.position, state.layers[i], stream_);
    if (model_->mtp)
      upload_layer_state(c_, state_view(model_->mtp->layer.kind, mtp_state_), state.mtp_position, state.mtp, stream_);
    cuda_check(cudaStreamSynchronize(stream_), "state import");
    position_ = state.position;
    mtp_position_ = state.mtp_position;
    recorded_from_ = -1;
    recorded_rows_ = 0;
  }

 private:
  static DeviceLayerStateView state_view(LayerKind kind, const LayerState& state) {
    const AttentionCache& cache = state.attention;
    return {.gdn_conv = state.gdn_conv.state<float>(),
            .gdn_recurrent = state.gdn_recurrent.state<float>(),
            .attention = kind == LayerKind::SparseAttention,
            .keys = ptr<float>(cache.keys),
            .values = ptr<float>(cache.values),
            .index_keys = ptr<float>(cache.index_keys),
            .block_keys = ptr<float>(cache.block_keys),
            .attention_capacity = cache.capacity,
            .ple_previous = state.ple_previous.state<int64_t>(),
            .ple_conv = state.ple_conv.state<float>()};
  }
  // A pass's token ids and the first positions of its attention passes (kAttentionRows rows each), to the device
  // ahead of its launches.
  void stage(std::span<const int32_t> ids, int64_t first) {
    runner_.upload(work_.ids, ids.data(), ids.size() * 4);
    const int passes = int((ids.size() + kAttentionRows - 1) / kAttentionRows);
    int64_t firsts[kAttentionPasses];
    for (int j = 0; j < passes; ++j) firsts[j] = first + int64_t(j) * kAttentionRows;
    runner_.upload(work_.position, firsts, size_t(passes) * sizeof first);
  }
  // The head's logits of `rows` host head stacks and/or their greedy ids (either may be null).
  void head_outputs(const float* head_stacks, int64_t rows, float* logits, int32_t* ids) {
    check(model_->mtp.has_value(), "{}: the checkpoint has no MTP head (mtp.* tensors)", model_->name);
    kept_logit_rows_ = 0;
    const int64_t sh = c_.hc_hidden(), vocab = c_.vocab_size;
    for (int64_t begin = 0; begin < rows; begin += kLogitRows) {
      const int count = int(std::min<int64_t>(kLogitRows, rows - begin));
      runner_.upload(work_.stack, head_stacks + begin * sh, size_t(count * sh) * 4);
      run_pass({kHeadLogits, count, false, count, ids != nullptr}, [&] {
        logits_from_stacks(model_->mtp->final_mixer, mtp_final_read_, work_.stack, count, false);
        if (ids) greedy_ids(count);
      });
      if (logits) runner_.download(logits + begin * vocab, work_.logits, size_t(count * vocab) * 4);
      if (ids) runner_.download(ids + begin, work_.greedy, size_t(count) * 4);
      runner_.finish();
    }
  }
  // Whether greedy_step runs fused on the device: every weight resident (no expert cache), an attention head, no
  // oracle drafts (the host replaces them), at most kGreedyStepMaxStops stops, recorded rows only.
  bool fused_step_applies(const GreedyStep& step) const {
    return step.head && model_->mtp && model_->mtp->layer.kind == LayerKind::SparseAttention && !model_->expert_cache &&
           !step.draft_override && step.stops.size() <= size_t(kGreedyStepMaxStops) && !step.rows.empty() &&
           step.rows.size() <= size_t(kRecordedRows) && step.stack_size == c_.hc_hidden() &&
           std::min(step.drafts, step.drafts_after_rejection) >= 1 &&
           std::max(step.drafts, step.drafts_after_rejection) <= kGreedyStepMaxDrafts;
  }
  // The stop tokens to the device when they differ from the last ones sent (once per sequence in practice).
  void upload_stops(std::span<const int64_t> stops) {
    std::vector<int32_t> ids(stops.begin(), stops.end());
    if (stops_sent_ && ids == stops_) return;
    GreedyStepStops device{};
    device.count = int32_t(ids.size());
    std::copy(ids.begin(), ids.end(), device.ids);
    runner_.upload(work_.step_stops, &device, sizeof device);
    stops_ = std::move(ids);
    stops_sent_ = true;
  }
  // Every recurrent buffer a rollback copies back (keep_rows' list), for greedy_rollback's single launch, and every
  // GDN recurrence it replays, for gdn_replay's.
  void make_rollback_table() {
    std::vector<RollbackBuffer> table;
    std::vector<GdnReplay> replays;
    for (LayerState& layer : layers_) {
      for (RecurrentBuffer* buffer : layer.copied_buffers())
        if (buffer->now) {
          check(buffer->bytes % 4 == 0, "rollback: a recurrent state of {} bytes", buffer->bytes);
          table.push_back({buffer->now.get(), buffer->rows.get(), buffer->bytes});
        }
      if (layer.gdn_recurrent.now)
        replays.push_back({layer.gdn_recurrent.recorded<float>(true), layer.gdn_recurrent.state<float>()});
    }
    rollback_count_ = int(table.size());
    rollback_table_ = upload_table(table, "rollback table");
    replay_count_ = int(replays.size());
    replay_table_ = upload_table(replays, "rollback table");
  }
  template <typename T>
  static DeviceAllocation upload_table(const std::vector<T>& table, const char* what) {
    if (table.empty()) return {};
    DeviceAllocation memory = device_alloc(table.size() * sizeof(T), what);
    cuda_check(cudaMemcpy(memory.get(), table.data(), table.size() * sizeof(T), cudaMemcpyHostToDevice), what);
    return memory;
  }
  // work_.greedy = the argmax of each of work_.logits' first `rows` rows.
  void greedy_ids(int rows) {
    cuda_check(argmax_rows(work_.logits, rows, c_.vocab_size, work_.argmax_scratch, work_.greedy, stream_), "argmax");
  }
  // Passes of up to kRecordedRows rows (decode steps, verification, drafts) replay graphs; longer chunks (prefill)
  // launch eagerly.
  void run_pass(const PassShape& shape, const std::function<void()>& launch) {
    if (shape.rows <= kRecordedRows)
      runner_.run(shape, generation_, launch);
    else
      launch();
  }
  void plan_layer(const DeviceLayer& w, LayerState& state) const;
  ProductGroup read_products(const DeviceGatedResidual& w) const;
  void trunk_pass(int rows, bool record, int logit_rows, bool greedy);
  void fused_step(int rows, int drafts, bool accept_all, bool sampled);
  void draft_pass(int j, bool sampled);
  void head_pass(int rows);
  void run_layer(const DeviceLayer& w, LayerState& state, int64_t first, int rows, bool record, float* stack,
                 bool normed, const DeviceGatedResidual* next_read);
  bool fused_read(const DeviceGatedResidual& w, int rows) const;
  void hyper_read(const DeviceGatedResidual& w, const ProductGroup& reads, float* stack, int rows, float* input,
                  bool normed);
  void hyper_write(float* stack, int rows, const DeviceGatedResidual* next_read);
  void gated_deltanet(const DeviceGatedDeltaNet& w, LayerState& state, int rows, bool record);
  void attention(const DeviceAttention& w, LayerState& state, int64_t first, int rows);
  MoeBuffers moe_buffers() const;
  void moe(const DeviceMoe& w, const MoeDecodePlan& plan, int rows, bool output_fixed);
  bool moe_output_fixed(const MoeDecodePlan& plan, int rows, const DeviceGatedResidual* next_read) const;
  void moe_prefill(const DeviceMoe& w, int rows, bool on_codes);
  void route_and_shared_expert(const DeviceMoe& w, int rows);
  void ple(const DevicePle& w, LayerState& state, int rows, bool record, float* stack);
  void logits_from_stacks(const DeviceGatedResidual& mixer, const ProductGroup& reads, float* stacks, int rows,
                          bool normed);
  void reserve_trunk(int64_t tokens);
  void reserve_attention(AttentionCache& cache, int64_t tokens);

  std::shared_ptr<const DeviceModel> model_;
  const ModelConfig& c_;
  StepRunner runner_;
  cudaStream_t stream_;  // every launch of the sequence
  std::vector<LayerState> layers_;
  LayerState mtp_state_;
  Workspace work_;
  ProductGroup final_read_, mtp_final_read_;  // the final mixers' reads (trunk and MTP head)
  uint64_t generation_ = 0;                   // counts reallocations of memory that captured graphs address
  int64_t position_ = 0, mtp_position_ = 0;
  int64_t recorded_from_ = -1, recorded_rows_ = 0;
  DeviceAllocation rollback_table_;  // [rollback_count_] RollbackBuffer: every copied recurrent buffer, fixed for life
  int rollback_count_ = 0;
  DeviceAllocation replay_table_;  // [replay_count_] GdnReplay: every GDN layer's recurrence, fixed for life
  int replay_count_ = 0;
  std::vector<int32_t> stops_;  // the stop tokens on the device (work_.step_stops), once stops_sent_
  bool stops_sent_ = false;
  // The stack still lacks the last hyper-connection write (work_.inject's gates times work_.output, or
  // work_.output_fixed when pending_fixed_): the next read, a fused one, applies it (hyper_write).
  bool write_pending_ = false;
  bool pending_fixed_ = false;
  // Rows of logits the last forward left in work_.logits for verify_sampled (TrunkOutputs::keep_logits), else 0.
  int kept_logit_rows_ = 0;
  std::unique_ptr<DeviceSampler> sampler_;  // made on the first sampled call
  uint64_t sampler_generation_ = 0;         // the sampler's generation the captured graphs hold
  DeviceSampler& sampler() {
    if (!sampler_) sampler_ = std::make_unique<DeviceSampler>(c_.vocab_size);
    return *sampler_;
  }
};

void CudaSequence::trunk_pass(int rows, bool record, int logit_rows, bool greedy) {
  gather_rows(model_->embed, work_.ids, rows, c_.hc_count, work_.stack, stream_);
  // Each layer's last write prepares the stack for the next read (hyper_write): the next layer's attention read (not
  // when it has PLE, which reads the raw stack first), or after the last layer the final mixer's when it reads every
  // row.
  const DeviceGatedResidual* final_read = logit_rows == rows ? &model_->final_mixer : nullptr;
  bool normed = false;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DeviceLayer* next = i + 1 < layers_.size() ? &model_->layers[i + 1] : nullptr;
    const DeviceGatedResidual* next_read = next ? (next->ple ? nullptr : &next->attn_hc) : final_read;
    run_layer(model_->layers[i], layers_[i], position_, rows, record, work_.stack, normed, next_read);
    normed = next_read != nullptr;
  }
  if (logit_rows)
    logits_from_stacks(model_->final_mixer, final_read_,
                       work_.stack + size_t(rows - logit_rows) * size_t(c_.hc_hidden()), logit_rows, normed);
  if (greedy) greedy_ids(logit_rows);
}

// A greedy verify step of `rows` staged rows without the host: the recorded trunk pass (every row's greedy id), the
// accepted prefix (greedy_accept), the rollback (greedy_rollback), the head over every row of the pass with the trunk's
// stacks and greedy ids — rows past the kept ones only write head cache entries past the committed position, which
// the chained passes and later steps overwrite before any row reads them (attention reads its cache causally, by
// position) — then `drafts` drafts: the head logits' argmax of the last kept row's head stack, and for each further
// draft a one-row head pass at committed + j − 1 on the previous draft and head stack.
// sampled: the rows' tokens by the device sampler's verification (its emitted tokens are what greedy_accept keeps:
// each accepted draft, then the first other token) instead of the trunk's argmax.
void CudaSequence::fused_step(int rows, int drafts, bool accept_all, bool sampled) {
  const int64_t sh = c_.hc_hidden();
  const char* what = "greedy step";
  trunk_pass(rows, true, rows, !sampled);
  const int32_t* chosen = sampled ? sampler().launch_verify(work_.logits, rows, stream_) : work_.greedy;
  cuda_check(greedy_accept(work_.ids, chosen, work_.step_stops, rows, accept_all, work_.position, work_.step_state,
                           work_.ids, stream_),
             what);
  cuda_check(greedy_rollback(static_cast<const RollbackBuffer*>(rollback_table_.get()), rollback_count_,
                             work_.step_state, rows, stream_),
             what);
  gdn_replay(gdn_shape(c_), static_cast<const GdnReplay*>(replay_table_.get()), replay_count_, &work_.step_state->kept,
             0, rows, stream_);
  cuda_check(greedy_copy_row(work_.stack, 0, false, work_.step_state, work_.mtp_normed, rows * sh, stream_), what);
  head_pass(rows);
  cuda_check(greedy_copy_row(work_.stack, sh, true, work_.step_state, work_.step_stack, sh, stream_), what);
  for (int j = 0; j < drafts; ++j) draft_pass(j, sampled);
}

// Draft j of a fused step: for j > 0 a one-row head pass on draft j − 1 and the head stack it came from (the position
// greedy_take_draft left), then the head's logits and argmax of the stack.
void CudaSequence::draft_pass(int j, bool sampled) {
  const int64_t sh = c_.hc_hidden();
  const char* what = "greedy step draft";
  if (j > 0) {
    cuda_check(greedy_copy_row(work_.step_stack, 0, false, work_.step_state, work_.mtp_normed, sh, stream_), what);
    head_pass(1);
    cuda_check(greedy_copy_row(work_.stack, sh, false, work_.step_state, work_.step_stack, sh, stream_), what);
  }
  logits_from_stacks(model_->mtp->final_mixer, mtp_final_read_, work_.step_stack, 1, false);
  const int32_t* draft = work_.greedy;
  if (sampled)
    draft = sampler().launch_draft(work_.logits, j, stream_);
  else
    greedy_ids(1);
  cuda_check(greedy_take_draft(j, draft, work_.step_state, work_.ids, work_.position, stream_), what);
}

// e = fc_embedding · RMS0(embed[next]);  R'[s] = fc_hidden · RMS0(R)[s] + e; then the head's layer. The stacks R
// were staged in work_.mtp_normed.
void CudaSequence::head_pass(int rows) {
  const DeviceMtp& m = *model_->mtp;
  const int64_t h = c_.hidden_size, sh = c_.hc_hidden();
  const float eps = c_.rms_norm_eps;
  gather_rows(model_->embed, work_.ids, rows, 1, work_.mtp_row, stream_);
  rms_norm(work_.mtp_row, h, 0, rows, 1, int(h), m.pre_fc_norm_embedding, 0, eps, work_.mtp_row, stream_);
  linear(m.fc_embedding, work_.mtp_row, rows, work_.mtp_embedded, stream_);
  rms_norm(work_.mtp_normed, sh, 0, rows, 1, int(sh), m.pre_fc_norm_hidden, 0, eps, work_.mtp_normed, stream_);
  linear(m.fc_hidden, work_.mtp_normed, rows * c_.hc_count, work_.stack, stream_);
  add_to_streams(work_.stack, work_.mtp_embedded, rows, c_.hc_count, int(h), stream_);
  run_layer(m.layer, mtp_state_, mtp_position_, rows, false, work_.stack, false, nullptr);
}

// normed: work_.normed already holds the attention read's norm of the stack (or the write is pending for a fused
// read). next_read: the read after this layer, which its last write prepares the stack for (hyper_write).
void CudaSequence::run_layer(const DeviceLayer& w, LayerState& state, int64_t first, int rows, bool record,
                             float* stack, bool normed, const DeviceGatedResidual* next_read) {
  const kernel_trace::LayerScope traced(w.kind == LayerKind::GatedDeltaNet ? "gdn" : "attention");
  if (w.ple) ple(*w.ple, state, rows, record, stack);
  hyper_read(w.attn_hc, state.attention_read, stack, rows, work_.input, normed && !w.ple);
  if (w.kind == LayerKind::GatedDeltaNet)
    gated_deltanet(w.gdn, state, rows, record);
  else
    attention(w.attn, state, first, rows);
  hyper_write(stack, rows, &w.mlp_hc);
  hyper_read(w.mlp_hc, state.mlp_read, stack, rows, work_.input, true);
  if (rows > kMaxDecodeRows && state.expert_prefill != LayerState::ExpertPrefill::PerSlot)
    moe_prefill(w.moe, rows, state.expert_prefill == LayerState::ExpertPrefill::OnCodes);
  else
    moe(w.moe, state.moe, rows, moe_output_fixed(state.moe, rows, next_read));
  if (w.moe.cache_layer >= 0)  // every MoE path leaves the picks in route_ids
    model_->expert_cache->record_use(w.moe.cache_layer, work_.route_ids, rows * c_.num_experts_per_tok, stream_);
  hyper_write(stack, rows, next_read);
}

// The products of one layer's inputs that read the same workspace buffer, grouped once for the sequence's life.
void CudaSequence::plan_layer(const DeviceLayer& w, LayerState& state) const {
  state.moe = plan_moe_decode(w.moe, moe_shape(c_), moe_buffers());
  const DeviceMoe& m = w.moe;
  const int experts = c_.num_experts, h = int(c_.hidden_size), inner = int(c_.moe_intermediate_size);
  if (quant_gemm_reads_all(m.expert_gate, experts, m.gate_up_format, inner, h) &&
      quant_gemm_reads_all(m.expert_up, experts, m.gate_up_format, inner, h) &&
      quant_gemm_reads_all(m.expert_down, experts, m.down_format, h, inner))
    state.expert_prefill = LayerState::ExpertPrefill::OnCodes;
  else if (gemm_widens(m.gate_up_format) && gemm_widens(m.down_format))
    state.expert_prefill = LayerState::ExpertPrefill::Widened;
  if (w.kind == LayerKind::GatedDeltaNet)
    state.mixer_inputs = make_product_group(
        work_.input,
        {{w.gdn.in_qkv, work_.qkv}, {w.gdn.in_z, work_.z}, {w.gdn.in_b, work_.gate_b}, {w.gdn.in_a, work_.gate_a}});
  else
    state.mixer_inputs = make_product_group(
        work_.input,
        {{w.attn.q, work_.q}, {w.attn.k, work_.k}, {w.attn.v, work_.v}, {w.attn.index_qk, work_.index_qk}});
  state.attention_read = read_products(w.attn_hc);
  state.mlp_read = read_products(w.mlp_hc);
  if (w.ple)
    state.ple_inputs =
        make_product_group(work_.embedding, {{w.ple->key_proj, work_.ple_keys}, {w.ple->value_proj, work_.ple_value}});
}

// A hyper-connection read's products of the normed stack: mix_down, and inject when the read has one.
ProductGroup CudaSequence::read_products(const DeviceGatedResidual& w) const {
  std::vector<std::pair<DeviceMatrix, float*>> products{{w.mix_down, work_.low}};
  if (w.has_inject) products.emplace_back(w.inject, work_.inject);
  return make_product_group(work_.normed, std::move(products));
}

// Whether w's read of `rows` rows runs as hc_fused_read (two kernels, the previous write folded in).
bool CudaSequence::fused_read(const DeviceGatedResidual& w, int rows) const {
  const DeviceMatrix* inject = w.has_inject ? &w.inject : nullptr;
  const int outputs = w.mix_down.rows + (inject ? inject->rows : 0);
  const bool fits = hc_fused_read_fits(w.mix_down, w.mix_up, inject, w.norm, c_.hc_count, int(c_.hidden_size), rows);
  return rows <= kMaxDecodeRows && fits &&
         hc_fused_read_scratch_floats(outputs) <= size_t(kChunkRows) * size_t(c_.hc_hidden());  // in work_.mix
}

// The hyper-connection write of the last mixer or MoE output (work_.output, gated by work_.inject) into stack. When
// next_read (the read that follows on the same rows) is fused, it applies the write itself; otherwise the write also
// normalises the stack for next_read (work_.normed).
void CudaSequence::hyper_write(float* stack, int rows, const DeviceGatedResidual* next_read) {
  if (next_read && fused_read(*next_read, rows)) {
    write_pending_ = true;
    return;
  }
  check(!pending_fixed_, "hyper-connection write: a fixed-point output reached a write that does not read it");
  hc_write(work_.inject, work_.output, rows, c_.hc_count, int(c_.hidden_size), stack,
           next_read ? next_read->norm : nullptr, c_.rms_norm_eps, work_.normed, stream_);
}

// input = the hyper-connection read of stack; work_.inject = the raw inject projection (hc_write applies its gate).
// reads: w's read_products.
void CudaSequence::hyper_read(const DeviceGatedResidual& w, const ProductGroup& reads, float* stack, int rows,
                              float* input, bool normed) {
  const int s = c_.hc_count, h = int(c_.hidden_size);
  const int64_t sh = c_.hc_hidden();
  if (fused_read(w, rows)) {
    const HcFusedRead read{.mix_down = w.mix_down,
                           .mix_up = w.mix_up,
                           .inject = w.has_inject ? w.inject : DeviceMatrix{},
                           .norm = w.norm,
                           .streams = s,
                           .hidden = h,
                           .eps = c_.rms_norm_eps};
    cuda_check(hc_fused_read(read, rows, stack, write_pending_, work_.output, work_.inject, work_.mix, input, stream_,
                             pending_fixed_ ? work_.output_fixed : nullptr),
               "hyper-connection read");
    write_pending_ = pending_fixed_ = false;
    return;
  }
  check(!write_pending_, "hyper-connection read: a deferred write reached a read that does not apply it");
  if (!normed) rms_norm(stack, sh, h, rows, s, h, w.norm, h, c_.rms_norm_eps, work_.normed, stream_);
  run_products(reads, rows, stream_);
  hc_low_activation(work_.low, int64_t(rows) * c_.hc_lowrank, s, stream_);
  linear(w.mix_up, work_.low, rows, work_.mix, stream_);
  hc_combine(work_.mix, work_.normed, rows, s, h, input, stream_);
}

void CudaSequence::gated_deltanet(const DeviceGatedDeltaNet& w, LayerState& state, int rows, bool record) {
  run_products(state.mixer_inputs, rows, stream_);  // in_qkv, in_z, in_b, in_a
  const GdnConvState conv{w.conv, c_.linear_conv_kernel_dim, state.gdn_conv.state<float>(),
                          state.gdn_conv.recorded<float>(record)};
  const GdnInputs in{work_.qkv, work_.gate_b,    work_.gate_a,        w.a_log, w.dt_bias, work_.z,
                     w.norm,    c_.rms_norm_eps, c_.gdn_gate_sigmoid, rows};
  float* recurrent = state.gdn_recurrent.state<float>();
  // Decode rows (and recorded ones, at most kRecordedRows) go one after the other with the conv folded in, their
  // state loads overlapping the input products (a dependent launch); longer passes convolve first and run
  // chunk-parallel.
  if (record || rows <= kGdnDecodeMaxRows) {
    gdn_conv_decode(gdn_shape(c_), conv, work_.qkv, in, recurrent, state.gdn_recurrent.recorded<float>(record),
                    work_.core, true, stream_);
  } else {
    gdn_conv(conv.taps, int(c_.gdn_conv_dim()), conv.kernel, conv.state, work_.qkv, rows, conv.row_states, stream_);
    gdn_prefill(gdn_shape(c_), in, recurrent, work_.gdn_chunks, work_.core, stream_);
  }
  linear(w.out, work_.core, rows, work_.output, stream_);
}

void CudaSequence::reserve_trunk(int64_t tokens) {
  for (size_t i = 0; i < layers_.size(); ++i)
    if (model_->layers[i].kind == LayerKind::SparseAttention) reserve_attention(layers_[i].attention, tokens);
}

// Grows a cache (by doubling) and the attention scratch before a pass, never inside one: the stream is drained first
// because its queued work may still address the old memory, and captured graphs are invalidated.
void CudaSequence::reserve_attention(AttentionCache& cache, int64_t tokens) {
  const size_t kv = size_t(c_.num_key_value_heads) * size_t(c_.head_dim) * 4, index = size_t(c_.indexer_head_dim) * 4;
  if (tokens > cache.capacity) {
    const int64_t capacity = std::max<int64_t>({tokens, 2 * cache.capacity, 1024}), ratio = c_.indexer_compress_ratio;
    // Block keys: one row per complete block, plus one so that any capacity fits.
    auto blocks = [&](int64_t positions) { return positions ? positions / ratio + 1 : 0; };
    auto grow = [&](DeviceAllocation& buffer, size_t row_bytes, int64_t old_rows, int64_t rows) {
      DeviceAllocation bigger = device_alloc(row_bytes * size_t(rows), "attention cache");
      if (old_rows)
        cuda_check(cudaMemcpyAsync(bigger.get(), buffer.get(), row_bytes * size_t(old_rows), cudaMemcpyDeviceToDevice,
                                   stream_),
                   "attention cache");
      cuda_check(cudaStreamSynchronize(stream_), "attention cache");
      buffer = std::move(bigger);
    };
    grow(cache.keys, kv, cache.capacity, capacity);
    grow(cache.values, kv, cache.capacity, capacity);
    grow(cache.index_keys, index, cache.capacity, capacity);
    grow(cache.block_keys, index, blocks(cache.capacity), blocks(capacity));
    cache.capacity = capacity;
    ++generation_;
  }
  if (tokens > work_.tokens) {
    const int64_t capacity = std::max<int64_t>({tokens, 2 * work_.tokens, 1024});
    const size_t blocks = size_t(capacity / c_.indexer_compress_ratio + 1);
    cuda_check(cudaStreamSynchronize(stream_), "attention scratch");
    Layout l;
    l.add(work_.block_scores, kAttentionRows * blocks);
    l.add(work_.selected, kAttentionRows * blocks);
    work_.attention_memory = l.allocate("attention scratch");
    work_.tokens = capacity;
    ++generation_;
  }
}

void CudaSequence::attention(const DeviceAttention& w, LayerState& state, int64_t first, int rows) {
  const AttentionShape shape = attention_shape(c_);
  const AttentionCache& cache = state.attention;
  const AttentionCaches caches{ptr<float>(cache.keys), ptr<float>(cache.values), ptr<float>(cache.index_keys),
                               ptr<float>(cache.block_keys)};
  run_products(state.mixer_inputs, rows, stream_);  // q, k, v, index_qk
  const AttentionInputs in{work_.q,        work_.k,        work_.v,          work_.index_qk, w.q_norm,       w.k_norm,
                           w.index_q_norm, w.index_k_norm, model_->inv_freq, c_.rotary_dim,  c_.rms_norm_eps};
  attention_inputs(shape, in, rows, work_.position, work_.queries, work_.index_queries, caches, stream_);
  // Every row's keys are in the cache by now; rows attend (causally) in passes of kAttentionRows to bound the scratch,
  // pass j's first position staged at work_.position[j]. A captured pass serves every position up to the capacity,
  // so its grids span it; a longer (eager) pass's span its own end.
  const size_t heads = size_t(shape.heads), hd = size_t(shape.head_dim);
  const size_t index_width = size_t(shape.index_heads) * size_t(shape.index_dim);
  for (int pass = 0; pass < rows; pass += kAttentionRows) {
    const int count = std::min(kAttentionRows, rows - pass);
    const int64_t* at = work_.position + pass / kAttentionRows;
    const int64_t span = rows <= kRecordedRows ? std::min(cache.capacity, work_.tokens) : first + pass + count;
    const AttentionBounds bounds{int(span), int(work_.tokens)};
    qsa_select(shape, work_.index_queries + size_t(pass) * index_width, caches.block_keys, count, at, bounds,
               work_.block_scores, work_.selected, stream_);
    sparse_attention(shape, work_.queries + size_t(pass) * heads * hd, work_.q + hd + size_t(pass) * heads * 2 * hd,
                     caches.keys, caches.values, work_.selected, count, at, work_.position, bounds, work_.attend,
                     work_.attended + size_t(pass) * heads * hd, stream_);
  }
  linear(w.o, work_.attended, rows, work_.output, stream_);
}

MoeBuffers CudaSequence::moe_buffers() const {
  MoeBuffers b;
  b.input = work_.input;
  b.output = work_.output;
  b.router = work_.router;
  b.route_weights = work_.route_weights;
  b.route_ids = work_.route_ids;
  b.shared_gate = work_.shared_gate_up;
  b.shared_up = work_.shared_up;
  b.shared_scale = work_.shared_scale;
  b.expert_gate = work_.expert_gate;
  b.expert_up = work_.expert_up;
  b.expert_out = work_.expert_out;
  b.descriptors = work_.moe_descriptors;
  b.slot_of = work_.moe_slots;
  b.slot_weights = work_.moe_slot_weights;
  b.expert_partials = work_.moe_partials;
  return b;
}

// The router's picks and weights (work_.route_ids, route_weights), the shared expert's output (work_.output) and its
// gate (work_.shared_scale), one product per matrix: the paths of more rows or formats the decode block does not take.
void CudaSequence::route_and_shared_expert(const DeviceMoe& w, int rows) {
  const int64_t shared_inner = c_.shared_expert_intermediate_size;
  linear(w.router, work_.input, rows, work_.router, stream_);
  moe_route(moe_shape(c_).route, work_.router, rows, work_.route_ids, work_.route_weights, stream_);
  linear(w.shared.gate, work_.input, rows, work_.shared_gate_up, stream_);
  linear(w.shared.up, work_.input, rows, work_.shared_up, stream_);
  swiglu(work_.shared_gate_up, work_.shared_up, rows * shared_inner, stream_);
  linear(w.shared.down, work_.shared_gate_up, rows, work_.output, stream_);
  linear(w.shared_gate, work_.input, rows, work_.shared_scale, stream_);
}

// Whether a pass's MoE output goes to work_.output_fixed: a 1-row decode block whose products add into it, and a fused
// read after it, which reads and clears it (a combine launch less).
bool CudaSequence::moe_output_fixed(const MoeDecodePlan& plan, int rows, const DeviceGatedResidual* next_read) const {
  return moe_decode_takes_fixed(plan, rows) && next_read && fused_read(*next_read, rows);
}

// output_fixed: y in work_.output_fixed (moe_output_fixed) instead of work_.output.
void CudaSequence::moe(const DeviceMoe& w, const MoeDecodePlan& plan, int rows, bool output_fixed) {
  if (rows <= kMaxGemvRows && plan.decodes) {
    moe_decode(w, moe_shape(c_), plan, moe_buffers(), rows, stream_, output_fixed ? work_.output_fixed : nullptr);
    pending_fixed_ = output_fixed;
    return;
  }
  // Any number of rows, any format: one product per matrix, each selected expert once per (row, pick).
  const int h = int(c_.hidden_size), k = c_.num_experts_per_tok, inner = int(c_.moe_intermediate_size);
  route_and_shared_expert(w, rows);
  const int slots = rows * k;
  expert_linear(w.expert_gate, w.gate_up_format, inner, h, work_.route_ids, slots, work_.input, k, work_.expert_gate,
                stream_);
  expert_linear(w.expert_up, w.gate_up_format, inner, h, work_.route_ids, slots, work_.input, k, work_.expert_up,
                stream_);
  swiglu(work_.expert_gate, work_.expert_up, int64_t(slots) * inner, stream_);
  expert_linear(w.expert_down, w.down_format, h, inner, work_.route_ids, slots, work_.expert_gate, 1, work_.expert_out,
                stream_);
  moe_combine(work_.output, work_.shared_scale, work_.route_weights, work_.expert_out, rows, k, h, stream_);
}

// Prefill chunks: the routed experts' (row, slot) pairs grouped by expert id on the device, then for gate, up and down
// one grouped product over the active experts — on the tensor cores from the codes for quantized experts
// (quant_gemm.cuh), else grouped cuBLAS calls (gemm.cuh, which need the per-expert counts on the host once per layer)
// — with the results in slot order for the combine. On the codes, gate and up read the chunk's rows in place and down
// writes slot order (the grouping's map folded into the products); cuBLAS takes gathered rows and scatters its
// results. Decode never takes this path.
void CudaSequence::moe_prefill(const DeviceMoe& w, int rows, bool on_codes) {
  const int h = int(c_.hidden_size), k = c_.num_experts_per_tok, inner = int(c_.moe_intermediate_size);
  route_and_shared_expert(w, rows);
  const int slots = rows * k;
  group_by_expert(work_.route_ids, slots, c_.num_experts, work_.expert_counts, work_.expert_offsets, work_.expert_order,
                  work_.expert_position, stream_);
  if (on_codes) {
    // The rows are split once for gate and up (the same input) and once for down (with the swiglu folded in), into
    // grouped_rows.
    void* split = work_.grouped_rows;
    auto grouped_products = [&](const DeviceMatrix* experts, WeightFormat format, int rows_out, int cols, float* y,
                                const GroupedRowMap& map) {
      cuda_check(quant_expert_gemm(experts, format, c_.num_experts, rows_out, cols, work_.expert_counts,
                                   work_.expert_offsets, split, y, stream_, map),
                 "routed experts");
    };
    const GroupedRowMap gathered{.x_rows = work_.expert_order, .x_divisor = k}, scattered{.y_rows = work_.expert_order};
    cuda_check(quant_split_rows(w.gate_up_format, work_.input, rows, h, split, stream_), "routed experts' rows");
    grouped_products(w.expert_gate, w.gate_up_format, inner, h, work_.expert_gate, gathered);
    grouped_products(w.expert_up, w.gate_up_format, inner, h, work_.expert_up, gathered);
    cuda_check(quant_split_swiglu_rows(w.down_format, work_.expert_gate, work_.expert_up, slots, inner, split, stream_),
               "routed experts' swiglu");
    grouped_products(w.expert_down, w.down_format, h, inner, work_.expert_out, scattered);
  } else {
    std::vector<ExpertGroup> groups;
    cuda_check(active_experts(work_.expert_counts, c_.num_experts, groups, stream_), "expert counts");
    auto grouped_products = [&](const DeviceMatrix* experts, WeightFormat format, int rows_out, int cols,
                                const float* x, float* y) {
      check(grouped_expert_gemm(experts, format, rows_out, cols, groups, x, y, stream_),
            "routed experts: the grouped cuBLAS products failed");
    };
    gather_grouped_rows(work_.input, work_.expert_order, slots, k, h, work_.grouped_rows, stream_);
    grouped_products(w.expert_gate, w.gate_up_format, inner, h, work_.grouped_rows, work_.expert_gate);
    grouped_products(w.expert_up, w.gate_up_format, inner, h, work_.grouped_rows, work_.expert_up);
    swiglu(work_.expert_gate, work_.expert_up, int64_t(slots) * inner, stream_);
    grouped_products(w.expert_down, w.down_format, h, inner, work_.expert_gate, work_.grouped_rows);
    scatter_grouped_rows(work_.grouped_rows, work_.expert_position, slots, h, work_.expert_out, stream_);
  }
  moe_combine(work_.output, work_.shared_scale, work_.route_weights, work_.expert_out, rows, k, h, stream_);
}

void CudaSequence::ple(const DevicePle& w, LayerState& state, int rows, bool record, float* stack) {
  const int s = c_.hc_count, h = int(c_.hidden_size), sh = int(c_.hc_hidden());
  const PleShape shape{c_.ngram_size, c_.heads_per_ngram, c_.ngram_size - 1, c_.eos()};
  ple_table_rows(shape, w.multipliers, w.head_sizes, w.head_offsets, state.ple_previous.state<int64_t>(), work_.ids,
                 rows, work_.table_rows, state.ple_previous.recorded<int64_t>(record), stream_);
  gather_rows(w.table, work_.table_rows, rows * c_.ngram_heads(), 1, work_.embedding, stream_);
  run_products(state.ple_inputs, rows, stream_);  // key_proj, value_proj
  ple_mix(work_.ple_keys, stack, work_.ple_value, {w.norm_key, w.norm_query, w.norm_conv, c_.rms_norm_eps}, rows, s, h,
          work_.ple_out, work_.ple_normed, stream_);
  ple_conv(w.conv, sh, c_.ple_conv_kernel_size, c_.ngram_size, state.ple_conv.state<float>(), work_.ple_normed, rows,
           work_.ple_out, stack, state.ple_conv.recorded<float>(record), stream_);
}

// normed: work_.normed already holds the mixer's norm of `stacks` (or the write is pending for a fused read).
void CudaSequence::logits_from_stacks(const DeviceGatedResidual& mixer, const ProductGroup& reads, float* stacks,
                                      int rows, bool normed) {
  hyper_read(mixer, reads, stacks, rows, work_.hidden, normed);
  linear(model_->lm_head, work_.hidden, rows, work_.logits, stream_);
}

}  // namespace

SequenceFactory sequence_factory(std::shared_ptr<const DeviceModel> weights) {
  return [weights] { return std::unique_ptr<SequenceBackend>(new CudaSequence(weights)); };
}

SequenceFactory sequence_factory(const Model& model) { return sequence_factory(model, -1); }

SequenceFactory sequence_factory(const Model& model, int64_t expert_cache_mb,
                                 std::function<std::string()>* stats_line) {
  check(device_count() > 0, "--device cuda: no CUDA device is available");
  std::shared_ptr<const DeviceModel> weights(
      upload_model(model, expert_cache_mb < 0 ? -1 : expert_cache_mb * 1024 * 1024));
  if (stats_line)
    *stats_line = [weights] { return weights->expert_cache ? weights->expert_cache->stats_line() : std::string(); };
  return sequence_factory(weights);
}

}  // namespace vavilov::cuda
