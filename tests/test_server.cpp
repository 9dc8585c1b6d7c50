// Server pieces without HTTP: stop-string holdback, tool-call and reasoning parsing, SSE framing, request
// validation, the prefix cache.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/api_error.h"
#include "server/output_parser.h"
#include "server/prefix_cache.h"
#include "server/request.h"
#include "server/sse.h"
#include "server/stop_matcher.h"
#include "server/tool_calls.h"

namespace vavilov::server {
namespace {

using nlohmann::ordered_json;

std::string feed(StopMatcher& matcher, const std::vector<std::string>& pieces) {
  std::string out;
  for (const auto& piece : pieces) out += matcher.push(piece);
  return out + matcher.finish();
}

TEST(ServerStop, HoldsBackAcrossPieces) {
  StopMatcher matcher({"lo W"});
  EXPECT_EQ(matcher.push("Hel"), "He");  // "l" could start the stop string
  EXPECT_EQ(matcher.push("lo"), "l");    // "lo" still could
  EXPECT_EQ(matcher.push(" Wo"), "");
  EXPECT_TRUE(matcher.stopped());
  EXPECT_EQ(matcher.push("rld"), "");
  EXPECT_EQ(matcher.finish(), "");
}

TEST(ServerStop, ReleasesHeldTextAtTheEnd) {
  StopMatcher matcher({"!Zx"});
  EXPECT_EQ(matcher.push("Zq!"), "Zq");
  EXPECT_EQ(matcher.push("Zq!"), "!Zq");
  EXPECT_EQ(matcher.finish(), "!");
  EXPECT_FALSE(matcher.stopped());
}

TEST(ServerStop, EarliestOfSeveralAndCharacterByCharacter) {
  StopMatcher matcher({"world", "lo"});
  std::vector<std::string> chars;
  for (char c : std::string("hello world")) chars.emplace_back(1, c);
  EXPECT_EQ(feed(matcher, chars), "hel");
  StopMatcher none({""});
  EXPECT_EQ(feed(none, {"a", "b"}), "ab");
  StopMatcher at_start({"x"});
  EXPECT_EQ(feed(at_start, {"xyz"}), "");
  EXPECT_TRUE(at_start.stopped());
}

TEST(ServerStop, PartialMarkerSuffix) {
  EXPECT_EQ(partial_marker_suffix("abc<tool", {"<tool_call>"}), 5u);
  EXPECT_EQ(partial_marker_suffix("abc", {"<tool_call>"}), 0u);
  EXPECT_EQ(partial_marker_suffix("<tool_call>", {"<tool_call>"}), 0u);  // whole markers are found, not held
  EXPECT_EQ(partial_marker_suffix("a</", {"<think>", "</think>"}), 2u);
}

TEST(ServerToolCalls, JsonForm) {
  auto calls = parse_tool_call_block("\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n", {});
  ASSERT_TRUE(calls);
  ASSERT_EQ(calls->size(), 1u);
  EXPECT_EQ((*calls)[0].name, "f");
  EXPECT_EQ(ordered_json::parse((*calls)[0].arguments), ordered_json({{"x", 1}}));
  auto stringly = parse_tool_call_block(R"({"name": "g", "arguments": "{\"y\": \"z\"}"})", {});
  ASSERT_TRUE(stringly);
  EXPECT_EQ(ordered_json::parse((*stringly)[0].arguments), ordered_json({{"y", "z"}}));
  auto no_arguments = parse_tool_call_block(R"({"name": "h"})", {});
  ASSERT_TRUE(no_arguments);
  EXPECT_EQ((*no_arguments)[0].arguments, "{}");
}

TEST(ServerToolCalls, XmlFormUsesDeclaredTypes) {
  ToolParameterTypes types{{"get", {{"city", "string"}, {"days", "integer"}, {"zip", "string"}}}};
  const std::string body =
      "<function=get>\n<parameter=city>\nBerlin\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
      "<parameter=zip>\n10115\n</parameter>\n<parameter=extra>\n{\"a\": true}\n</parameter>\n</function>\n"
      "<function=other>\n</function>";
  auto calls = parse_tool_call_block(body, types);
  ASSERT_TRUE(calls);
  ASSERT_EQ(calls->size(), 2u);
  EXPECT_EQ((*calls)[0].name, "get");
  EXPECT_EQ(ordered_json::parse((*calls)[0].arguments),
            ordered_json({{"city", "Berlin"}, {"days", 2}, {"zip", "10115"}, {"extra", {{"a", true}}}}));
  EXPECT_EQ((*calls)[1].name, "other");
  EXPECT_EQ((*calls)[1].arguments, "{}");
}

TEST(ServerToolCalls, RejectsMalformedMarkup) {
  for (const char* body : {"", "{\"name\": 3}", "{not json", "<function=f><parameter=a>1</function>",
                           "<function=>x</function>", "text <function=f></function>", "[1, 2]"})
    EXPECT_FALSE(parse_tool_call_block(body, {})) << body;
}

OutputDelta run_parser(OutputParser& parser, const std::string& text, size_t piece) {
  OutputDelta all;
  const auto add = [&](OutputDelta d) {
    all.reasoning += d.reasoning;
    all.content += d.content;
    for (auto& call : d.tool_calls) all.tool_calls.push_back(call);
  };
  for (size_t i = 0; i < text.size(); i += piece) add(parser.push(text.substr(i, piece)));
  add(parser.finish());
  return all;
}

TEST(ServerOutputParser, SplitsReasoningContentAndToolCallsAtAnyPieceSize) {
  const std::string text =
      "<think>plan it</think>\n\nSure.<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"<b>\"}}\n</tool_call>\n"
      "<tool_call>\n<function=g>\n<parameter=p>\nv\n</parameter>\n</function>\n</tool_call>";
  for (size_t piece : {1, 2, 3, 7, 1000}) {
    OutputParser parser({true, false, true, {}});
    OutputDelta all = run_parser(parser, text, piece);
    EXPECT_EQ(all.reasoning, "plan it") << piece;
    EXPECT_EQ(all.content, "Sure.") << piece;
    ASSERT_EQ(all.tool_calls.size(), 2u) << piece;
    EXPECT_EQ(all.tool_calls[0].name, "f");
    EXPECT_EQ(all.tool_calls[1].arguments, R"({"p":"v"})");
    EXPECT_TRUE(parser.saw_tool_calls());
  }
}

TEST(ServerOutputParser, StreamsPlainTextAtOnceAndHoldsOnlyMarkerPrefixes) {
  OutputParser parser({true, false, true, {}});
  EXPECT_EQ(parser.push("a < b").content, "a < b");
  EXPECT_EQ(parser.push(" <tool").content, " ");
  EXPECT_EQ(parser.push("box>").content, "<toolbox>");
}

TEST(ServerOutputParser, PromptOpenedThinkAndDisabledFeatures) {
  OutputParser opened({true, true, false, {}});
  OutputDelta all = run_parser(opened, "hmm</think>answer", 2);
  EXPECT_EQ(all.reasoning, "hmm");
  EXPECT_EQ(all.content, "answer");
  OutputParser plain({false, false, false, {}});
  all = run_parser(plain, "<think>x</think><tool_call>{}</tool_call>", 3);
  EXPECT_EQ(all.content, "<think>x</think><tool_call>{}</tool_call>");
}

TEST(ServerOutputParser, InvalidOrUnclosedToolCallsBecomeContent) {
  OutputParser parser({false, false, true, {}});
  OutputDelta all = run_parser(parser, "x<tool_call>oops</tool_call>y<tool_call>{\"name\":", 4);
  EXPECT_EQ(all.content, "x<tool_call>oops</tool_call>y<tool_call>{\"name\":");
  EXPECT_TRUE(all.tool_calls.empty());
  OutputParser unclosed({false, false, true, {}});
  all = run_parser(unclosed, "<tool_call>{\"name\": \"f\"}", 5);
  ASSERT_EQ(all.tool_calls.size(), 1u);  // generation ended (length) right before the closing tag
}

TEST(ServerSse, FramesChunksAndReplacesInvalidUtf8) {
  EXPECT_EQ(sse_event(ordered_json{{"a", "x\ny"}}), "data: {\"a\":\"x\\ny\"}\n\n");
  EXPECT_EQ(sse_event(ordered_json{{"a", std::string("\xE2\x82")}}), "data: {\"a\":\"\xEF\xBF\xBD\"}\n\n");
  EXPECT_STREQ(kSseDone, "data: [DONE]\n\n");
  const auto body = error_body(ApiError(400, "bad", "temperature"));
  EXPECT_EQ(json_text(body),
            R"({"error":{"message":"bad","type":"invalid_request_error","param":"temperature","code":null}})");
}

int error_status(const std::string& body, bool chat = true, std::string* param = nullptr) {
  try {
    parse_request(body, chat, {"m", 100});
  } catch (const ApiError& e) {
    if (param) *param = e.param;
    return e.status;
  }
  return 0;
}

TEST(ServerRequest, ValidatesTypesRangesAndUnsupportedParameters) {
  const std::string chat = R"("model": "m", "messages": [{"role": "user", "content": "hi"}])";
  EXPECT_EQ(error_status("{" + chat + "}"), 0);
  EXPECT_EQ(error_status("{" + chat), 400);
  EXPECT_EQ(error_status("[]"), 400);
  EXPECT_EQ(error_status("{\"x\": \"\xff\"}"), 400);
  EXPECT_EQ(error_status(R"({"model": "other", "messages": []})"), 404);
  std::string param;
  EXPECT_EQ(error_status("{" + chat + R"(, "temperature": "hot"})", true, &param), 400);
  EXPECT_EQ(param, "temperature");
  EXPECT_EQ(error_status("{" + chat + R"(, "temperature": 3})", true, &param), 400);
  EXPECT_EQ(error_status("{" + chat + R"(, "n": 2})", true, &param), 400);
  EXPECT_EQ(param, "n");
  EXPECT_EQ(error_status("{" + chat + R"(, "logprobs": true})"), 400);
  EXPECT_EQ(error_status("{" + chat + R"(, "logit_bias": {"100": 1}})"), 400);  // vocabulary is 100
  EXPECT_EQ(error_status("{" + chat + R"(, "logit_bias": {"7": 101}})"), 400);
  EXPECT_EQ(error_status("{" + chat + R"(, "stop": [1]})"), 400);
  EXPECT_EQ(error_status("{" + chat + R"(, "max_tokens": 0})"), 400);
  EXPECT_EQ(error_status("{" + chat + R"(, "stream_options": {"include_usage": true}})"), 400);
  EXPECT_EQ(error_status("{" + chat + R"(, "tool_choice": "required", "tools": []})"), 400);
  EXPECT_EQ(error_status(R"({"model": "m", "messages": [{"role": "robot", "content": "hi"}]})"), 400);
  EXPECT_EQ(error_status(R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})"), 400);
  EXPECT_EQ(error_status(R"({"model": "m", "prompt": ""})", false), 400);
  EXPECT_EQ(error_status(R"({"model": "m", "prompt": [1, 200]})", false), 400);
  EXPECT_EQ(error_status(R"({"model": "m", "prompt": ["a", "b"]})", false), 400);
}

TEST(ServerRequest, ParsesWhatGenerationNeeds) {
  const auto request = parse_request(
      R"({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
          {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
           "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}],
          "stop": "END", "max_completion_tokens": 5, "temperature": 0, "top_k": -1, "seed": 3,
          "logit_bias": {"7": -100}, "stream": true, "stream_options": {"include_usage": true},
          "tools": [{"type": "function", "function": {"name": "f",
                     "parameters": {"properties": {"a": {"type": "integer"}}}}}],
          "chat_template_kwargs": {"enable_thinking": false}})",
      true, {"m", 100});
  EXPECT_EQ(request.messages[0]["role"], "system");
  EXPECT_EQ(request.messages[0]["content"], "be brief");
  EXPECT_EQ(request.messages[1]["tool_calls"][0]["function"]["arguments"]["a"], 1);
  EXPECT_EQ(request.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(request.max_tokens, 5);
  EXPECT_TRUE(request.sampling.greedy());
  EXPECT_EQ(request.sampling.top_k, 0);
  EXPECT_EQ(request.sampling.seed, 3u);
  ASSERT_EQ(request.sampling.logit_bias.size(), 1u);
  EXPECT_TRUE(request.stream && request.include_usage && request.parse_tools);
  EXPECT_EQ(request.parameter_types.at("f").at("a"), "integer");
  EXPECT_EQ(request.enable_thinking, false);
  const auto ids = parse_request(R"({"model": "m", "prompt": [1, 2, 3]})", false, {"m", 100});
  EXPECT_EQ(ids.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(ids.sampling.temperature, 1.0f);  // OpenAI's default
}

SequenceState state_at(int64_t position, size_t floats) {
  SequenceState state;
  state.position = position;
  state.layers.resize(1);
  state.layers[0].attn.keys.assign(floats, 0.0f);
  return state;
}

TEST(ServerPrefixCache, LongestProperPrefixAndLruUnderBudget) {
  const size_t entry = state_bytes(state_at(0, 1000));
  PrefixCache cache(2 * entry + 200);
  const std::vector<int32_t> prompt{1, 2, 3, 4, 5, 6};
  cache.insert(std::span(prompt).first(2), state_at(2, 1000));
  cache.insert(std::span(prompt).first(4), state_at(4, 1000));
  auto hit = cache.lookup(prompt);
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->tokens.size(), 4u);
  EXPECT_FALSE(cache.lookup(std::span(prompt).first(2)));  // a prompt needs at least one token to run
  EXPECT_FALSE(cache.lookup(std::vector<int32_t>{9, 9, 9}));
  cache.lookup(std::span(prompt).first(3));  // touches the 2-token entry: the 4-token one is now the oldest
  const std::vector<int32_t> other{7, 8, 9};
  cache.insert(std::span(other).first(2), state_at(2, 1000));
  EXPECT_EQ(cache.stats().entries, 2);
  EXPECT_EQ(cache.lookup(prompt)->tokens.size(), 2u);
  EXPECT_LE(cache.stats().bytes, cache.stats().budget);
  PrefixCache tiny(10);
  tiny.insert(std::span(prompt).first(2), state_at(2, 1000));
  EXPECT_EQ(tiny.stats().entries, 0);
}

}  // namespace
}  // namespace vavilov::server
