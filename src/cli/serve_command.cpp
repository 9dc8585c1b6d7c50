// vavilov serve: the OpenAI-compatible HTTP server (docs/SERVER.md). SIGTERM and SIGINT stop it gracefully.
#include <fmt/core.h>
#include <pthread.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <thread>

#include "cli/commands.h"
#include "cli/common.h"
#include "core/error.h"
#include "engine/speculative.h"
#include "server/http_server.h"

namespace vavilov::cli {

namespace {

struct ServeArgs {
  server::ServerOptions options;
  int64_t cache_mb = 1024, max_body_kb = 4096;
  int timeout_s = 600, grace_s = 30;
  int threads = 0;
  std::string device = "cpu";
  int64_t expert_cache_mb = -1;
};

// Signals go to one thread that waits for them, so the stop runs as ordinary code, not in a signal handler.
void run_serve(ServeArgs& args) {
  apply_threads(args.threads);
  server::ServerOptions& options = args.options;
  if (options.model_dir.empty()) options.model_dir = default_model_dir();
  if (options.api_key.empty())
    if (const char* key = std::getenv("VAVILOV_API_KEY")) options.api_key = key;
  options.cache_bytes = size_t(args.cache_mb) << 20;
  options.max_body_bytes = size_t(args.max_body_kb) << 10;
  options.timeout = std::chrono::seconds(args.timeout_s);
  options.shutdown_grace = std::chrono::seconds(args.grace_s);
  options.select_device = [device = args.device, cache_mb = args.expert_cache_mb](Model& model) {
    const bool cuda = cuda_selected(device, model);
    check(cuda || cache_mb < 0, "--expert-cache-mb: the expert cache is for the GPU (--device cuda)");
    return cuda ? device_sequences(model, true, cache_mb) : SequenceFactory{};
  };

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // inherited by every thread started from here on
  server::Server server(options);
  std::thread waiter([&] {
    int signal = 0;
    sigwait(&signals, &signal);
    server.stop();
  });
  try {
    server.run();
  } catch (...) {
    pthread_kill(waiter.native_handle(), SIGTERM);
    waiter.join();
    throw;
  }
  pthread_kill(waiter.native_handle(), SIGTERM);  // wakes the waiter when run() ended for another reason
  waiter.join();
}

}  // namespace

void register_serve(CLI::App& app) {
  auto args = std::make_shared<ServeArgs>();
  server::ServerOptions& o = args->options;
  CLI::App* command = app.add_subcommand("serve", "OpenAI-compatible HTTP server (docs/SERVER.md)");
  command->add_option("--model", o.model_dir,
                      "Model directory or packed store, with tokenizer.json (default: the bundled model)");
  command->add_option("--model-name", o.model_name, "Model id clients send (default: the directory's name)");
  command->add_option("--host", o.host, "Address to listen on")->capture_default_str();
  command->add_option("--port", o.port, "Port (0: any free port)")->check(CLI::Range(0, 65535))->capture_default_str();
  command->add_option("--api-key", o.api_key, "Require 'Authorization: Bearer KEY' (also $VAVILOV_API_KEY)");
  command->add_option("--parallel", o.parallel, "Sequences decoded together")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  command->add_option("--queue", o.queue, "Requests waiting beyond --parallel before 429")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  command->add_option("--ctx", o.context, "Context length: prompt + completion tokens")
      ->check(CLI::Range(int64_t(2), int64_t(1) << 24))
      ->capture_default_str();
  command->add_option("--prefill-chunk", o.prefill_chunk, "Prefill chunk, also the prefix cache's granularity")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  command->add_option("--cache-mb", args->cache_mb, "Prefix cache budget in MiB (0: off)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 24))
      ->capture_default_str();
  command->add_option("--max-body-kb", args->max_body_kb, "Largest request body in KiB")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20))
      ->capture_default_str();
  command->add_option("--timeout", args->timeout_s, "Seconds a request may take")
      ->check(CLI::Range(1, 86400))
      ->capture_default_str();
  command->add_option("--shutdown-grace", args->grace_s, "Seconds in-flight requests get to finish on SIGTERM")
      ->check(CLI::Range(0, 3600))
      ->capture_default_str();
  add_experts_option(command, o.experts);
  command
      ->add_option("--device", args->device,
                   "cpu (default), cuda, or auto (the GPU when present); the prefix cache works on either")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  add_expert_cache_option(command, args->expert_cache_mb);
  command
      ->add_option(
          "--drafts", o.drafts,
          "MTP drafts per step, 0-3, adaptive (default with an MTP head: " + std::to_string(kDefaultDraftsGpu) +
              " on the GPU, " + std::to_string(kDefaultDraftsCpu) + " on the CPU; else 0)")
      ->check(CLI::Range(0, 3));
  add_threads_option(command, args->threads);
  command->callback([args] { run_serve(*args); });
}

}  // namespace vavilov::cli
