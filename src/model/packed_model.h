#pragma once
// A model loaded from a packed store (src/io/packed_store.h): dense tensors and the n-gram table through the same
// readers as a checkpoint, routed experts from the records of the chosen precision.
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/progress.h"
#include "model/weights.h"

namespace vavilov {

// The precision of expert records in the checkpoint's own dense dtype.
constexpr int kDensePrecision = 0;

// Which precision of each routed expert to map: bits 4, 3, 2, or kDensePrecision. The MTP head's layer is layer
// config.num_layers.
struct ExpertPrecision {
  // Tried in order for each expert; empty: the most precise the store holds (dense, then 4, 3, 2).
  std::vector<int> preference;
  // Exact precision for single experts, keyed by (layer, expert); these must be in the store.
  std::map<std::pair<int, int>, int> per_expert;
};

std::unique_ptr<Model> load_packed_model(const std::string& directory, const ExpertPrecision& precision);

// Reads every byte of every weight the model uses (matrices, quantization scales and biases, the n-gram table) so
// the first tokens do not wait on page faults. Shows bytes and rate as it goes (see ProgressMode); a one-line
// summary also goes to stderr outside a terminal when the weights are large.
void page_in_weights(Model& model, ProgressMode mode);

}  // namespace vavilov
