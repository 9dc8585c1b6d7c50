// libFuzzer target: arbitrary bytes through the real tokenizers (encode, decode, streaming decode) and through
// the tokenizer.json loader. Only vavilov::Error may escape the loader; encoding never fails.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "core/error.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace {

using vavilov::tokenizer::Tokenizer;

const Tokenizer& real_tokenizer(const char* name) {
  static std::unique_ptr<Tokenizer> qwen, deepseek;
  auto& slot = std::string(name) == "qwen3" ? qwen : deepseek;
  if (!slot) {
    const auto dir = std::filesystem::path(VAVILOV_SOURCE_DIR) / ".." / "shared" / "data" / "tokenizers" / name;
    slot = std::make_unique<Tokenizer>(Tokenizer::from_model_dir(dir));
  }
  return *slot;
}

void check_round_trip(const Tokenizer& tokenizer, const std::string& text, bool has_normalizer) {
  const auto ids = tokenizer.encode(text);
  const std::string decoded = tokenizer.decode(ids);
  if (!has_normalizer && decoded != vavilov::tokenizer::to_valid_utf8(text)) std::abort();
  vavilov::tokenizer::StreamDecoder stream(tokenizer);
  std::string streamed;
  for (uint32_t id : ids) streamed += stream.push(id);
  streamed += stream.finish();
  if (streamed != decoded || !vavilov::tokenizer::is_valid_utf8(decoded)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0: check_round_trip(real_tokenizer("qwen3"), text, true); break;
    case 1: check_round_trip(real_tokenizer("deepseek_v3"), text, false); break;
    default:
      try {
        const Tokenizer tokenizer = Tokenizer::from_json_text(text, "fuzz.json");
        tokenizer.decode(tokenizer.encode("Hello, world! 123"));
      } catch (const vavilov::Error&) {
      }
  }
  return 0;
}
