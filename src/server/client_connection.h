#pragma once
// Whether the client of a request that is still being computed has gone away. Debian 12's cpp-httplib (0.11) gives
// a handler no way to see this while a non-streamed response is pending. The connection's socket is still open in
// this process (the handler's thread holds it until the handler returns), so it can be found by its two endpoints
// and polled without blocking.
#include <string>

namespace vavilov::server {

class ClientConnection {
 public:
  ClientConnection(const std::string& remote_addr, int remote_port, const std::string& local_addr, int local_port);
  // The peer closed or reset the connection. False while it is open, and always when its socket was not found.
  bool closed() const;
  bool found() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

}  // namespace vavilov::server
