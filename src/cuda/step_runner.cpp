#include "cuda/step_runner.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "cuda/linear.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kWarmRows = 4;       // the most activation rows of a captured pass (CudaSequence's kRecordedRows)
constexpr size_t kAlignment = 64;  // of each staged copy in pinned memory

size_t aligned(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

void add_residual(const DeviceGatedResidual& r, std::vector<const DeviceMatrix*>& out) {
  out.insert(out.end(), {&r.mix_down, &r.mix_up});
  if (r.has_inject) out.push_back(&r.inject);
}

void add_layer(const DeviceLayer& l, std::vector<const DeviceMatrix*>& out) {
  add_residual(l.attn_hc, out);
  add_residual(l.mlp_hc, out);
  if (l.kind == LayerKind::GatedDeltaNet)
    out.insert(out.end(), {&l.gdn.in_qkv, &l.gdn.in_z, &l.gdn.in_b, &l.gdn.in_a, &l.gdn.out});
  else
    out.insert(out.end(), {&l.attn.q, &l.attn.k, &l.attn.v, &l.attn.o, &l.attn.index_qk});
  out.insert(out.end(), {&l.moe.router, &l.moe.shared_gate, &l.moe.shared.gate, &l.moe.shared.up, &l.moe.shared.down});
  if (l.ple) out.insert(out.end(), {&l.ple->key_proj, &l.ple->value_proj});
}

// Every matrix a step passes to linear().
std::vector<const DeviceMatrix*> linear_matrices(const DeviceModel& m) {
  std::vector<const DeviceMatrix*> out{&m.lm_head};
  for (const DeviceLayer& layer : m.layers) add_layer(layer, out);
  add_residual(m.final_mixer, out);
  if (m.mtp) {
    out.insert(out.end(), {&m.mtp->fc_embedding, &m.mtp->fc_hidden});
    add_layer(m.mtp->layer, out);
    add_residual(m.mtp->final_mixer, out);
  }
  return out;
}

// linear() keeps thread-local scratch (split-K partial sums, the GEMV descriptor slot) that it allocates on first use
// and reallocates when a call needs more; a captured graph holds its address. Before the first capture of a model on
// a thread, every matrix of the model runs once at the most rows a graph has, so that the model's later calls never
// grow it. A warm-up may still reallocate the scratch that graphs of another model captured: each warm-up therefore
// gives the thread a new epoch, and graphs captured in an older one are captured again.
std::atomic<uint64_t> next_epoch{1};

struct LinearWarmth {
  uint64_t epoch = 0;
  std::vector<std::weak_ptr<const DeviceModel>> models;
};

uint64_t linear_scratch_epoch(const std::shared_ptr<const DeviceModel>& model, cudaStream_t stream) {
  thread_local LinearWarmth warmth;
  std::erase_if(warmth.models, [](const auto& m) { return m.expired(); });
  for (const auto& warmed : warmth.models)
    if (!warmed.owner_before(model) && !model.owner_before(warmed)) return warmth.epoch;
  const std::vector<const DeviceMatrix*> matrices = linear_matrices(*model);
  int rows = 1, cols = 1;
  for (const DeviceMatrix* m : matrices) rows = std::max(rows, m->rows), cols = std::max(cols, m->cols);
  DeviceAllocation x = device_alloc(size_t(kWarmRows) * size_t(cols) * sizeof(float), "linear warm-up");
  DeviceAllocation y = device_alloc(size_t(kWarmRows) * size_t(rows) * sizeof(float), "linear warm-up");
  cuda_check(cudaMemsetAsync(x.get(), 0, size_t(kWarmRows) * size_t(cols) * sizeof(float), stream), "linear warm-up");
  for (const DeviceMatrix* m : matrices)
    linear(*m, static_cast<const float*>(x.get()), kWarmRows, static_cast<float*>(y.get()), stream);
  cuda_check(cudaStreamSynchronize(stream), "linear warm-up");
  warmth.models.push_back(model);
  warmth.epoch = next_epoch++;
  return warmth.epoch;
}

}  // namespace

