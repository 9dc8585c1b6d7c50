// config.json parsing: the released Flash-Next config, both file layouts, the layer-type aliases, HF defaults,
// and one test per validation rule. Every error must name the file and the offending field.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "error_of.h"
#include "model/config.h"

namespace vavilov {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

constexpr const char* kSource = "models/x/config.json";

// A small but complete text config with Flash-Next's geometry: 8 layers, attention every 4th, PLE on layer 2.
json base_text_config() {
  json layer_types = json::array();
  for (int i = 0; i < 8; ++i) layer_types.push_back(i % 4 == 3 ? "qwen_sparse_attention" : "linear_attention");
  return json{{"model_type", "qwen4_exp_text"},
              {"vocab_size", 248320},
              {"hidden_size", 2560},
              {"num_hidden_layers", 8},
              {"num_attention_heads", 24},
              {"num_key_value_heads", 2},
              {"hidden_act", "silu"},
              {"rms_norm_eps", 1e-6},
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e7}, {"partial_rotary_factor", 0.25}}},
              {"head_dim", 256},
              {"linear_conv_kernel_dim", 4},
              {"linear_key_head_dim", 128},
              {"linear_value_head_dim", 128},
              {"linear_num_key_heads", 16},
              {"linear_num_value_heads", 48},
              {"moe_intermediate_size", 640},
              {"shared_expert_intermediate_size", 640},
              {"num_experts_per_tok", 10},
              {"num_experts", 512},
              {"layer_types", layer_types},
              {"eos_token_id", 248044},
              {"hc_count", 4},
              {"hc_lowrank", 320},
              {"ple_layer_ids", {2}},
              {"ple_embed_dim", 2560},
              {"ngram_size", 3},
              {"heads_per_ngram", 8},
              {"split_ngram_parts", 128},
              {"indexer_n_heads", 4},
              {"indexer_kv_heads", 1},
              {"indexer_head_dim", 128},
              {"indexer_budget", 2048},
              {"indexer_compress_ratio", 4},
              {"output_gate_type", "sigmoid"},
              {"mtp_num_hidden_layers", 1}};
}

json nested(json text) {
  text.erase("model_type");
  return json{{"model_type", "qwen4_exp"}, {"text_config", text}, {"vision_config", json::object()}};
}

ModelConfig parse(const json& config) { return parse_model_config(config.dump(), kSource); }

using test::error_of;

std::vector<LayerKind> kinds(const std::string& pattern) {
  std::vector<LayerKind> out;
  for (char c : pattern) out.push_back(c == 'L' ? LayerKind::GatedDeltaNet : LayerKind::SparseAttention);
  return out;
}

TEST(Config, FlashNextMatchesTheSpec) {
  std::string path = std::string(VAVILOV_SOURCE_DIR) + "/../shared/data/flash-next/config.json";
  if (!std::filesystem::exists(path)) {
    const char* ci = std::getenv("CI");
    if (ci && std::string(ci) == "true") FAIL() << "missing " << path;
    GTEST_SKIP() << "missing " << path;
  }
  ModelConfig c = load_model_config(path);
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.hidden_size, 2560);
  ASSERT_EQ(c.num_layers, 48);
  ASSERT_EQ(c.layer_kinds.size(), 48u);
  for (int i = 0; i < 48; ++i)
    EXPECT_EQ(c.layer_kinds[i], i % 4 == 3 ? LayerKind::SparseAttention : LayerKind::GatedDeltaNet) << i;
  EXPECT_EQ(c.num_attention_heads, 24);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 48);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_TRUE(c.gdn_gate_sigmoid);
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 10);
  EXPECT_EQ(c.moe_intermediate_size, 640);
  EXPECT_EQ(c.shared_expert_intermediate_size, 640);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.hc_count, 4);
  EXPECT_EQ(c.hc_lowrank, 320);
  EXPECT_EQ(c.indexer_n_heads, 4);
  EXPECT_EQ(c.indexer_head_dim, 128);
  EXPECT_EQ(c.indexer_budget, 2048);
  EXPECT_EQ(c.indexer_compress_ratio, 4);
  EXPECT_EQ(c.ple_layers, std::vector<int>{1});
  EXPECT_TRUE(c.is_ple_layer(1));
  EXPECT_FALSE(c.is_ple_layer(2));
  EXPECT_EQ(c.ple_embed_dim, 2560);
  EXPECT_EQ(c.ngram_heads(), 16);
  EXPECT_EQ(c.ple_embed_dim / c.ngram_heads(), 160);
  EXPECT_EQ(c.split_ngram_parts, 128);
  EXPECT_EQ(c.eos(), 248044);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-6f);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.mtp_num_layers, 1);
  EXPECT_EQ(c.gdn_conv_dim(), 2 * 16 * 128 + 48 * 128);
}

