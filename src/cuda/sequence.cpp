// One sequence on the GPU: its state, scratch memory, and the trunk, MTP head and rollback steps, each a sequence of
// kernel launches mirroring the CPU engine (src/cpu/forward.cpp, layers.h, mtp.cpp).
#include <algorithm>
#include <vector>

#include "core/error.h"
#include "cuda/backend.h"
#include "cuda/device_model.h"
#include "cuda/gated_deltanet.cuh"
#include "cuda/linear.cuh"
#include "cuda/ops.cuh"

namespace vavilov::cuda {

int device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

namespace {

constexpr int kChunkRows = 64;    // rows per pass through the layers (longer inputs run in chunks)
constexpr int kRecordedRows = 4;  // rows whose recurrent state a pass can record for rollback
static_assert(kRecordedRows <= kGdnDecodeMaxRows, "recorded rows run through the GDN decode kernel");
constexpr cudaStream_t kStream = nullptr;

// Scratch buffers of one pass of up to kChunkRows rows. Sized from the config; the attention scratch grows with the
// context.
struct Workspace {
  DeviceAllocation memory;
  int32_t* ids;
  float *stack, *normed, *low, *mix, *input, *inject, *output, *hidden;
  float *qkv, *z, *gate_b, *gate_a, *core, *gdn_chunks;  // gate_b, gate_a: in_proj_b, in_proj_a outputs
  float *q, *k, *v, *index_qk, *queries, *index_queries, *attended;
  float *router, *route_weights, *shared_gate_up, *shared_up, *shared_scale, *expert_gate, *expert_up, *expert_out;
  int* route_ids;
  int64_t* table_rows;
  float *embedding, *ple_keys, *ple_value, *ple_query, *ple_out, *ple_normed;
  float *logits, *mtp_row, *mtp_normed, *mtp_embedded;
  // Attention scratch for contexts up to `tokens` positions.
  DeviceAllocation attention_memory;
  int64_t tokens = 0;
  float *block_scores = nullptr, *attention_weights = nullptr;
  uint8_t* selected = nullptr;
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

void make_workspace(const ModelConfig& c, Workspace& w) {
  const size_t r = kChunkRows, h = size_t(c.hidden_size), sh = size_t(c.hc_hidden()), s = size_t(c.hc_count);
  const size_t k = size_t(c.num_experts_per_tok);
  const size_t hd = size_t(c.head_dim), ihd = size_t(c.indexer_head_dim);
  Layout l;
  l.add(w.ids, r);
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
  l.add(w.table_rows, r * size_t(c.ngram_heads()));
  l.add(w.embedding, r * size_t(c.ple_embed_dim));
  for (float** buffer : {&w.ple_keys, &w.ple_query, &w.ple_out, &w.ple_normed}) l.add(*buffer, r * sh);
  l.add(w.ple_value, r * h);
  l.add(w.logits, r * size_t(c.vocab_size));
  w.memory = l.allocate("workspace");
}

// Attention caches of one layer, grown by doubling.
struct AttentionCache {
  DeviceAllocation keys, values, index_keys, block_keys;
  int64_t capacity = 0;
};

// A recurrent state and its copies after each recorded row ([kRecordedRows] of the same size), for rollback.
struct RecurrentBuffer {
  DeviceAllocation now, rows;
  size_t bytes = 0;