bool graphs_enabled_by_environment() {
  const char* value = std::getenv("VAVILOV_CUDA_GRAPH");
  return !(value && std::string_view(value) == "0");
}

StepRunner::StepRunner(std::shared_ptr<const DeviceModel> model, size_t input_bytes, size_t output_bytes, bool graphs)
    : model_(std::move(model)),
      graphs_(graphs),
      input_capacity_(aligned(input_bytes)),
      output_capacity_(aligned(output_bytes)) {
  cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "sequence stream");
  void* pinned = nullptr;
  const cudaError_t status = cudaHostAlloc(&pinned, input_capacity_ + output_capacity_, cudaHostAllocDefault);
  if (status != cudaSuccess) cudaStreamDestroy(stream_);
  cuda_check(status, "pinned staging memory");
  pinned_.reset(pinned);
}

StepRunner::~StepRunner() {
  cudaStreamSynchronize(stream_);
  captured_.clear();
  cudaStreamDestroy(stream_);
}

void StepRunner::run(const PassShape& shape, uint64_t generation, const std::function<void()>& launch) {
  if (!graphs_) {
    launch();
    return;
  }
  const uint64_t epoch = linear_scratch_epoch(model_, stream_);
  Captured& captured = captured_[shape];
  if (!captured.exec || captured.generation != generation || captured.linear_epoch != epoch) {
    capture(captured, launch);
    captured.generation = generation;
    captured.linear_epoch = epoch;
  }
  cuda_check(cudaGraphLaunch(captured.exec.get(), stream_), "CUDA graph launch");
}

void StepRunner::capture(Captured& captured, const std::function<void()>& launch) {
  cuda_check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed), "CUDA graph capture");
  cudaGraph_t graph = nullptr;
  try {
    launch();
  } catch (...) {
    if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  cuda_check(cudaStreamEndCapture(stream_, &graph), "CUDA graph capture");
  std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, decltype(&cudaGraphDestroy)> owned(graph, &cudaGraphDestroy);
  if (captured.exec) {  // same launches, other addresses or grids: update in place when the driver can
    cudaGraphExecUpdateResultInfo info{};
    if (cudaGraphExecUpdate(captured.exec.get(), graph, &info) == cudaSuccess) return;
    cudaGetLastError();
  }
  cudaGraphExec_t exec = nullptr;
  cuda_check(cudaGraphInstantiate(&exec, graph, 0), "CUDA graph instantiation");
  captured.exec.reset(exec);
}

void StepRunner::upload(void* device, const void* host, size_t bytes) {
  if (bytes == 0) return;
  if (input_used_ + aligned(bytes) <= input_capacity_) {
    char* staged = static_cast<char*>(pinned_.get()) + input_used_;
    std::memcpy(staged, host, bytes);
    input_used_ += aligned(bytes);
    host = staged;
  }
  cuda_check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_), "upload");
}

void StepRunner::download(void* host, const void* device, size_t bytes) {
  if (bytes == 0) return;
  if (output_used_ + aligned(bytes) > output_capacity_) {  // pageable: the driver stages it
    cuda_check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_), "download");
    return;
  }
  char* staged = static_cast<char*>(pinned_.get()) + input_capacity_ + output_used_;
  cuda_check(cudaMemcpyAsync(staged, device, bytes, cudaMemcpyDeviceToHost, stream_), "download");
  deliveries_.push_back({host, input_capacity_ + output_used_, bytes});
  output_used_ += aligned(bytes);
}

void StepRunner::finish() {
  cuda_check(cudaStreamSynchronize(stream_), "step");
  for (const Delivery& d : deliveries_) std::memcpy(d.host, static_cast<char*>(pinned_.get()) + d.offset, d.bytes);
  deliveries_.clear();
  input_used_ = output_used_ = 0;
}

}  // namespace vavilov::cuda
