#include "tokenizer/pre_tokenizer.h"

#include <algorithm>

#include "core/error.h"

namespace vavilov::tokenizer {
namespace {

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Segment {
  MatchRange range;
  bool is_match;
};

// Cuts `text` into alternating unmatched and matched segments covering it, like HF's Pattern::find_matches.
std::vector<Segment> segments_of(const Regex& regex, std::string_view text, bool invert) {
  std::vector<MatchRange> matches;
  regex.find_all(text, matches);
  std::vector<Segment> segments;
  size_t previous_end = 0;
  for (const MatchRange& match : matches) {
    if (match.begin > previous_end) segments.push_back({{previous_end, match.begin}, invert});
    segments.push_back({match, !invert});
    previous_end = match.end;
  }
  if (previous_end < text.size()) segments.push_back({{previous_end, text.size()}, invert});
  return segments;
}

// Applies a split behaviour: which segments survive and which are glued to a neighbour.
std::vector<MatchRange> apply_behavior(const std::vector<Segment>& segments, SplitBehavior behavior) {
  std::vector<MatchRange> kept;
  bool previous_was_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Segment& segment : segments) kept.push_back(segment.range);
      break;
    case SplitBehavior::kRemoved:
      for (const Segment& segment : segments)
        if (!segment.is_match) kept.push_back(segment.range);
      break;
    case SplitBehavior::kContiguous:
      for (const Segment& segment : segments) {
        if (!kept.empty() && segment.is_match == previous_was_match) {
          kept.back().end = segment.range.end;
        } else {
          kept.push_back(segment.range);
        }
        previous_was_match = segment.is_match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Segment& segment : segments) {
        if (!kept.empty() && segment.is_match && !previous_was_match) {
          kept.back().end = segment.range.end;
        } else {
          kept.push_back(segment.range);
        }
        previous_was_match = segment.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (!kept.empty() && it->is_match && !previous_was_match) {
          kept.back().begin = it->range.begin;
        } else {
          kept.push_back(it->range);
        }
        previous_was_match = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
  }
  return kept;
}

class SplitStep final : public PreTokenizerStep {
 public:
  SplitStep(Regex regex, SplitBehavior behavior, bool invert)
      : regex_(std::move(regex)), behavior_(behavior), invert_(invert) {}

  void apply(PreTokenized& text) const override {
    std::vector<std::string_view> result;
    result.reserve(text.pieces.size());
    for (std::string_view piece : text.pieces) {
      for (const MatchRange& range : apply_behavior(segments_of(regex_, piece, invert_), behavior_)) {
        if (range.end > range.begin) result.push_back(piece.substr(range.begin, range.end - range.begin));
      }
    }
    text.pieces = std::move(result);
  }

 private:
  Regex regex_;
  SplitBehavior behavior_;
  bool invert_;
};

// GPT-2's pattern, which ByteLevel applies itself when use_regex is set.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ByteLevel's byte mapping happens in the model (it works on raw bytes); here only the optional space prefix
// and GPT-2 split remain.
class ByteLevelStep final : public PreTokenizerStep {
 public:
  ByteLevelStep(bool add_prefix_space, bool use_regex, const std::string& where) : add_prefix_space_(add_prefix_space) {
    if (use_regex)
      gpt2_split_ = std::make_unique<SplitStep>(Regex(kGpt2Pattern, false, where), SplitBehavior::kIsolated, false);
  }

  void apply(PreTokenized& text) const override {
    if (add_prefix_space_) {
      for (std::string_view& piece : text.pieces) {
        if (!piece.empty() && piece.front() == ' ') continue;
        std::string& prefixed = text.owned.emplace_back(1, ' ');
        prefixed.append(piece);
        piece = prefixed;
      }
    }
    if (gpt2_split_) gpt2_split_->apply(text);
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<SplitStep> gpt2_split_;
};

SplitBehavior parse_behavior(const nlohmann::json& spec, const std::string& where) {
  const std::string name = spec.value("behavior", std::string("Isolated"));
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  fail("{}.behavior: unknown split behaviour \"{}\"", where, name);
}

std::unique_ptr<SplitStep> parse_split(const nlohmann::json& spec, const std::string& where) {
  check(spec.contains("pattern") && spec["pattern"].is_object(), "{}.pattern: expected an object", where);
  const nlohmann::json& pattern = spec["pattern"];
  const bool literal = pattern.contains("String");
  const char* key = literal ? "String" : "Regex";
  check(pattern.contains(key) && pattern[key].is_string(), "{}.pattern: expected a string \"Regex\" or \"String\"",
        where);
  const bool invert = spec.value("invert", false);
  return std::make_unique<SplitStep>(Regex(pattern[key].get<std::string>(), literal, where + ".pattern"),
                                     parse_behavior(spec, where), invert);
}

void collect(const nlohmann::json& spec, const std::string& where,
             std::vector<std::unique_ptr<PreTokenizerStep>>& steps, bool& has_byte_level) {
  if (spec.is_null()) return;
  check(spec.is_object() && spec.contains("type") && spec["type"].is_string(),
        "{}: expected an object with a string \"type\"", where);
  const std::string type = spec["type"];
  if (type == "Sequence") {
    check(spec.contains("pretokenizers") && spec["pretokenizers"].is_array(), "{}.pretokenizers: expected an array",
          where);
    for (size_t i = 0; i < spec["pretokenizers"].size(); ++i)
      collect(spec["pretokenizers"][i], fmt::format("{}.pretokenizers[{}]", where, i), steps, has_byte_level);
  } else if (type == "Split") {
    steps.push_back(parse_split(spec, where));
  } else if (type == "ByteLevel") {
    check(!has_byte_level, "{}: ByteLevel appears twice", where);
    has_byte_level = true;
    steps.push_back(
        std::make_unique<ByteLevelStep>(spec.value("add_prefix_space", false), spec.value("use_regex", true), where));
  } else {
    fail("{}.type: unsupported pre-tokenizer \"{}\" (supported: Sequence, Split, ByteLevel)", where, type);
  }
}

}  // namespace

PreTokenizer PreTokenizer::from_json(const nlohmann::json& spec, const std::string& file) {
  PreTokenizer pre_tokenizer;
  try {
    collect(spec, file + ": field pre_tokenizer", pre_tokenizer.steps_, pre_tokenizer.has_byte_level_);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: field pre_tokenizer: {}", file, e.what());
  }
  return pre_tokenizer;
}

void PreTokenizer::apply(PreTokenized& text) const {
  for (const auto& step : steps_) step->apply(text);
  std::erase_if(text.pieces, [](std::string_view piece) { return piece.empty(); });
}

}  // namespace vavilov::tokenizer
