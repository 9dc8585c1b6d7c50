#pragma once
// Splits streamed model text into what OpenAI responses carry separately: `content`, `reasoning_content` (inside
// <think>…</think>) and `tool_calls` (<tool_call>…</tool_call> blocks). Like stop strings, text that could be the
// start of a marker is held back until the next piece decides it; a tool call is released once its block closes.
#include <string>
#include <string_view>
#include <vector>

#include "server/tool_calls.h"

namespace vavilov::server {

struct OutputDelta {
  std::string reasoning, content;
  std::vector<ToolCall> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

struct OutputParserOptions {
  bool reasoning = true;             // split <think> blocks into reasoning_content
  bool starts_in_reasoning = false;  // the prompt already opened <think>
  bool tools = false;                // the request offered tools: parse <tool_call> blocks
  ToolParameterTypes parameter_types;
};

class OutputParser {
 public:
  explicit OutputParser(OutputParserOptions options);

  OutputDelta push(std::string_view text);
  // Everything still held at the end; an unclosed tool call is parsed if it can be, else returned as content.
  OutputDelta finish();
  bool saw_tool_calls() const { return tool_calls_ > 0; }

 private:
  enum class Mode { kContent, kReasoning, kToolCall };
  void consume(OutputDelta& out, bool final);
  // Returns false when the buffer needs more text.
  bool consume_text(OutputDelta& out, bool final);
  bool consume_tool_call(OutputDelta& out, bool final);
  void emit_content(OutputDelta& out, std::string_view text);

  OutputParserOptions options_;
  Mode mode_;
  std::string buffer_;
  bool skip_space_ = false;  // whitespace right after </think> or </tool_call> is markup, not content
  int tool_calls_ = 0;
};

}  // namespace vavilov::server
