#include "server/client_connection.h"

#include <netdb.h>
#include <sys/socket.h>

#include <cerrno>
#include <charconv>
#include <filesystem>

namespace vavilov::server {

namespace {

struct Endpoint {
  std::string host;
  int port = -1;
  bool operator==(const Endpoint&) const = default;
};

// The numeric host and port of a socket address, formatted as httplib formats a request's addresses.
Endpoint endpoint_of(const sockaddr_storage& address, socklen_t length) {
  char host[NI_MAXHOST], port[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&address), length, host, sizeof host, port, sizeof port,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return {};
  Endpoint endpoint{host, -1};
  std::from_chars(port, port + std::char_traits<char>::length(port), endpoint.port);
  return endpoint;
}

bool socket_has_endpoints(int fd, const Endpoint& remote, const Endpoint& local) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0 || endpoint_of(address, length) != remote)
    return false;
  length = sizeof address;
  return getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0 && endpoint_of(address, length) == local;
}

}  // namespace

ClientConnection::ClientConnection(const std::string& remote_addr, int remote_port, const std::string& local_addr,
                                   int local_port) {
  const Endpoint remote{remote_addr, remote_port}, local{local_addr, local_port};
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", error)) {
    const std::string name = entry.path().filename().string();
    int fd = -1;
    if (std::from_chars(name.data(), name.data() + name.size(), fd).ec != std::errc{}) continue;
    if (socket_has_endpoints(fd, remote, local)) {
      fd_ = fd;
      return;
    }
  }
}

bool ClientConnection::closed() const {
  if (fd_ < 0) return false;
  char byte;
  const ssize_t got = recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (got > 0) return false;  // the client already sent more (a pipelined request): still there
  if (got == 0) return true;  // orderly close
  return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

}  // namespace vavilov::server
