// ClientConnection finds a server-side TCP socket by its endpoints and sees its peer close it.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/client_connection.h"

namespace vavilov::server {
namespace {

int port_of(int fd, bool peer) {
  sockaddr_in address{};
  socklen_t length = sizeof address;
  (peer ? getpeername : getsockname)(fd, reinterpret_cast<sockaddr*>(&address), &length);
  return ntohs(address.sin_port);
}

TEST(ClientConnection, SeesTheClientGoAway) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  address.sin_port = htons(uint16_t(port_of(listener, false)));
  const int client = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(connect(client, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  const int served = accept(listener, nullptr, nullptr);
  ASSERT_GE(served, 0);

  const ClientConnection connection("127.0.0.1", port_of(served, true), "127.0.0.1", port_of(served, false));
  ASSERT_TRUE(connection.found());
  EXPECT_FALSE(connection.closed());
  ASSERT_EQ(write(client, "x", 1), 1);  // data the server has not read yet does not look like a close
  EXPECT_FALSE(connection.closed());
  close(client);
  char drained;
  ASSERT_EQ(read(served, &drained, 1), 1);
  EXPECT_TRUE(connection.closed());

  const ClientConnection nobody("127.0.0.1", 1, "127.0.0.1", port_of(served, false));
  EXPECT_FALSE(nobody.found());
  EXPECT_FALSE(nobody.closed());
  close(served);
  close(listener);
}

}  // namespace
}  // namespace vavilov::server
