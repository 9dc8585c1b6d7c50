#pragma once
// The released Flash-Next geometry (models/configs/flash-next.json) cut to its first layers, for GPU tests that need
// the real sizes (2.6 MB experts, 248320-token vocabulary) on synthetic weights without the whole model.
#include <algorithm>

#include "fixture_paths.h"
#include "model/config.h"

namespace vavilov::test {

inline ModelConfig flash_next_layers(int layers) {
  ModelConfig c = load_model_config((source_dir() / "models" / "configs" / "flash-next.json").string());
  c.num_layers = layers;
  c.layer_kinds.resize(size_t(layers));
  std::erase_if(c.ple_layers, [layers](int layer) { return layer >= layers; });
  return c;
}

}  // namespace vavilov::test
