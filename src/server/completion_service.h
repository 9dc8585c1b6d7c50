#pragma once
// The generation endpoints without HTTP: a request body becomes a prompt (chat template, tokenizer), a job on the
// scheduler, and then either one response body or a sequence of SSE events.
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "server/job.h"
#include "server/output_parser.h"
#include "server/request.h"
#include "server/responses.h"
#include "server/scheduler.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/prompt.h"

namespace vavilov::server {

struct ServiceLimits {
  int64_t context = 4096;      // prompt + completion tokens
  int64_t prefill_chunk = 64;  // also the prefix cache's granularity
  std::chrono::seconds timeout{600};
};

// One response in progress.
class Session {
 public:
  Session(std::shared_ptr<Job> job, const CompletionRequest& request, ResponseHeader header, OutputParserOptions parser,
          int64_t prompt_tokens);
  ~Session();

  bool stream() const { return stream_; }
  // Non-streaming: waits for the end (polling `client_gone`) and returns the body; throws ApiError on failure.
  nlohmann::ordered_json wait(const std::function<bool()>& client_gone);
  // Streaming: the SSE text that is ready (waits up to 100 ms for some); `done` turns true with the last events.
  std::string next_events(bool& done);
  void cancel() { job_->cancel(); }

 private:
  std::string delta_events(const OutputDelta& delta);
  std::string final_events(const JobOutput& output);
  Usage usage(const JobOutput& output) const;
  std::string finish_reason(const JobOutput& output) const;

  std::shared_ptr<Job> job_;
  bool chat_, stream_, include_usage_;
  ResponseHeader header_;
  OutputParser parser_;
  int64_t prompt_tokens_;
  bool sent_role_ = false;
  size_t tool_calls_sent_ = 0;
};

class CompletionService {
 public:
  // `prompts` (the model's tokenizer) and `scheduler` must outlive the service.
  CompletionService(const Model& model, const std::filesystem::path& model_dir,
                    const tokenizer::PromptTokenizer& prompts, std::string model_name, ServiceLimits limits,
                    Scheduler& scheduler);

  // Throws ApiError: 400/404 for bad requests, 429 when the queue is full, 503 when shutting down.
  std::unique_ptr<Session> begin(std::string_view body, bool chat);
  const std::string& model_name() const { return limits_.model_name; }

 private:
  std::vector<int32_t> prompt_ids(const CompletionRequest& request, std::string& rendered) const;
  JobInput job_input(const CompletionRequest& request, std::vector<int32_t> prompt) const;

  const Model& model_;
  const tokenizer::PromptTokenizer& prompts_;
  std::optional<tokenizer::ChatTemplate> template_;
  std::string template_error_;
  RequestLimits limits_;
  ServiceLimits service_;
  std::vector<int64_t> stop_ids_;
  Scheduler& scheduler_;
};

}  // namespace vavilov::server
