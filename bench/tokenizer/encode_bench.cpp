// Encode throughput of vavilov's tokenizer on the test corpus, single thread; prints one JSON object.
// Built and run by bench/tokenizer/run.sh.
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: encode_bench TOKENIZER_DIR CORPUS_BIN REPEATS\n";
    return 2;
  }
  std::ifstream in(argv[2], std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string data = buffer.str();
  std::vector<std::string> documents;
  for (size_t offset = 0; offset + 4 <= data.size();) {
    uint32_t length = 0;
    std::memcpy(&length, data.data() + offset, 4);
    documents.push_back(data.substr(offset + 4, length));
    offset += 4 + length;
  }
  const auto tokenizer = vavilov::tokenizer::Tokenizer::from_model_dir(argv[1]);
  size_t bytes = 0, ids = 0;
  for (const auto& document : documents) bytes += document.size();
  double best = 1e30;
  for (int repeat = 0; repeat < std::atoi(argv[3]); ++repeat) {
    const auto start = std::chrono::steady_clock::now();
    ids = 0;
    for (const auto& document : documents) ids += tokenizer.encode(document).size();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::cout << "{\"bytes\": " << bytes << ", \"ids\": " << ids << ", \"seconds\": " << best
            << ", \"mb_per_s\": " << bytes / best / 1e6 << "}\n";
}
