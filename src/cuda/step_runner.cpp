#include "cuda/step_runner.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "cuda/kernel_trace.h"

namespace vavilov::cuda {

namespace {

constexpr size_t kAlignment = 64;  // of each staged copy in pinned memory

size_t aligned(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

bool graphs_enabled_by_environment() {
  const char* value = std::getenv("VAVILOV_CUDA_GRAPH");
  return !(value && std::string_view(value) == "0");
}

StepRunner::StepRunner(size_t input_bytes, size_t output_bytes, bool graphs)
    : graphs_(graphs), input_capacity_(aligned(input_bytes)), output_capacity_(aligned(output_bytes)) {
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
  const auto pass = [&] {  // a trace build marks each pass (kernel_trace.h; nothing otherwise)
    kernel_trace::pass_begin();
    launch();
    kernel_trace::pass_end(stream_, shape.kind, shape.rows);
  };
  if (!graphs_) {
    pass();
    return;
  }
  Captured& captured = captured_[shape];
  if (!captured.exec || captured.generation != generation) {
    capture(captured, pass);
    captured.generation = generation;
  }
  cuda_check(cudaGraphLaunch(captured.exec.get(), stream_), "CUDA graph launch");
  kernel_trace::replayed(captured.exec.get(), stream_);
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
