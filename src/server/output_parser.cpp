#include "server/output_parser.h"

#include "server/stop_matcher.h"

namespace vavilov::server {
namespace {
constexpr std::string_view kThink = "<think>", kThinkEnd = "</think>", kToolCall = "<tool_call>",
                           kToolCallEnd = "</tool_call>";
}  // namespace

OutputParser::OutputParser(OutputParserOptions options)
    : options_(std::move(options)),
      mode_(options_.reasoning && options_.starts_in_reasoning ? Mode::kReasoning : Mode::kContent) {}

OutputDelta OutputParser::push(std::string_view text) {
  buffer_ += text;
  OutputDelta out;
  consume(out, false);
  return out;
}

OutputDelta OutputParser::finish() {
  OutputDelta out;
  consume(out, true);
  return out;
}

void OutputParser::consume(OutputDelta& out, bool final) {
  while (!buffer_.empty()) {
    const bool progressed = mode_ == Mode::kToolCall ? consume_tool_call(out, final) : consume_text(out, final);
    if (!progressed) break;
  }
}

void OutputParser::emit_content(OutputDelta& out, std::string_view text) {
  if (skip_space_) {
    const size_t first = text.find_first_not_of(" \n\r\t");
    if (first == std::string_view::npos) return;
    text.remove_prefix(first);
    skip_space_ = false;
  }
  out.content += text;
}

bool OutputParser::consume_text(OutputDelta& out, bool final) {
  std::vector<std::string> markers;
  if (mode_ == Mode::kReasoning) {
    markers.emplace_back(kThinkEnd);
  } else {
    if (options_.reasoning) markers.emplace_back(kThink);
    if (options_.tools) markers.emplace_back(kToolCall);
  }
  size_t at = std::string::npos, length = 0;
  for (const std::string& marker : markers)
    if (size_t found = buffer_.find(marker); found < at) at = found, length = marker.size();
  const size_t keep = at != std::string::npos || final ? 0 : partial_marker_suffix(buffer_, markers);
  const size_t released = at != std::string::npos ? at : buffer_.size() - keep;
  const std::string_view text = std::string_view(buffer_).substr(0, released);
  if (mode_ == Mode::kReasoning)
    out.reasoning += text;
  else
    emit_content(out, text);
  if (at == std::string::npos) {
    buffer_.erase(0, released);
    return false;
  }
  const std::string_view marker = std::string_view(buffer_).substr(at, length);
  mode_ = marker == kThinkEnd ? Mode::kContent : marker == kThink ? Mode::kReasoning : Mode::kToolCall;
  skip_space_ = mode_ == Mode::kContent;
  buffer_.erase(0, at + length);
  return true;
}

bool OutputParser::consume_tool_call(OutputDelta& out, bool final) {
  const size_t end = buffer_.find(kToolCallEnd);
  if (end == std::string::npos && !final) return false;
  const std::string body = buffer_.substr(0, end);
  buffer_.erase(0, end == std::string::npos ? buffer_.size() : end + kToolCallEnd.size());
  mode_ = Mode::kContent;
  if (auto calls = parse_tool_call_block(body, options_.parameter_types)) {
    tool_calls_ += int(calls->size());
    for (ToolCall& call : *calls) out.tool_calls.push_back(std::move(call));
    skip_space_ = true;
  } else {
    // Not valid markup: the client sees what the model wrote.
    emit_content(out, std::string(kToolCall) + body + (end == std::string::npos ? "" : std::string(kToolCallEnd)));
  }
  return true;
}

}  // namespace vavilov::server
