#include "tokenizer/tokenizer.h"

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/utf8.h"

namespace vavilov::tokenizer {
namespace {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  check(static_cast<bool>(in), "{}: cannot open", path.string());
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

std::string type_of(const nlohmann::json& spec) {
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string()) return {};
  return spec["type"].get<std::string>();
}

// Ids only depend on these when they are byte-level; other decoders or post-processors would change the output.
void check_supported_components(const nlohmann::json& root, const std::string& file) {
  const std::string decoder = type_of(root.value("decoder", nlohmann::json()));
  check(decoder == "ByteLevel", "{}: field decoder.type: unsupported decoder \"{}\" (supported: ByteLevel)", file,
        decoder);
  const auto& post_processor = root.value("post_processor", nlohmann::json());
  check(post_processor.is_null() || type_of(post_processor) == "ByteLevel",
        "{}: field post_processor.type: unsupported post-processor \"{}\" (supported: ByteLevel or null)", file,
        type_of(post_processor));
  for (const char* field : {"truncation", "padding"})
    check(root.value(field, nlohmann::json()).is_null(), "{}: field {}: must be null (not supported)", file, field);
}

// The ByteLevel decoder maps each token's characters back to bytes; a token with characters outside the GPT-2
// alphabet (an added token such as "<｜User｜>") contributes its own UTF-8 bytes instead.
std::string decoded_bytes_of(const std::string& token) {
  auto bytes = byte_level_to_bytes(token);
  return bytes ? std::move(*bytes) : token;
}

}  // namespace

Tokenizer Tokenizer::from_file(const std::filesystem::path& path) {
  return from_json_text(read_file(path), path.string());
}

Tokenizer Tokenizer::from_model_dir(const std::filesystem::path& model_dir) {
  const auto path = model_dir / "tokenizer.json";
  check(std::filesystem::is_regular_file(path), "{}: model directory has no tokenizer.json", model_dir.string());
  return from_file(path);
}

Tokenizer Tokenizer::from_json_text(std::string_view json_text, const std::string& file) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: invalid JSON: {}", file, e.what());
  }
  check(root.is_object(), "{}: expected a JSON object at the top level", file);
  try {
    check_supported_components(root, file);
    Tokenizer tokenizer;
    tokenizer.normalizer_ = Normalizer::from_json(root.value("normalizer", nlohmann::json()), file);
    tokenizer.pre_tokenizer_ = PreTokenizer::from_json(root.value("pre_tokenizer", nlohmann::json()), file);
    check(tokenizer.pre_tokenizer_.has_byte_level(),
          "{}: field pre_tokenizer: no ByteLevel step (only byte-level BPE is supported)", file);
    check(root.contains("model"), "{}: field model: missing", file);
    tokenizer.model_ = std::make_unique<BytePairModel>(BytePairModel::from_json(root["model"], file));
    tokenizer.added_vocabulary_ =
        AddedVocabulary::from_json(root.value("added_tokens", nlohmann::json()), tokenizer.normalizer_, file);

    const BytePairModel& model = *tokenizer.model_;
    size_t size = model.vocab_size();
    for (const AddedToken& token : tokenizer.added_vocabulary_.tokens()) size = std::max<size_t>(size, token.id + 1);
    tokenizer.token_bytes_.resize(size);
    tokenizer.known_id_.resize(size);
    for (uint32_t id = 0; id < model.vocab_size(); ++id) {
      tokenizer.known_id_[id] = !model.token_string(id).empty();
      tokenizer.token_bytes_[id] = decoded_bytes_of(model.token_string(id));
    }
    for (const AddedToken& token : tokenizer.added_vocabulary_.tokens()) {
      tokenizer.known_id_[token.id] = true;
      tokenizer.token_bytes_[token.id] = decoded_bytes_of(token.content);
    }
    return tokenizer;
  } catch (const nlohmann::json::exception& e) {
    fail("{}: unexpected JSON structure: {}", file, e.what());
  }
}

// HF's pipeline: added tokens with normalized=false are cut out of the raw text; the rest is normalised, cut again
// at tokens with normalized=true, pre-tokenized, and each piece goes through BPE.
std::vector<uint32_t> Tokenizer::encode(std::string_view input) const {
  const std::string text = to_valid_utf8(input);
  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::lock_guard lock(*model_mutex_);
  for (const TextSegment& raw : added_vocabulary_.split(text, false)) {
    if (raw.id) {
      ids.push_back(*raw.id);
      continue;
    }
    const std::string normalized = normalizer_.apply(std::string_view(text).substr(raw.begin, raw.end - raw.begin));
    for (const TextSegment& segment : added_vocabulary_.split(normalized, true)) {
      if (segment.id) {
        ids.push_back(*segment.id);
      } else {
        encode_text(std::string_view(normalized).substr(segment.begin, segment.end - segment.begin), ids);
      }
    }
  }
  return ids;
}

void Tokenizer::encode_text(std::string_view text, std::vector<uint32_t>& ids) const {
  PreTokenized pre_tokenized;
  pre_tokenized.pieces.push_back(text);
  pre_tokenizer_.apply(pre_tokenized);
  for (std::string_view piece : pre_tokenized.pieces) model_->encode_piece(piece, ids);
}

std::string_view Tokenizer::token_bytes(uint32_t id) const {
  check(id < known_id_.size() && known_id_[id], "token id {} is not in the vocabulary (size {})", id, vocab_size());
  return token_bytes_[id];
}

bool Tokenizer::is_special(uint32_t id) const {
  const AddedToken* token = added_vocabulary_.find(id);
  return token && token->special;
}

std::string Tokenizer::decode(std::span<const uint32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (uint32_t id : ids) {
    std::string_view token = token_bytes(id);
    if (!(skip_special_tokens && is_special(id))) bytes.append(token);
  }
  return to_valid_utf8(bytes);
}

std::optional<uint32_t> Tokenizer::token_to_id(const std::string& token) const {
  for (const AddedToken& added : added_vocabulary_.tokens())
    if (added.content == token) return added.id;
  return model_->id_of(token);
}

}  // namespace vavilov::tokenizer
