#include "tokenizer/bpe.h"

#include <queue>

#include "core/error.h"
#include "tokenizer/byte_level.h"

namespace vavilov::tokenizer {
namespace {

// Bounds memory on endless streams of distinct words; a full clear is cheap compared with LRU bookkeeping.
constexpr size_t kMaxCachedPieces = 200'000;
// Long pieces (whitespace or digit runs) rarely repeat; caching them would only evict useful entries.
constexpr size_t kMaxCachedPieceBytes = 64;

std::pair<std::string, std::string> parse_merge(const nlohmann::json& entry, const std::string& where) {
  if (entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_string())
    return {entry[0].get<std::string>(), entry[1].get<std::string>()};
  check(entry.is_string(), "{}: expected \"left right\" or [left, right]", where);
  const std::string text = entry.get<std::string>();
  const size_t space = text.find(' ', 1);
  check(space != std::string::npos, "{}: \"{}\" has no space between its two parts", where, text);
  return {text.substr(0, space), text.substr(space + 1)};
}

void check_no_affixes(const nlohmann::json& model, const std::string& file) {
  for (const char* field : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const bool absent = !model.contains(field) || model[field].is_null() ||
                        (model[field].is_string() && model[field].get<std::string>().empty());
    check(absent, "{}: field model.{}: subword affixes are not supported", file, field);
  }
  check(!model.contains("dropout") || model["dropout"].is_null(),
        "{}: field model.dropout: BPE dropout is not supported", file);
  check(!model.value("byte_fallback", false), "{}: field model.byte_fallback: byte fallback is not supported", file);
}

}  // namespace

BytePairModel BytePairModel::from_json(const nlohmann::json& model, const std::string& file) {
  check(model.is_object() && model.value("type", std::string()) == "BPE",
        "{}: field model.type: only \"BPE\" models are supported", file);
  check_no_affixes(model, file);
  check(model.contains("vocab") && model["vocab"].is_object(), "{}: field model.vocab: expected an object", file);
  check(model.contains("merges") && model["merges"].is_array(), "{}: field model.merges: expected an array", file);

  BytePairModel bpe;
  bpe.ignore_merges_ = model.value("ignore_merges", false);
  for (const auto& [token, id] : model["vocab"].items()) {
    check(id.is_number_unsigned() && id.get<uint64_t>() < (1u << 30), "{}: field model.vocab[\"{}\"]: bad id", file,
          token);
    const auto index = id.get<uint32_t>();
    if (index >= bpe.token_strings_.size()) bpe.token_strings_.resize(index + 1);
    bpe.token_strings_[index] = token;
    bpe.id_of_token_.emplace(token, index);
    if (bpe.ignore_merges_) {
      if (auto bytes = byte_level_to_bytes(token)) bpe.id_of_bytes_.emplace(*bytes, index);
    }
  }
  for (int byte = 0; byte < 256; ++byte) {
    std::string symbol = bytes_to_byte_level(std::string(1, static_cast<char>(byte)));
    const auto id = bpe.id_of(symbol);
    bpe.id_of_byte_[byte] = id ? static_cast<int64_t>(*id) : -1;
  }
  const auto& merges = model["merges"];
  bpe.merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string where = fmt::format("{}: field model.merges[{}]", file, rank);
    const auto [left, right] = parse_merge(merges[rank], where);
    const auto left_id = bpe.id_of(left), right_id = bpe.id_of(right), merged_id = bpe.id_of(left + right);
    check(left_id && right_id && merged_id, "{}: \"{} {}\" uses a token missing from model.vocab", where, left, right);
    bpe.merges_.emplace(pair_key(*left_id, *right_id), Merge{static_cast<uint32_t>(rank), *merged_id});
  }
  return bpe;
}

std::optional<uint32_t> BytePairModel::id_of(const std::string& token) const {
  const auto it = id_of_token_.find(token);
  if (it == id_of_token_.end()) return std::nullopt;
  return it->second;
}

void BytePairModel::encode_piece(std::string_view piece, std::vector<uint32_t>& ids) {
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  if (cacheable) {
    const auto it = cache_.find(std::string(piece));
    if (it != cache_.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = ids.size();
  merge_symbols(piece, ids);
  if (!cacheable) return;
  if (cache_.size() >= kMaxCachedPieces) cache_.clear();
  cache_.emplace(std::string(piece), std::vector<uint32_t>(ids.begin() + first, ids.end()));
}

// The merge order is HF's: always the pending merge of lowest rank, leftmost first. A queued merge is stale when its
// left symbol was absorbed, lost its neighbour, or now forms a pair that merges into a different token.
void BytePairModel::merge_symbols(std::string_view piece, std::vector<uint32_t>& ids) const {
  if (ignore_merges_) {
    const auto whole = id_of_bytes_.find(std::string(piece));
    if (whole != id_of_bytes_.end()) {
      ids.push_back(whole->second);
      return;
    }
  }
  struct Symbol {
    uint32_t id;
    int prev;
    int next;
    bool absorbed;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  for (char byte : piece) {
    const int64_t id = id_of_byte_[static_cast<unsigned char>(byte)];
    if (id < 0) continue;  // HF drops characters missing from the vocabulary when there is no unk token
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({static_cast<uint32_t>(id), index - 1, index + 1, false});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  struct Candidate {
    uint32_t rank;
    int position;
    uint32_t merged_id;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : position > other.position;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto enqueue = [&](int left) {
    const int right = symbols[left].next;
    if (right < 0) return;
    const auto it = merges_.find(pair_key(symbols[left].id, symbols[right].id));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.merged_id});
  };
  for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) enqueue(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.position];
    if (left.absorbed || left.next < 0) continue;
    const auto it = merges_.find(pair_key(left.id, symbols[left.next].id));
    if (it == merges_.end() || it->second.merged_id != top.merged_id) continue;
    Symbol& right = symbols[left.next];
    right.absorbed = true;
    left.id = top.merged_id;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.position;
    if (left.prev >= 0) enqueue(left.prev);
    enqueue(top.position);
  }
  for (int i = 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
}

}  // namespace vavilov::tokenizer
