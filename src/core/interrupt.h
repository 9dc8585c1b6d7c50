#pragma once
// Ctrl-C and SIGTERM for long jobs that must clean up: the first signal only sets a flag the job polls (it then
// throws and its destructors remove partial output); a second signal ends the process at once.
namespace vavilov {

void install_interrupt_handlers();
bool interrupt_requested();

}  // namespace vavilov
