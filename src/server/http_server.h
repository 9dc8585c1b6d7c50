#pragma once
// The OpenAI-compatible HTTP server: routes, API-key check, limits, and the lifecycle (listen at once, /health 503
// while the model loads, graceful stop).
#include <chrono>
#include <functional>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/backend.h"

namespace vavilov::server {

struct ServerOptions {
  std::string model_dir;
  std::string model_name;  // empty: the directory's name
  std::string host = "127.0.0.1";
  int port = 8080;      // 0: any free port (printed on stderr)
  std::string api_key;  // non-empty: every endpoint but /health needs "Authorization: Bearer <key>"
  int parallel = 4;
  int queue = 64;
  int64_t context = 4096;
  int64_t prefill_chunk = 64;
  size_t cache_bytes = size_t(1) << 30;
  size_t max_body_bytes = size_t(4) << 20;
  std::chrono::seconds timeout{600};
  std::chrono::seconds shutdown_grace{30};
  int drafts = -1;  // -1: the device's default (default_drafts) when the checkpoint has an MTP head, else 0
  int experts = 0;  // routed experts re-quantized at load to 4, 3 or 2 bits; 0: as loaded
  // Chooses the device once the model is loaded: a factory of GPU sequences, or an empty one for the CPU engine.
  std::function<SequenceFactory(Model&)> select_device;
};

class Server {
 public:
  explicit Server(ServerOptions options);
  ~Server();

  // Listens, loads the model, serves until stop(); throws vavilov::Error when it cannot bind or load.
  void run();
  // Graceful stop from any thread: no new requests, in-flight ones finish within the grace period or are cancelled.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vavilov::server
