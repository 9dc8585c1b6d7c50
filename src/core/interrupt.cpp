#include "core/interrupt.h"

#include <csignal>

namespace vavilov {

namespace {
volatile std::sig_atomic_t requested = 0;

extern "C" void on_interrupt(int signal) {
  if (requested) {
    std::signal(signal, SIG_DFL);
    std::raise(signal);
  }
  requested = 1;
}
}  // namespace

void install_interrupt_handlers() {
  std::signal(SIGINT, on_interrupt);
  std::signal(SIGTERM, on_interrupt);
}

bool interrupt_requested() { return requested != 0; }

}  // namespace vavilov