TEST(Config, NestedAndTopLevelFormsAgree) {
  ModelConfig top = parse(base_text_config());
  ModelConfig inner = parse(nested(base_text_config()));
  EXPECT_EQ(top.hidden_size, inner.hidden_size);
  EXPECT_EQ(top.layer_kinds, inner.layer_kinds);
  EXPECT_EQ(top.rotary_dim, inner.rotary_dim);
  EXPECT_EQ(top.ple_layers, inner.ple_layers);
  EXPECT_EQ(top.eos_token_ids, inner.eos_token_ids);
  EXPECT_EQ(inner.layer_kinds, kinds("LLLALLLA"));
}

TEST(Config, LoadsFromModelDirectory) {
  auto dir = std::filesystem::temp_directory_path() / ("vavilov_config_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << nested(base_text_config()).dump(2);
  EXPECT_EQ(load_model_config(dir.string()).hidden_size, 2560);
  std::filesystem::remove_all(dir);
  EXPECT_THAT(error_of([&] { load_model_config(dir.string()); }), HasSubstr("config.json"));
}

TEST(Config, NestedErrorsNameTheFullFieldPath) {
  json config = nested(base_text_config());
  config["text_config"]["hidden_size"] = -3;
  EXPECT_EQ(error_of([&] { parse(config); }),
            "models/x/config.json: field text_config.hidden_size: must be a positive integer, got -3");
}

TEST(Config, FullAttentionAndDeepseekAreSparseAttentionAliases) {
  json config = base_text_config();
  config["layer_types"][3] = "full_attention";
  config["layer_types"][7] = "deepseek_sparse_attention";
  EXPECT_EQ(parse(config).layer_kinds, kinds("LLLALLLA"));
}

TEST(Config, LayerTypesDeriveFromFullAttentionInterval) {
  json config = base_text_config();
  config.erase("layer_types");
  EXPECT_EQ(parse(config).layer_kinds, kinds("LLLALLLA"));  // HF's default interval is 4
  config["full_attention_interval"] = 2;
  config["ple_layer_ids"] = {1};
  EXPECT_EQ(parse(config).layer_kinds, kinds("LALALALA"));
}

TEST(Config, HfDefaultsApply) {
  json config = base_text_config();
  for (const char* name : {"ple_embed_dim", "output_gate_type", "mtp_num_hidden_layers", "split_ngram_parts",
                           "norm_topk_prob", "tie_word_embeddings"})
    config.erase(name);
  config["rope_parameters"].erase("partial_rotary_factor");
  config["indexer_head_dim"] = 256;  // the full head is rotary now, and must fit the index head
  ModelConfig c = parse(config);
  EXPECT_EQ(c.ple_embed_dim, c.hidden_size);
  EXPECT_FALSE(c.gdn_gate_sigmoid);  // defaults to hidden_act = silu
  EXPECT_EQ(c.mtp_num_layers, 0);
  EXPECT_EQ(c.split_ngram_parts, 512);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.rotary_dim, 256);
}

