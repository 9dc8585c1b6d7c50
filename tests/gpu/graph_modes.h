#pragma once
// A GPU sequence factory whose sequences replay CUDA graphs or, with graphs = false, launch eagerly
// (VAVILOV_CUDA_GRAPH=0 is read when a sequence is made): the decoding tests run both ways.
#include <cstdlib>
#include <memory>

#include "engine/backend.h"

namespace vavilov::test {

inline SequenceFactory with_graphs(const SequenceFactory& gpu, bool graphs) {
  return [gpu, graphs] {
    if (!graphs) setenv("VAVILOV_CUDA_GRAPH", "0", 1);
    std::unique_ptr<SequenceBackend> sequence = gpu();
    unsetenv("VAVILOV_CUDA_GRAPH");
    return sequence;
  };
}

}  // namespace vavilov::test
