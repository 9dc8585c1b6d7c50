#include "server/prefix_cache.h"

#include <algorithm>

namespace vavilov::server {
namespace {

template <typename T>
size_t vector_bytes(const std::vector<T>& v) {
  return v.capacity() * sizeof(T);
}

size_t layer_bytes(const LayerState& layer) {
  return vector_bytes(layer.gdn.conv) + vector_bytes(layer.gdn.recurrent) + vector_bytes(layer.attn.keys) +
         vector_bytes(layer.attn.values) + vector_bytes(layer.attn.index_keys) + vector_bytes(layer.attn.block_keys) +
         vector_bytes(layer.ple.previous_ids) + vector_bytes(layer.ple.conv_rows) + sizeof(LayerState);
}

bool is_prefix(std::span<const int32_t> prefix, std::span<const int32_t> of) {
  return prefix.size() <= of.size() && std::equal(prefix.begin(), prefix.end(), of.begin());
}

}  // namespace

size_t state_bytes(const SequenceState& state) {
  size_t bytes = sizeof(SequenceState) + layer_bytes(state.mtp);
  for (const LayerState& layer : state.layers) bytes += layer_bytes(layer);
  return bytes;
}

std::shared_ptr<const PrefixCache::Entry> PrefixCache::lookup(std::span<const int32_t> prompt) {
  std::lock_guard lock(mutex_);
  auto best = entries_.end();
  for (auto it = entries_.begin(); it != entries_.end(); ++it)
    if ((*it)->tokens.size() < prompt.size() && is_prefix((*it)->tokens, prompt) &&
        (best == entries_.end() || (*it)->tokens.size() > (*best)->tokens.size()))
      best = it;
  if (best == entries_.end()) {
    ++misses_;
    return nullptr;
  }
  ++hits_;
  entries_.splice(entries_.begin(), entries_, best);
  return entries_.front();
}

void PrefixCache::insert(std::span<const int32_t> tokens, const SequenceState& state) {
  std::lock_guard lock(mutex_);
  for (auto it = entries_.begin(); it != entries_.end(); ++it)
    if (std::ranges::equal((*it)->tokens, tokens)) {
      entries_.splice(entries_.begin(), entries_, it);
      return;
    }
  const size_t bytes = state_bytes(state) + tokens.size() * sizeof(int32_t);
  if (bytes > budget_) return;
  while (bytes_ + bytes > budget_ && !entries_.empty()) {
    bytes_ -= entries_.back()->bytes;
    entries_.pop_back();
  }
  auto entry = std::make_shared<Entry>(Entry{{tokens.begin(), tokens.end()}, state, bytes});
  entries_.push_front(std::move(entry));
  bytes_ += bytes;
}

PrefixCache::Stats PrefixCache::stats() const {
  std::lock_guard lock(mutex_);
  return {hits_, misses_, int64_t(entries_.size()), bytes_, budget_};
}

}  // namespace vavilov::server
