#include "server/scheduler.h"

#include <exception>

#include "server/stop_matcher.h"
#include "tokenizer/stream_decoder.h"

namespace vavilov::server {

struct Scheduler::Active {
  std::shared_ptr<Job> job;
  std::unique_ptr<Decoder> decoder;
  tokenizer::StreamDecoder text;
  StopMatcher stop;
  int64_t generated = 0;
  bool prefilling = true;
};

Scheduler::Scheduler(const Model& model, const tokenizer::Tokenizer& tokenizer, SchedulerOptions options,
                     PrefixCache& cache, Metrics& metrics)
    : model_(model),
      tokenizer_(tokenizer),
      options_(std::move(options)),
      cache_(cache),
      metrics_(metrics),
      thread_([this] { loop(); }) {}

Scheduler::~Scheduler() { shutdown(std::chrono::milliseconds(0)); }

Scheduler::Admission Scheduler::submit(std::shared_ptr<Job> job) {
  {
    std::lock_guard lock(mutex_);
    if (closed_) return Admission::kClosed;
    // Jobs beyond the free decoding slots wait; the queue bounds how many.
    const size_t free_slots = active_count_ < size_t(options_.parallel) ? options_.parallel - active_count_ : 0;
    if (queue_.size() >= free_slots + size_t(options_.queue)) return Admission::kQueueFull;
    queue_.push_back(std::move(job));
  }
  wake_.notify_all();
  return Admission::kQueued;
}

void Scheduler::shutdown(std::chrono::milliseconds grace) {
  std::deque<std::shared_ptr<Job>> refused;
  {
    std::unique_lock lock(mutex_);
    closed_ = true;
    refused.swap(queue_);
    wake_.notify_all();
    wake_.wait_for(lock, grace, [&] { return active_count_ == 0; });
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& job : refused) job->fail(503, "the server is shutting down");
  if (thread_.joinable()) thread_.join();
}

void Scheduler::loop() {
  for (;;) {
    std::vector<std::shared_ptr<Job>> admitted;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || !active_.empty() || !queue_.empty(); });
      if (stop_) break;
      while (!queue_.empty() && active_.size() + admitted.size() < size_t(options_.parallel)) {
        admitted.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    for (auto& job : admitted) start(std::move(job));
    prefill();
    step();
  }
  for (auto& active : active_) active->job->fail(503, "the server shut down before this request finished");
  active_.clear();
}

void Scheduler::start(std::shared_ptr<Job> job) {
  if (job->cancelled()) return;
  const JobInput& input = job->input();
  auto active = std::make_unique<Active>(
      Active{job, nullptr, tokenizer::StreamDecoder(tokenizer_, true), StopMatcher(input.stop), 0, true});
  try {
    active->decoder = std::make_unique<Decoder>(model_, input.options, options_.speculative, options_.device);
    const auto entry = cache_.lookup(input.prompt);
    const int64_t cached = entry ? int64_t(entry->tokens.size()) : 0;
    job->set_cached_tokens(cached);
    metrics_.add_prompt(int64_t(input.prompt.size()), cached);
    active->decoder->begin(input.prompt, entry ? &entry->state : nullptr);
    active_.push_back(std::move(active));
  } catch (const std::exception& e) {
    job->fail(500, e.what());
  }
  publish_load();
}

// One prompt chunk for every sequence still prefilling; complete chunks go to the prefix cache.
void Scheduler::prefill() {
  for (auto& active : active_) {
    if (!active->prefilling || !active->decoder) continue;
    const std::vector<int32_t>& prompt = active->job->input().prompt;
    try {
      // A device exports its state for each call (device→host copies): none when the cache keeps nothing.
      std::function<void(const SequenceState&)> to_cache;
      if (cache_.stats().budget > 0)
        to_cache = [&](const SequenceState& state) {
          cache_.insert(std::span(prompt).first(size_t(state.position)), state);
        };
      const int32_t first = active->decoder->prefill_next(to_cache);
      if (first < 0) continue;
      active->prefilling = false;
      if (!emit(*active, {first})) retire(*active);
    } catch (const std::exception& e) {
      active->job->fail(500, e.what());
      retire(*active);
    }
  }
  std::erase_if(active_, [](const std::unique_ptr<Active>& active) { return !active->decoder; });
}

void Scheduler::step() {
  // Jobs whose client left or whose time ran out leave before the step.
  const auto now = std::chrono::steady_clock::now();
  std::erase_if(active_, [&](const std::unique_ptr<Active>& active) {
    if (!active->job->cancelled() && now < active->job->input().deadline) return false;
    active->job->fail(active->job->cancelled() ? 499 : 504,
                      active->job->cancelled() ? "cancelled" : "the request exceeded the server's time limit");
    retire(*active);
    return true;
  });
  std::vector<Active*> decoding;
  std::vector<Decoder*> decoders;
  for (auto& active : active_)
    if (!active->prefilling) {
      decoding.push_back(active.get());
      decoders.push_back(active->decoder.get());
    }
  if (!decoders.empty()) {
    try {
      const auto emitted = step_batch(model_, decoders);
      for (size_t i = 0; i < decoding.size(); ++i)
        if (!emit(*decoding[i], emitted[i])) retire(*decoding[i]);
    } catch (const std::exception& e) {
      for (Active* active : decoding) {
        active->job->fail(500, e.what());
        retire(*active);
      }
    }
    std::erase_if(active_, [](const std::unique_ptr<Active>& active) { return !active->decoder; });
  }
  publish_load();
}

bool Scheduler::emit(Active& active, const std::vector<int32_t>& tokens) {
  Job& job = *active.job;
  int64_t counted = 0;
  std::string text, reason;
  for (int32_t token : tokens) {
    ++active.generated;
    ++counted;
    if (active.decoder->is_stop(token)) {
      reason = "stop";
      break;
    }
    text += active.stop.push(active.text.push(uint32_t(token)));
    if (active.stop.stopped()) {
      reason = "stop";
      break;
    }
    if (active.generated >= job.input().max_tokens) {
      reason = "length";
      break;
    }
  }
  if (!reason.empty() && !active.stop.stopped()) {
    // The end of the sequence decides what was held back: an unfinished character or a partial stop string.
    text += active.stop.push(active.text.finish());
    text += active.stop.finish();
    if (active.stop.stopped()) reason = "stop";
  }
  metrics_.add_generated(counted);
  job.append(text, counted);
  if (!reason.empty()) job.finish(reason);
  return reason.empty();
}

// A finished job's decoder goes; its speculative statistics go to the metrics.
void Scheduler::retire(Active& active) {
  if (!active.decoder) return;
  metrics_.add_speculative(active.decoder->stats());
  active.decoder.reset();
}

void Scheduler::publish_load() {
  std::lock_guard lock(mutex_);
  active_count_ = active_.size();
  metrics_.set_load(int64_t(queue_.size()), int64_t(active_count_));
  wake_.notify_all();
}

}  // namespace vavilov::server