  void make(size_t size, const char* what) {
    bytes = size;
    now = device_alloc(size, what);
    cuda_check(cudaMemset(now.get(), 0, size), what);
    rows = device_alloc(size * kRecordedRows, what);
  }
  template <typename T>
  T* state() const {
    return static_cast<T*>(now.get());
  }
  template <typename T>
  T* recorded(bool record) const {
    return record ? static_cast<T*>(rows.get()) : nullptr;
  }
  void restore(size_t row) {
    if (!now) return;
    cuda_check(cudaMemcpyAsync(now.get(), static_cast<char*>(rows.get()) + row * bytes, bytes, cudaMemcpyDeviceToDevice,
                               kStream),
               "rollback");
  }
};

struct LayerState {
  RecurrentBuffer gdn_conv, gdn_recurrent;  // [kernel−1, conv_dim], [heads, dk, dv]
  AttentionCache attention;
  RecurrentBuffer ple_previous, ple_conv;  // [ngram−1] int64, [(kernel−1)·ngram, S·H]
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
        "GDN state");
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

class CudaSequence final : public SequenceBackend {
 public:
  explicit CudaSequence(std::shared_ptr<const DeviceModel> model) : model_(std::move(model)), c_(model_->config) {
    check(c_.linear_key_head_dim <= kGdnMaxKeyDim && c_.linear_value_head_dim <= kGdnMaxValueDim,
          "{}: the GPU's Gated DeltaNet takes linear_key_head_dim ≤ {} and linear_value_head_dim ≤ {}, got {} and {}",
          model_->name, kGdnMaxKeyDim, kGdnMaxValueDim, c_.linear_key_head_dim, c_.linear_value_head_dim);
    for (int i = 0; i < c_.num_layers; ++i)
      layers_.push_back(new_layer_state(c_, c_.layer_kinds[size_t(i)], c_.is_ple_layer(i)));
    if (model_->mtp) mtp_state_ = new_layer_state(c_, LayerKind::SparseAttention, false);
    make_workspace(c_, work_);
  }

  int64_t position() const override { return position_; }

  void forward(std::span<const int32_t> ids, const TrunkOutputs& out) override {
    check(!ids.empty(), "forward: no tokens");
    for (int32_t id : ids)
      check(id >= 0 && id < c_.vocab_size, "token id {} is outside the vocabulary [0, {})", id, c_.vocab_size);
    check(!out.record_rows || ids.size() <= size_t(kRecordedRows), "the GPU records at most {} rows, got {}",
          kRecordedRows, ids.size());
    const int64_t n = int64_t(ids.size()), sh = c_.hc_hidden(), vocab = c_.vocab_size;
    recorded_from_ = out.record_rows ? position_ : -1;
    recorded_rows_ = out.record_rows ? n : 0;
    for (int64_t begin = 0; begin < n; begin += kChunkRows) {
      const int rows = int(std::min<int64_t>(kChunkRows, n - begin));
      const bool last = begin + rows == n;
      upload_ids(ids.subspan(size_t(begin), size_t(rows)));
      gather_rows(model_->embed, work_.ids, rows, c_.hc_count, work_.stack, kStream);
      for (int i = 0; i < c_.num_layers; ++i)
        run_layer(model_->layers[size_t(i)], layers_[size_t(i)], position_, rows, out.record_rows, work_.stack);
      if (out.stacks) download(out.stacks + begin * sh, work_.stack, size_t(rows) * size_t(sh));
      if (out.logits && (out.all_rows || last)) {
        const int logit_rows = out.all_rows ? rows : 1;
        logits_from_stacks(model_->final_mixer, work_.stack + size_t(rows - logit_rows) * size_t(sh), logit_rows);
        download(out.logits + (out.all_rows ? begin * vocab : 0), work_.logits, size_t(logit_rows) * size_t(vocab));
      }
      position_ += rows;
    }
    cuda_check(cudaGetLastError(), "forward");
  }

  void keep_rows(int64_t first_position, int64_t kept) override {
    check(kept >= 1 && first_position + kept <= position_ && recorded_from_ == first_position &&
              first_position + recorded_rows_ == position_,
          "keep_rows: cannot keep {} rows from position {}", kept, first_position);
    if (first_position + kept == position_) return;
    const size_t row = size_t(kept - 1);
    for (LayerState& layer : layers_)
      for (RecurrentBuffer* buffer : {&layer.gdn_conv, &layer.gdn_recurrent, &layer.ple_previous, &layer.ple_conv})
        buffer->restore(row);
    position_ = first_position + kept;  // attention caches are truncated by the position alone
    recorded_rows_ = 0;
  }

