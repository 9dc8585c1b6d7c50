#include "server/http_server.h"

#include <fmt/core.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "engine/speculative.h"
#include "model/quantize.h"
#include "model/weights.h"
#include "server/api_error.h"
#include "server/client_connection.h"
#include "server/completion_service.h"
#include "server/metrics.h"
#include "server/prefix_cache.h"
#include "server/scheduler.h"
#include "server/sse.h"
#include <httplib.h>

namespace vavilov::server {
namespace {

using nlohmann::ordered_json;


void send_json(httplib::Response& res, int status, const ordered_json& body) {
  res.status = status;
  res.set_content(json_text(body), "application/json");
}

void send_error(httplib::Response& res, const ApiError& error) { send_json(res, error.status, error_body(error)); }

// Known paths label the request counter as they are; anything else counts as "other".
std::string endpoint_label(const std::string& path) {
  for (const char* known : {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"})
    if (path == known) return path;
  return "other";
}

}  // namespace

struct Server::Impl {
  explicit Impl(ServerOptions o) : options(std::move(o)) {}

  void routes();
  bool authorized(const httplib::Request& req) const;
  void generate(const httplib::Request& req, httplib::Response& res, bool chat);
  void load();

  ServerOptions options;
  httplib::Server http;
  std::atomic<bool> ready{false};
  std::unique_ptr<Model> model;
  std::unique_ptr<tokenizer::PromptTokenizer> prompts;
  std::unique_ptr<PrefixCache> cache;
  Metrics metrics;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<CompletionService> service;

  std::mutex mutex;
  std::condition_variable stopping;
  bool stop_requested = false;
};

bool Server::Impl::authorized(const httplib::Request& req) const {
  return options.api_key.empty() || req.path == "/health" ||
         req.get_header_value("Authorization") == "Bearer " + options.api_key;
}

void Server::Impl::generate(const httplib::Request& req, httplib::Response& res, bool chat) {
  if (!ready) throw ApiError(503, "the model is still loading", "", "", "server_error");
  std::shared_ptr<Session> session = service->begin(req.body, chat);
  if (!session->stream()) {
    const ClientConnection client(req.remote_addr, req.remote_port, req.local_addr, req.local_port);
    send_json(res, 200, session->wait([&client] { return client.closed(); }));
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [session](size_t, httplib::DataSink& sink) {
        bool done = false;
        const std::string events = session->next_events(done);
        if (!events.empty() && !sink.write(events.data(), events.size())) return false;
        if (done) sink.done();
        return done || sink.is_writable();
      },
      // Whatever ended the stream early (disconnect, write failure), the generation stops with it.
      [session](bool) { session->cancel(); });
}

void Server::Impl::routes() {
  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (authorized(req)) return httplib::Server::HandlerResponse::Unhandled;
    res.set_header("WWW-Authenticate", "Bearer");
    send_error(res, ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", "", "invalid_api_key",
                             "authentication_error"));
    return httplib::Server::HandlerResponse::Handled;
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    send_json(res, ready ? 200 : 503, {{"status", ready ? "ok" : "loading"}});
  });
  const auto models = [this](const httplib::Request&, httplib::Response& res) {
    const ordered_json model = {
        {"id", ready ? service->model_name() : ""}, {"object", "model"}, {"created", 0}, {"owned_by", "vavilov"}};
    send_json(res, 200, {{"object", "list"}, {"data", ready ? ordered_json::array({model}) : ordered_json::array()}});
  };
  http.Get("/v1/models", models);
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.render(cache ? cache->stats() : PrefixCache::Stats{}), "text/plain; version=0.0.4");
  });
  http.Post("/v1/chat/completions",
            [this](const httplib::Request& req, httplib::Response& res) { generate(req, res, true); });
  http.Post("/v1/completions",
            [this](const httplib::Request& req, httplib::Response& res) { generate(req, res, false); });
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr error) {
    try {
      std::rethrow_exception(error);
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const std::exception& e) {
      send_error(res, ApiError(500, e.what(), "", "", "server_error"));
    }
  });
  // Errors httplib produces itself (unknown path, wrong method, body too large) get OpenAI-style bodies too.
  http.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req,
                                                                 httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    const std::string message = res.status == 413   ? "the request body is too large"
                                : res.status == 404 ? "no such endpoint: " + req.method + " " + req.path
                                                    : "HTTP error " + std::to_string(res.status);
    send_error(res, ApiError(res.status, message));
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    metrics.count_request(endpoint_label(req.path), res.status);
  });
}

void Server::Impl::load() {
  model = load_model(options.model_dir, options.experts);
  if (options.experts != 0) quantize_experts(*model, options.experts);
  SchedulerOptions scheduling;
  if (options.select_device) scheduling.device = options.select_device(*model);
  const bool gpu = bool(scheduling.device);
  // The prefix cache keeps states in the CPU engine's layout; GPU sequences export theirs at prompt chunk boundaries
  // and import a cached one to start from (SequenceBackend::export_state / import_state).
  cache = std::make_unique<PrefixCache>(options.cache_bytes);
  scheduling.parallel = options.parallel;
  scheduling.queue = options.queue;
  scheduling.speculative.drafts = options.drafts >= 0 ? options.drafts : default_drafts(*model, gpu);
  scheduling.speculative.adaptive = true;
  prompts = std::make_unique<tokenizer::PromptTokenizer>(options.model_dir);
  scheduler = std::make_unique<Scheduler>(*model, prompts->tokenizer(), scheduling, *cache, metrics);
  std::string name = options.model_name;
  if (name.empty()) name = std::filesystem::path(options.model_dir).lexically_normal().filename().string();
  if (name.empty()) name = std::filesystem::path(options.model_dir).lexically_normal().parent_path().filename();
  ServiceLimits limits{options.context, options.prefill_chunk, options.timeout};
  service = std::make_unique<CompletionService>(*model, options.model_dir, *prompts, name, limits, *scheduler);
}

Server::Server(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Server::~Server() = default;

void Server::run() {
  Impl& s = *impl_;
  const size_t threads = size_t(s.options.parallel + s.options.queue + 8);
  s.http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  s.http.set_payload_max_length(s.options.max_body_bytes);
  s.http.set_read_timeout(std::chrono::seconds(30));
  s.routes();
  int port = s.options.port;
  if (port == 0)
    port = s.http.bind_to_any_port(s.options.host);
  else if (!s.http.bind_to_port(s.options.host, port))
    port = -1;
  check(port > 0, "cannot listen on {}:{}", s.options.host, s.options.port);
  fmt::print(stderr, "vavilov serve: listening on http://{}:{}\n", s.options.host, port);
  std::thread listener([&s] { s.http.listen_after_bind(); });
  // stop() is a no-op before the listener runs.
  while (!s.http.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  try {
    s.load();
  } catch (...) {
    s.http.stop();
    listener.join();
    throw;
  }
  s.ready = true;
  fmt::print(stderr, "vavilov serve: model '{}' ready\n", s.service->model_name());
  {
    std::unique_lock lock(s.mutex);
    s.stopping.wait(lock, [&] { return s.stop_requested; });
  }
  s.scheduler->shutdown(s.options.shutdown_grace);
  s.http.stop();
  listener.join();
}

void Server::stop() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stop_requested = true;
  }
  impl_->stopping.notify_all();
}

}  // namespace vavilov::server
