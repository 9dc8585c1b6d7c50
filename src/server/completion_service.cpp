#include "server/completion_service.h"

#include <fmt/format.h>

#include "core/error.h"
#include "server/api_error.h"
#include "server/sse.h"

namespace vavilov::server {
namespace {

using nlohmann::ordered_json;
constexpr std::chrono::milliseconds kPoll{100};

void merge(OutputDelta& into, OutputDelta&& more) {
  into.reasoning += more.reasoning;
  into.content += more.content;
  for (ToolCall& call : more.tool_calls) into.tool_calls.push_back(std::move(call));
}

// The generation prompt of thinking templates may open <think> itself; the reply then starts inside it.
bool opens_think(std::string_view rendered) {
  while (!rendered.empty() && (rendered.back() == '\n' || rendered.back() == ' ')) rendered.remove_suffix(1);
  return rendered.ends_with("<think>");
}

}  // namespace

Session::Session(std::shared_ptr<Job> job, const CompletionRequest& request, ResponseHeader header,
                 OutputParserOptions parser, int64_t prompt_tokens)
    : job_(std::move(job)),
      chat_(request.chat),
      stream_(request.stream),
      include_usage_(request.include_usage),
      header_(std::move(header)),
      parser_(std::move(parser)),
      prompt_tokens_(prompt_tokens) {}

Session::~Session() { job_->cancel(); }

Usage Session::usage(const JobOutput& output) const {
  return {prompt_tokens_, output.completion_tokens, output.cached_tokens};
}

std::string Session::finish_reason(const JobOutput& output) const {
  // Parsed calls are complete whatever ended the generation; the client's next step is to run them.
  return parser_.saw_tool_calls() ? "tool_calls" : output.finish_reason;
}

ordered_json Session::wait(const std::function<bool()>& client_gone) {
  OutputDelta all;
  for (;;) {
    JobOutput output = job_->take(kPoll);
    if (chat_)
      merge(all, parser_.push(output.text));
    else
      all.content += output.text;
    if (output.done) {
      if (output.error_status) throw ApiError(output.error_status, output.error, "", "", "server_error");
      if (chat_) {
        merge(all, parser_.finish());
        return chat_completion(header_, all, finish_reason(output), usage(output));
      }
      return text_completion(header_, all.content, output.finish_reason, usage(output));
    }
    if (client_gone()) {
      job_->cancel();
      throw ApiError(499, "the client closed the connection");
    }
  }
}

std::string Session::delta_events(const OutputDelta& delta) {
  std::string events;
  if (!chat_) {
    if (!delta.content.empty()) events += sse_event(text_chunk(header_, delta.content, ""));
    return events;
  }
  ordered_json message = ordered_json::object();
  if (!delta.reasoning.empty()) message["reasoning_content"] = delta.reasoning;
  if (!delta.content.empty()) message["content"] = delta.content;
  if (!message.empty()) events += sse_event(chat_chunk(header_, message, ""));
  if (!delta.tool_calls.empty()) {
    events += sse_event(chat_chunk(header_, {{"tool_calls", tool_calls_json(delta.tool_calls, tool_calls_sent_)}}, ""));
    tool_calls_sent_ += delta.tool_calls.size();
  }
  return events;
}

std::string Session::final_events(const JobOutput& output) {
  if (output.error_status) {
    ApiError error(output.error_status, output.error, "", "", "server_error");
    return sse_event(error_body(error)) + kSseDone;
  }
  std::string events = chat_ ? delta_events(parser_.finish()) : "";
  events += sse_event(chat_ ? chat_chunk(header_, ordered_json::object(), finish_reason(output))
                            : text_chunk(header_, "", output.finish_reason));
  if (include_usage_) events += sse_event(usage_chunk(header_, chat_, usage(output)));
  return events + kSseDone;
}

std::string Session::next_events(bool& done) {
  std::string events;
  if (chat_ && !sent_role_) {
    events += sse_event(chat_chunk(header_, {{"role", "assistant"}, {"content", ""}}, ""));
    sent_role_ = true;
  }
  JobOutput output = job_->take(kPoll);
  events += chat_ ? delta_events(parser_.push(output.text)) : delta_events(OutputDelta{"", output.text, {}});
  done = output.done;
  if (done) events += final_events(output);
  return events;
}

CompletionService::CompletionService(const Model& model, const std::filesystem::path& model_dir,
                                     const tokenizer::PromptTokenizer& prompts, std::string model_name,
                                     ServiceLimits limits, Scheduler& scheduler)
    : model_(model),
      prompts_(prompts),
      limits_{std::move(model_name), model.config.vocab_size},
      service_(limits),
      scheduler_(scheduler) {
  try {
    template_ = tokenizer::ChatTemplate::from_model_dir(model_dir);
  } catch (const Error& e) {
    template_error_ = e.what();  // only chat requests need it
  }
  if (auto eos = prompts_.eos_token_id()) stop_ids_.push_back(*eos);
  // A ChatML reply ends with <|im_end|> whatever the configured EOS says.
  for (const char* token : {"<|im_end|>", "<|endoftext|>"})
    if (auto id = prompts_.tokenizer().token_to_id(token)) stop_ids_.push_back(*id);
}

std::vector<int32_t> CompletionService::prompt_ids(const CompletionRequest& request, std::string& rendered) const {
  if (!request.prompt_ids.empty()) return request.prompt_ids;
  if (request.chat) {
    if (!template_) throw ApiError(400, "this model has no usable chat template (" + template_error_ + ")");
    try {
      rendered = template_->render(request.messages, request.tools, {true, request.enable_thinking});
    } catch (const Error& e) {
      throw ApiError(400, std::string("the chat template failed on these messages: ") + e.what(), "messages");
    }
  } else {
    rendered = request.prompt;
  }
  std::vector<int32_t> ids;
  for (uint32_t id : prompts_.tokenizer().encode(rendered)) {
    if (int64_t(id) >= model_.config.vocab_size)
      throw ApiError(400, fmt::format("the prompt encodes to token {}, outside the model's vocabulary", id));
    ids.push_back(int32_t(id));
  }
  if (ids.empty()) throw ApiError(400, "the prompt encodes to no tokens", request.chat ? "messages" : "prompt");
  return ids;
}

JobInput CompletionService::job_input(const CompletionRequest& request, std::vector<int32_t> prompt) const {
  const int64_t prompt_tokens = int64_t(prompt.size());
  const int64_t room = service_.context - prompt_tokens;
  const int64_t wanted = request.max_tokens.value_or(std::max<int64_t>(room, 0));
  if (room < 1 || wanted > room)
    throw ApiError(400,
                   fmt::format("this model's maximum context length is {} tokens; the request needs {} ({} in the "
                               "prompt, {} for the completion)",
                               service_.context, prompt_tokens + std::max<int64_t>(wanted, 1), prompt_tokens,
                               std::max<int64_t>(wanted, 1)),
                   request.chat ? "messages" : "prompt", "context_length_exceeded");
  JobInput input;
  input.prompt = std::move(prompt);
  input.options.prefill_chunk = service_.prefill_chunk;
  input.options.stop_ids = stop_ids_;
  input.options.sampling = request.sampling;
  input.max_tokens = wanted;
  input.stop = request.stop;
  input.deadline = std::chrono::steady_clock::now() + service_.timeout;
  return input;
}

std::unique_ptr<Session> CompletionService::begin(std::string_view body, bool chat) {
  CompletionRequest request = parse_request(body, chat, limits_);
  try {
    validate(request.sampling, model_.config.vocab_size);
  } catch (const Error& e) {
    throw ApiError(400, e.what());
  }
  std::string rendered;
  std::vector<int32_t> prompt = prompt_ids(request, rendered);
  const int64_t prompt_tokens = int64_t(prompt.size());
  auto job = std::make_shared<Job>(job_input(request, std::move(prompt)));
  switch (scheduler_.submit(job)) {
    case Scheduler::Admission::kQueueFull:
      throw ApiError(429, "too many requests are waiting; retry later", "", "queue_full", "rate_limit_error");
    case Scheduler::Admission::kClosed:
      throw ApiError(503, "the server is shutting down", "", "", "server_error");
    case Scheduler::Admission::kQueued:
      break;
  }
  OutputParserOptions parser;
  parser.reasoning = chat && request.enable_thinking.value_or(true);
  parser.starts_in_reasoning = parser.reasoning && opens_think(rendered);
  parser.tools = request.parse_tools;
  parser.parameter_types = request.parameter_types;
  return std::make_unique<Session>(std::move(job), request, new_header(chat, limits_.model_name), std::move(parser),
                                   prompt_tokens);
}

}  // namespace vavilov::server