  void mtp_forward(const float* stacks, std::span<const int32_t> next_ids, float* head_stacks,
                   MtpRows output) override {
    check(model_->mtp.has_value(), "{}: the checkpoint has no MTP head (mtp.* tensors)", model_->name);
    const DeviceMtp& m = *model_->mtp;
    for (int32_t id : next_ids) check(id >= 0 && id < c_.vocab_size, "token id {} is outside the vocabulary", id);
    const int64_t n = int64_t(next_ids.size()), h = c_.hidden_size, sh = c_.hc_hidden();
    const float eps = c_.rms_norm_eps;
    for (int64_t begin = 0; begin < n; begin += kChunkRows) {
      const int rows = int(std::min<int64_t>(kChunkRows, n - begin));
      upload_ids(next_ids.subspan(size_t(begin), size_t(rows)));
      // e = fc_embedding · RMS0(embed[next]);  R'[s] = fc_hidden · RMS0(R)[s] + e
      gather_rows(model_->embed, work_.ids, rows, 1, work_.mtp_row, kStream);
      rms_norm(work_.mtp_row, h, 0, rows, 1, int(h), m.pre_fc_norm_embedding, 0, eps, work_.mtp_row, kStream);
      linear(m.fc_embedding, work_.mtp_row, rows, work_.mtp_embedded, kStream);
      upload(work_.mtp_normed, stacks + begin * sh, size_t(rows) * size_t(sh));
      rms_norm(work_.mtp_normed, sh, 0, rows, 1, int(sh), m.pre_fc_norm_hidden, 0, eps, work_.mtp_normed, kStream);
      linear(m.fc_hidden, work_.mtp_normed, rows * c_.hc_count, work_.stack, kStream);
      add_to_streams(work_.stack, work_.mtp_embedded, rows, c_.hc_count, int(h), kStream);
      run_layer(m.layer, mtp_state_, mtp_position_, rows, false, work_.stack);
      if (output == MtpRows::All)
        download(head_stacks + begin * sh, work_.stack, size_t(rows) * size_t(sh));
      else if (begin + rows == n)
        download(head_stacks, work_.stack + size_t(rows - 1) * size_t(sh), size_t(sh));
      mtp_position_ += rows;
    }
    cuda_check(cudaGetLastError(), "MTP head");
  }

  void mtp_logits(const float* head_stacks, int64_t rows, float* logits) override {
    check(model_->mtp.has_value(), "{}: the checkpoint has no MTP head (mtp.* tensors)", model_->name);
    const int64_t sh = c_.hc_hidden(), vocab = c_.vocab_size;
    for (int64_t begin = 0; begin < rows; begin += kChunkRows) {
      const int count = int(std::min<int64_t>(kChunkRows, rows - begin));
      upload(work_.stack, head_stacks + begin * sh, size_t(count) * size_t(sh));
      logits_from_stacks(model_->mtp->final_mixer, work_.stack, count);
      download(logits + begin * vocab, work_.logits, size_t(count) * size_t(vocab));
    }
  }

  void truncate_head(int64_t position) override {
    check(position >= 0 && position <= mtp_position_, "truncate_head: position {} is past the head's {}", position,
          mtp_position_);
    mtp_position_ = position;
  }

 private:
  void upload_ids(std::span<const int32_t> ids) {
    cuda_check(cudaMemcpyAsync(work_.ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, kStream), "ids");
  }
  void upload(float* device, const float* host, size_t count) {
    cuda_check(cudaMemcpyAsync(device, host, count * 4, cudaMemcpyHostToDevice, kStream), "upload");
  }
  void download(float* host, const float* device, size_t count) {
    cuda_check(cudaMemcpy(host, device, count * 4, cudaMemcpyDeviceToHost), "download");
  }
  void run_layer(const DeviceLayer& w, LayerState& state, int64_t first, int rows, bool record, float* stack);
  void hyper_read(const DeviceGatedResidual& w, const float* stack, int rows, float* input, float* inject);
  void gated_deltanet(const DeviceGatedDeltaNet& w, LayerState& state, int rows, bool record);
  void attention(const DeviceAttention& w, LayerState& state, int64_t first, int rows);
  void moe(const DeviceMoe& w, int rows);
  void ple(const DevicePle& w, LayerState& state, int rows, bool record, float* stack);
  void logits_from_stacks(const DeviceGatedResidual& mixer, const float* stacks, int rows);
  void reserve_attention(AttentionCache& cache, int64_t tokens);

