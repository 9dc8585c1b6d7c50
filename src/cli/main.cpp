// vavilov: one binary, one subcommand per job. Errors are one line on stderr and a non-zero exit.
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <exception>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"vavilov: a C++/CUDA inference engine for qwen4_exp (Qwen3.8-Flash-Next)"};
  app.set_version_flag("--version", VAVILOV_VERSION);
  app.require_subcommand(1);
  vavilov::cli::register_logits(app);
  vavilov::cli::register_generate(app);
  vavilov::cli::register_tokenizer_commands(app);
  vavilov::cli::register_serve(app);
  vavilov::cli::register_pack(app);
  vavilov::cli::register_bench(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const vavilov::Error& e) {
    fmt::print(stderr, "vavilov: error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "vavilov: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