TEST(Config, TopLevelRopeThetaIsAccepted) {
  json config = base_text_config();
  config["rope_parameters"].erase("rope_theta");
  config["rope_theta"] = 5e6;
  EXPECT_DOUBLE_EQ(parse(config).rope_theta, 5e6);
}

TEST(Config, EosListAndPleLayersAreNormalised) {
  json config = base_text_config();
  config["eos_token_id"] = {248044, 248046};
  config["ple_layer_ids"] = {6, 2, 2};
  ModelConfig c = parse(config);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{248044, 248046}));
  EXPECT_EQ(c.eos(), 248044);
  EXPECT_EQ(c.ple_layers, (std::vector<int>{1, 5}));
}

TEST(Config, WithoutPleEosIsOptional) {
  json config = base_text_config();
  config.erase("ple_layer_ids");
  config["eos_token_id"] = nullptr;
  ModelConfig c = parse(config);
  EXPECT_TRUE(c.ple_layers.empty());
  EXPECT_EQ(c.eos(), -1);
}

TEST(Config, TieWordEmbeddingsFromTheCompositeConfig) {
  json config = nested(base_text_config());
  config["tie_word_embeddings"] = true;
  EXPECT_TRUE(parse(config).tie_word_embeddings);
}

TEST(Config, NotJsonNamesTheFile) {
  EXPECT_THAT(error_of([] { parse_model_config("{\"model_type\": ", kSource); }),
              HasSubstr("models/x/config.json: not valid JSON"));
  EXPECT_THAT(error_of([] { parse_model_config("[1, 2]", kSource); }),
              HasSubstr("models/x/config.json: not a JSON object"));
}

// Found by fuzz_config: rendering a deeply nested value for the error message overflowed the stack.
TEST(Config, DeeplyNestedValueGivesAShortError) {
  std::string deep = std::string(100000, '[') + std::string(100000, ']');
  std::string text = R"({"model_type": "qwen4_exp_text", "hidden_size": )" + deep + "}";
  std::string message = error_of([&] { parse_model_config(text, kSource); });
  EXPECT_THAT(message,
              HasSubstr("models/x/config.json: field hidden_size: must be a positive integer, got [[[[...]]]]"));
  EXPECT_LT(message.size(), 200u);
}

// One malformed config per rule: a mutation of the valid base, the field the error must name, and a phrase.
struct BadCase {
  const char* label;
  std::function<void(json&)> mutate;
  const char* field;
  const char* phrase;
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.label; }

class BadConfig : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfig, IsRejectedNamingFileAndField) {
  json config = base_text_config();
  GetParam().mutate(config);
  std::string message = error_of([&] { parse(config); });
  EXPECT_THAT(message, HasSubstr(std::string(kSource) + ": field " + GetParam().field + ":"));
  EXPECT_THAT(message, HasSubstr(GetParam().phrase));
  EXPECT_EQ(message.find('\n'), std::string::npos) << "errors are one line";
}