  std::shared_ptr<const DeviceModel> model_;
  const ModelConfig& c_;
  std::vector<LayerState> layers_;
  LayerState mtp_state_;
  Workspace work_;
  int64_t position_ = 0, mtp_position_ = 0;
  int64_t recorded_from_ = -1, recorded_rows_ = 0;
};

void CudaSequence::run_layer(const DeviceLayer& w, LayerState& state, int64_t first, int rows, bool record,
                             float* stack) {
  const int s = c_.hc_count, h = int(c_.hidden_size);
  if (w.ple) ple(*w.ple, state, rows, record, stack);
  hyper_read(w.attn_hc, stack, rows, work_.input, work_.inject);
  if (w.kind == LayerKind::GatedDeltaNet)
    gated_deltanet(w.gdn, state, rows, record);
  else
    attention(w.attn, state, first, rows);
  hc_write(work_.inject, work_.output, rows, s, h, stack, kStream);
  hyper_read(w.mlp_hc, stack, rows, work_.input, work_.inject);
  moe(w.moe, rows);
  hc_write(work_.inject, work_.output, rows, s, h, stack, kStream);
}

void CudaSequence::hyper_read(const DeviceGatedResidual& w, const float* stack, int rows, float* input, float* inject) {
  const int s = c_.hc_count, h = int(c_.hidden_size);
  const int64_t sh = c_.hc_hidden();
  rms_norm(stack, sh, h, rows, s, h, w.norm, h, c_.rms_norm_eps, work_.normed, kStream);
  linear(w.mix_down, work_.normed, rows, work_.low, kStream);
  hc_low_activation(work_.low, int64_t(rows) * c_.hc_lowrank, s, kStream);
  linear(w.mix_up, work_.low, rows, work_.mix, kStream);
  hc_combine(work_.mix, work_.normed, rows, s, h, input, kStream);
  if (!w.has_inject) return;
  linear(w.inject, work_.normed, rows, inject, kStream);
  hc_inject_activation(inject, int64_t(rows) * s, s, kStream);
}

void CudaSequence::gated_deltanet(const DeviceGatedDeltaNet& w, LayerState& state, int rows, bool record) {
  linear(w.in_qkv, work_.input, rows, work_.qkv, kStream);
  linear(w.in_z, work_.input, rows, work_.z, kStream);
  linear(w.in_b, work_.input, rows, work_.gate_b, kStream);
  linear(w.in_a, work_.input, rows, work_.gate_a, kStream);
  gdn_conv(w.conv, int(c_.gdn_conv_dim()), c_.linear_conv_kernel_dim, state.gdn_conv.state<float>(), work_.qkv, rows,
           state.gdn_conv.recorded<float>(record), kStream);
  const GdnInputs in{work_.qkv, work_.gate_b,    work_.gate_a,        w.a_log, w.dt_bias, work_.z,
                     w.norm,    c_.rms_norm_eps, c_.gdn_gate_sigmoid, rows};
  float* recurrent = state.gdn_recurrent.state<float>();
  // Decode rows (and recorded ones, at most kRecordedRows) go one after the other; longer passes chunk-parallel.
  if (record || rows <= kGdnDecodeMaxRows)
    gdn_decode(gdn_shape(c_), in, recurrent, state.gdn_recurrent.recorded<float>(record), work_.core, kStream);
  else
    gdn_prefill(gdn_shape(c_), in, recurrent, work_.gdn_chunks, work_.core, kStream);
  linear(w.out, work_.core, rows, work_.output, kStream);
}

void CudaSequence::reserve_attention(AttentionCache& cache, int64_t tokens) {
  const size_t kv = size_t(c_.num_key_value_heads) * size_t(c_.head_dim) * 4, index = size_t(c_.indexer_head_dim) * 4;
  if (tokens > cache.capacity) {
    const int64_t capacity = std::max<int64_t>({tokens, 2 * cache.capacity, 1024}), ratio = c_.indexer_compress_ratio;
    // Block keys: one row per complete block, plus one so that any capacity fits.
    auto blocks = [&](int64_t positions) { return positions ? positions / ratio + 1 : 0; };
    auto grow = [](DeviceAllocation& buffer, size_t row_bytes, int64_t old_rows, int64_t rows) {
      DeviceAllocation bigger = device_alloc(row_bytes * size_t(rows), "attention cache");
      if (old_rows)
        cuda_check(cudaMemcpy(bigger.get(), buffer.get(), row_bytes * size_t(old_rows), cudaMemcpyDeviceToDevice),
                   "attention cache");
      buffer = std::move(bigger);
    };
    grow(cache.keys, kv, cache.capacity, capacity);
    grow(cache.values, kv, cache.capacity, capacity);
    grow(cache.index_keys, index, cache.capacity, capacity);
    grow(cache.block_keys, index, blocks(cache.capacity), blocks(capacity));
    cache.capacity = capacity;
  }
  if (tokens > work_.tokens) {
    const int64_t capacity = std::max<int64_t>({tokens, 2 * work_.tokens, 1024});
    const size_t blocks = size_t(capacity / c_.indexer_compress_ratio + 1);
    Layout l;
    l.add(work_.block_scores, kChunkRows * blocks);
    l.add(work_.selected, kChunkRows * blocks);
    l.add(work_.attention_weights, size_t(kChunkRows) * size_t(c_.num_attention_heads) * size_t(capacity));
    work_.attention_memory = l.allocate("attention scratch");
    work_.tokens = capacity;
  }
}

void CudaSequence::attention(const DeviceAttention& w, LayerState& state, int64_t first, int rows) {
  const int heads = c_.num_attention_heads, kv_heads = c_.num_key_value_heads, hd = c_.head_dim;
  const int index_heads = c_.indexer_n_heads, ihd = c_.indexer_head_dim, ratio = c_.indexer_compress_ratio;
  const float eps = c_.rms_norm_eps;
  AttentionCache& cache = state.attention;
  reserve_attention(cache, first + rows);
  float* keys = ptr<float>(cache.keys) + first * kv_heads * hd;
  float* values = ptr<float>(cache.values) + first * kv_heads * hd;
  linear(w.q, work_.input, rows, work_.q, kStream);
  linear(w.k, work_.input, rows, keys, kStream);  // straight into the cache, normalised and rotated there
  linear(w.v, work_.input, rows, values, kStream);
  linear(w.index_qk, work_.input, rows, work_.index_qk, kStream);

  rms_norm(work_.q, int64_t(heads) * 2 * hd, 2 * hd, rows, heads, hd, w.q_norm, 0, eps, work_.queries, kStream);
  rope(work_.queries, rows, heads, hd, c_.rotary_dim, model_->inv_freq, first, kStream);
  rms_norm(keys, int64_t(kv_heads) * hd, hd, rows, kv_heads, hd, w.k_norm, 0, eps, keys, kStream);
  rope(keys, rows, kv_heads, hd, c_.rotary_dim, model_->inv_freq, first, kStream);
  const int64_t index_stride = int64_t(index_heads + 1) * ihd;
  rms_norm(work_.index_qk, index_stride, ihd, rows, index_heads, ihd, w.index_q_norm, 0, eps, work_.index_queries,
           kStream);
  rope(work_.index_queries, rows, index_heads, ihd, c_.rotary_dim, model_->inv_freq, first, kStream);
  float* index_keys = ptr<float>(cache.index_keys);
  cuda_check(
      cudaMemcpy2DAsync(index_keys + first * ihd, size_t(ihd) * 4, work_.index_qk + int64_t(index_heads) * ihd,
                        size_t(index_stride) * 4, size_t(ihd) * 4, size_t(rows), cudaMemcpyDeviceToDevice, kStream),
      "indexer keys");
  const int64_t end = first + rows;
  pool_block_keys(index_keys, int(first / ratio), int(end / ratio), ratio, ihd, w.index_k_norm, eps, model_->inv_freq,
                  c_.rotary_dim, ptr<float>(cache.block_keys), kStream);

  const AttentionShape shape{heads, kv_heads, hd, index_heads, ihd, ratio, c_.indexer_budget / ratio};
  const int max_blocks = int(end / ratio), max_tokens = int(end);
  qsa_select(shape, work_.index_queries, ptr<float>(cache.block_keys), rows, first, max_blocks, work_.block_scores,
             work_.selected, kStream);
  sparse_attention(shape, work_.queries, work_.q + hd, ptr<float>(cache.keys), ptr<float>(cache.values), work_.selected,
                   rows, first, max_blocks, max_tokens, work_.attention_weights, work_.attended, kStream);
  linear(w.o, work_.attended, rows, work_.output, kStream);
}

void CudaSequence::moe(const DeviceMoe& w, int rows) {
  const int h = int(c_.hidden_size), k = c_.num_experts_per_tok, inner = int(c_.moe_intermediate_size);
  const int64_t shared_inner = c_.shared_expert_intermediate_size;
  linear(w.router, work_.input, rows, work_.router, kStream);
  moe_route(work_.router, rows, c_.num_experts, k, c_.norm_topk_prob, work_.route_ids, work_.route_weights, kStream);
  linear(w.shared.gate, work_.input, rows, work_.shared_gate_up, kStream);
  linear(w.shared.up, work_.input, rows, work_.shared_up, kStream);
  swiglu(work_.shared_gate_up, work_.shared_up, rows * shared_inner, kStream);
  linear(w.shared.down, work_.shared_gate_up, rows, work_.output, kStream);
  linear(w.shared_gate, work_.input, rows, work_.shared_scale, kStream);
  const int slots = rows * k;
  expert_linear(w.expert_gate, w.gate_up_format, inner, h, work_.route_ids, slots, work_.input, k, work_.expert_gate,
                kStream);
  expert_linear(w.expert_up, w.gate_up_format, inner, h, work_.route_ids, slots, work_.input, k, work_.expert_up,
                kStream);
  swiglu(work_.expert_gate, work_.expert_up, int64_t(slots) * inner, kStream);
  expert_linear(w.expert_down, w.down_format, h, inner, work_.route_ids, slots, work_.expert_gate, 1, work_.expert_out,
                kStream);
  moe_combine(work_.output, work_.shared_scale, work_.route_weights, work_.expert_out, rows, k, h, kStream);
}

void CudaSequence::ple(const DevicePle& w, LayerState& state, int rows, bool record, float* stack) {
  const int s = c_.hc_count, h = int(c_.hidden_size), sh = int(c_.hc_hidden());
  const float eps = c_.rms_norm_eps;
  const PleShape shape{c_.ngram_size, c_.heads_per_ngram, c_.ngram_size - 1, c_.eos()};
  ple_table_rows(shape, w.multipliers, w.head_sizes, w.head_offsets, state.ple_previous.state<int64_t>(), work_.ids,
                 rows, work_.table_rows, state.ple_previous.recorded<int64_t>(record), kStream);
  gather_rows(w.table, work_.table_rows, rows * c_.ngram_heads(), 1, work_.embedding, kStream);
  linear(w.key_proj, work_.embedding, rows, work_.ple_keys, kStream);
  linear(w.value_proj, work_.embedding, rows, work_.ple_value, kStream);
  rms_norm(work_.ple_keys, sh, h, rows, s, h, w.norm_key, h, eps, work_.ple_keys, kStream);
  rms_norm(stack, sh, h, rows, s, h, w.norm_query, h, eps, work_.ple_query, kStream);
  ple_gate(work_.ple_keys, work_.ple_query, work_.ple_value, rows, s, h, work_.ple_out, kStream);
  rms_norm(work_.ple_out, sh, h, rows, s, h, w.norm_conv, h, eps, work_.ple_normed, kStream);
  ple_conv(w.conv, sh, c_.ple_conv_kernel_size, c_.ngram_size, state.ple_conv.state<float>(), work_.ple_normed, rows,
           work_.ple_out, state.ple_conv.recorded<float>(record), kStream);
  add(stack, work_.ple_out, int64_t(rows) * sh, kStream);
}

void CudaSequence::logits_from_stacks(const DeviceGatedResidual& mixer, const float* stacks, int rows) {
  hyper_read(mixer, stacks, rows, work_.hidden, nullptr);
  linear(model_->lm_head, work_.hidden, rows, work_.logits, kStream);
}

}  // namespace

SequenceFactory sequence_factory(std::shared_ptr<const DeviceModel> weights) {
  return [weights] { return std::unique_ptr<SequenceBackend>(new CudaSequence(weights)); };
}

SequenceFactory sequence_factory(const Model& model) {
  check(device_count() > 0, "--device cuda: no CUDA device is available");
  return sequence_factory(std::shared_ptr<const DeviceModel>(upload_model(model)));
}

}  // namespace vavilov::cuda
