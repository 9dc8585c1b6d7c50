// Placeholder owned by the tokenizer work (issue 3): tokenize, detokenize, template.
#include "cli/commands.h"

namespace vavilov::cli {
void register_tokenizer_commands(CLI::App&) {}
}  // namespace vavilov::cli