const BadCase kBadCases[] = {
    {"NegativeHiddenSize", [](json& c) { c["hidden_size"] = -3; }, "hidden_size", "positive integer, got -3"},
    {"ZeroVocab", [](json& c) { c["vocab_size"] = 0; }, "vocab_size", "positive integer"},
    {"StringHiddenSize", [](json& c) { c["hidden_size"] = "2560"; }, "hidden_size", "got \"2560\""},
    {"FloatHeadDim", [](json& c) { c["head_dim"] = 256.0; }, "head_dim", "positive integer"},
    {"BoolLayerCount", [](json& c) { c["num_hidden_layers"] = true; }, "num_hidden_layers", "got true"},
    {"NullHiddenSize", [](json& c) { c["hidden_size"] = nullptr; }, "hidden_size", "got null"},
    {"HugeHiddenSize", [](json& c) { c["hidden_size"] = 4294967296ull; }, "hidden_size", "at most"},
    {"TooManyLayers", [](json& c) { c["num_hidden_layers"] = 100000000; }, "num_hidden_layers", "at most"},
    {"KvHeadsDoNotDivide", [](json& c) { c["num_key_value_heads"] = 5; }, "num_key_value_heads", "must divide"},
    {"LinearValueHeadsNotMultiple", [](json& c) { c["linear_num_value_heads"] = 40; }, "linear_num_value_heads",
     "multiple of linear_num_key_heads"},
    {"NegativeLinearKeyDim", [](json& c) { c["linear_key_head_dim"] = -128; }, "linear_key_head_dim",
     "positive integer"},
    {"HiddenActGelu", [](json& c) { c["hidden_act"] = "gelu"; }, "hidden_act", "must be \"silu\""},
    {"HiddenActNumber", [](json& c) { c["hidden_act"] = 1; }, "hidden_act", "must be a string"},
    {"OutputGateTanh", [](json& c) { c["output_gate_type"] = "tanh"; }, "output_gate_type", "sigmoid or silu"},
    {"HcCountOne", [](json& c) { c["hc_count"] = 1; }, "hc_count", "must be > 1"},
    {"ZeroExperts", [](json& c) { c["num_experts"] = 0; }, "num_experts", "positive integer"},
    {"ZeroTopK", [](json& c) { c["num_experts_per_tok"] = 0; }, "num_experts_per_tok", "positive integer"},
    {"TopKAboveExperts", [](json& c) { c["num_experts_per_tok"] = 513; }, "num_experts_per_tok",
     "[1, num_experts = 512]"},
    {"ZeroMoeWidth", [](json& c) { c["moe_intermediate_size"] = 0; }, "moe_intermediate_size", "positive"},
    {"ZeroSharedWidth", [](json& c) { c["shared_expert_intermediate_size"] = 0; }, "shared_expert_intermediate_size",
     "positive"},
    {"QsaFieldMissing", [](json& c) { c.erase("indexer_budget"); }, "indexer_budget", "missing"},
    {"QsaFieldNull", [](json& c) { c["indexer_n_heads"] = nullptr; }, "indexer_n_heads", "missing"},
    {"QsaFieldZero", [](json& c) { c["indexer_n_heads"] = 0; }, "indexer_n_heads", "positive integer"},
    {"QsaFieldNegative", [](json& c) { c["indexer_compress_ratio"] = -4; }, "indexer_compress_ratio",
     "positive integer"},
    {"IndexerKvHeadsTwo", [](json& c) { c["indexer_kv_heads"] = 2; }, "indexer_kv_heads", "must be 1"},
    {"BudgetNotDivisible", [](json& c) { c["indexer_budget"] = 2047; }, "indexer_budget",
     "divisible by indexer_compress_ratio"},
    {"RotaryAboveIndexerHead", [](json& c) { c["indexer_head_dim"] = 32; }, "indexer_head_dim",
     "at least rotary_dim (64)"},
    {"RotaryOdd", [](json& c) { c["head_dim"] = 12; }, "rope_parameters.partial_rotary_factor", "rotary_dim 3"},
    {"RotaryAboveHeadDim", [](json& c) { c["rope_parameters"]["partial_rotary_factor"] = 1.5; },
     "rope_parameters.partial_rotary_factor", "(0, 1]"},
    {"RotaryFactorString", [](json& c) { c["rope_parameters"]["partial_rotary_factor"] = "0.25"; },
     "rope_parameters.partial_rotary_factor", "positive finite number"},
    {"RopeThetaNegative", [](json& c) { c["rope_parameters"]["rope_theta"] = -1; }, "rope_parameters.rope_theta",
     "positive"},
    {"RopeParametersNotObject",
     [](json& c) {
       c["rope_parameters"] = {1, 2};
     },
     "rope_parameters", "must be an object"},
    {"EpsNegative", [](json& c) { c["rms_norm_eps"] = -1e-6; }, "rms_norm_eps", "positive"},
    {"PleLayerAboveRange", [](json& c) { c["ple_layer_ids"] = {9}; }, "ple_layer_ids[0]", "[1, 8], got 9"},
    {"PleLayerZero",
     [](json& c) {
       c["ple_layer_ids"] = {2, 0};
     },
     "ple_layer_ids[1]", "positive integer, got 0"},
    {"PleLayerOnAttention", [](json& c) { c["ple_layer_ids"] = {4}; }, "ple_layer_ids[0]",
     "not a linear_attention layer"},
    {"PleLayerString", [](json& c) { c["ple_layer_ids"] = {"2"}; }, "ple_layer_ids[0]", "positive integer"},
    {"PleLayersNotList", [](json& c) { c["ple_layer_ids"] = 2; }, "ple_layer_ids", "must be a list"},
    {"PleEmbedNotDivisible", [](json& c) { c["ple_embed_dim"] = 2561; }, "ple_embed_dim",
     "divisible by (ngram_size - 1) * heads_per_ngram = 16"},
    {"NgramSizeOne", [](json& c) { c["ngram_size"] = 1; }, "ngram_size", "at least 2"},
    {"EosMissingWithPle", [](json& c) { c.erase("eos_token_id"); }, "eos_token_id", "required"},
    {"EosEmptyListWithPle", [](json& c) { c["eos_token_id"] = json::array(); }, "eos_token_id", "required"},
    {"EosString", [](json& c) { c["eos_token_id"] = "</s>"; }, "eos_token_id", "token id"},
    {"EosListOfStrings",
     [](json& c) {
       c["eos_token_id"] = {248044, "x"};
     },
     "eos_token_id[1]", "non-negative"},
    {"EosOutsideVocab", [](json& c) { c["eos_token_id"] = 248320; }, "eos_token_id", "outside the vocabulary"},
    {"LayerTypesTooShort", [](json& c) { c["layer_types"].erase(7); }, "layer_types", "7 entries"},
    {"LayerTypesTooLong", [](json& c) { c["layer_types"].push_back("linear_attention"); }, "layer_types", "9 entries"},
    {"UnknownLayerType", [](json& c) { c["layer_types"][5] = "mamba"; }, "layer_types[5]",
     "unknown layer type \"mamba\""},
    {"LayerTypeNotString", [](json& c) { c["layer_types"][0] = 0; }, "layer_types[0]", "must be a string"},
    {"LayerTypesNotList", [](json& c) { c["layer_types"] = "linear_attention"; }, "layer_types", "list"},
    {"ZeroAttentionInterval",
     [](json& c) {
       c.erase("layer_types");
       c["full_attention_interval"] = 0;
     },
     "full_attention_interval", "positive integer"},
    {"NegativeMtp", [](json& c) { c["mtp_num_hidden_layers"] = -1; }, "mtp_num_hidden_layers", "non-negative"},
    {"TieNotBool", [](json& c) { c["tie_word_embeddings"] = 0; }, "tie_word_embeddings", "true or false"},
    {"NormTopkNotBool", [](json& c) { c["norm_topk_prob"] = "yes"; }, "norm_topk_prob", "true or false"},
    {"WrongModelType", [](json& c) { c["model_type"] = "qwen3_next"; }, "model_type", "got \"qwen3_next\""},
    {"MissingModelType", [](json& c) { c.erase("model_type"); }, "model_type", "missing"},
    {"NestedWithoutTextConfig",
     [](json& c) {
       c = json{{"model_type", "qwen4_exp"}};
     },
     "text_config", "missing"},
    {"TextConfigNotObject",
     [](json& c) {
       c = json{{"model_type", "qwen4_exp"}, {"text_config", 3}};
     },
     "text_config", "must be an object"},
    {"NestedBadField",
     [](json& c) {
       c = nested(c);
       c["text_config"]["indexer_kv_heads"] = 4;
     },
     "text_config.indexer_kv_heads", "must be 1"},
};

INSTANTIATE_TEST_SUITE_P(Rules, BadConfig, ::testing::ValuesIn(kBadCases),
                         [](const auto& info) { return std::string(info.param.label); });

}  // namespace
}  // namespace vavilov
