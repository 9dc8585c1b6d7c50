// The packed store (src/io/packed_store.*, src/model/pack.*, src/model/packed_model.*): a store packed from a
// checkpoint computes exactly what the checkpoint computes; damaged stores, bad manifests, a full disk and an
// interrupted pack fail with errors that name the file and field, and leave nothing behind.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "core/interrupt.h"
#include "core/progress.h"
#include "cpu/forward.h"
#include "cpu/mtp.h"
#include "engine/state.h"
#include "error_of.h"
#include "fixture_paths.h"
#include "io/disk_space.h"
#include "io/packed_store.h"
#include "model/pack.h"
#include "model/packed_model.h"
#include "model/quantize.h"

namespace vavilov {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::error_of;

// A scratch directory removed with everything in it at the end of the test.
struct ScratchDir {
  fs::path path;
  explicit ScratchDir(const std::string& name = ::testing::UnitTest::GetInstance()->current_test_info()->name()) {
    path = fs::temp_directory_path() / ("vavilov-pack-test-" + std::to_string(::getpid()) + "-" + name);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ScratchDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

PackOptions quiet(std::vector<int> bits) {
  PackOptions options;
  options.expert_bits = std::move(bits);
  options.progress = ProgressMode::Quiet;
  options.free_space = [](const std::string&) { return uint64_t(1) << 50; };
  options.interrupted = [] { return false; };
  return options;
}

fs::path bundled_model() { return test::source_dir() / "models" / "flash-next-mini"; }

std::vector<int32_t> prompt_of(const fs::path& fixture) {
  std::ifstream in(fixture / "reference.json");
  return json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
}

std::vector<float> trunk_logits(const Model& model, const std::vector<int32_t>& ids) {
  SequenceState state = new_sequence_state(model);
  std::vector<float> logits(ids.size() * size_t(model.config.vocab_size));
  cpu::forward(model, state, ids, {true, logits.data(), nullptr});
  return logits;
}

std::vector<float> mtp_logits(const Model& model, const std::vector<int32_t>& ids) {
  const size_t sh = size_t(model.config.hc_hidden()), n = ids.size();
  SequenceState state = new_sequence_state(model);
  std::vector<float> stacks(n * sh), head((n - 1) * sh), logits((n - 1) * size_t(model.config.vocab_size));
  cpu::forward(model, state, ids, {false, nullptr, stacks.data()});
  cpu::mtp_forward(model, state, stacks.data(), std::span<const int32_t>(ids).subspan(1), head.data());
  cpu::mtp_logits(model, head.data(), int64_t(n - 1), logits.data());
  return logits;
}

// Bit-identical: the same weights through the same code, so not one bit may differ.
void expect_identical(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << what;
}

void expect_same_model_outputs(const Model& store, const Model& checkpoint, const std::vector<int32_t>& ids,
                               const std::string& what) {
  expect_identical(trunk_logits(store, ids), trunk_logits(checkpoint, ids), what + ": trunk logits");
  ASSERT_EQ(store.mtp.has_value(), checkpoint.mtp.has_value()) << what;
  if (checkpoint.mtp) expect_identical(mtp_logits(store, ids), mtp_logits(checkpoint, ids), what + ": MTP logits");
}

// The checkpoint's routed experts (MTP layer included) quantized as pack quantizes them: the reference the
// store's q4/q3/q2 experts must equal.
void quantize_routed_experts(Model& model, int bits) {
  auto quantize = [&](Matrix& m) {
    std::vector<float> dense(size_t(m.rows * m.cols));
    for (int64_t r = 0; r < m.rows; ++r) to_f32(m.dtype, m.row(r), dense.data() + r * m.cols, size_t(m.cols));
    QuantizedRows q = quantize_rows(dense.data(), m.rows, m.cols, bits);
    auto keep = [&](const auto& values) {
      const auto* bytes = reinterpret_cast<const std::byte*>(values.data());
      model.owned.emplace_back(bytes, bytes + values.size() * sizeof(values[0]));
      return model.owned.back().data();
    };
    m.data = keep(q.codes);
    m.scales = reinterpret_cast<const uint16_t*>(keep(q.scales));
    m.biases = reinterpret_cast<const uint16_t*>(keep(q.biases));
    m.dtype = DType::BF16;
    m.bits = bits;
  };
  auto layer = [&](LayerWeights& l) {
    for (auto& e : l.moe.experts)
      for (Matrix* m : {&e.gate, &e.up, &e.down}) quantize(*m);
  };
  for (auto& l : model.layers) layer(l);
  if (model.mtp) layer(model.mtp->layer);
}

// Every committed fixture (plain, PLE, fused experts, sharded, VL naming, MTP heads) packed with dense experts.
TEST(PackedStore, DenseStoreOfEveryFixtureGivesIdenticalLogits) {
  for (const auto& fixture : test::model_fixture_dirs()) {
    ScratchDir scratch;
    std::string store = scratch / "store";
    pack_model(fixture.string(), store, quiet({0}));
    EXPECT_TRUE(is_packed_store(store));
    auto from_store = load_model(store);
    auto from_checkpoint = load_model(fixture.string());
    ASSERT_TRUE(from_store->packed) << fixture;
    expect_same_model_outputs(*from_store, *from_checkpoint, prompt_of(fixture), fixture.filename().string());
  }
}

TEST(PackedStore, QuantizedExpertsEqualTheCheckpointWithTheSameQuantization) {
  ScratchDir scratch;
  std::string store = scratch / "store";
  pack_model(bundled_model().string(), store, quiet({4, 3, 2}));
  const std::vector<int32_t> ids = {1, 17, 300, 4000, 25, 8191};
  for (int bits : {4, 3, 2}) {
    auto from_store = load_packed_model(store, ExpertPrecision{{bits}, {}});
    EXPECT_EQ(from_store->layers[0].moe.experts[3].down.bits, bits);
    ASSERT_TRUE(from_store->mtp);
    EXPECT_EQ(from_store->mtp->layer.moe.experts[0].gate.bits, bits);
    auto reference = load_checkpoint(bundled_model().string());
    quantize_routed_experts(*reference, bits);
    expect_same_model_outputs(*from_store, *reference, ids, fmt::format("q{}", bits));
  }
}

// --experts N on a store maps its qN records (nothing is re-quantized); a precision the store lacks comes from the
// most precise records it has, re-quantized as for a checkpoint.
TEST(PackedStore, ExpertBitsPickTheStoresRecords) {
  ScratchDir scratch;
  std::string store = scratch / "store";
  pack_model(bundled_model().string(), store, quiet({4, 3}));
  auto q3 = load_model(store, 3);
  EXPECT_EQ(q3->layers[2].moe.experts[5].up.bits, 3);
  EXPECT_EQ(q3->mtp->layer.moe.experts[1].down.bits, 3);
  EXPECT_EQ(quantize_experts(*q3, 3), 0);
  auto q2 = load_model(store, 2);
  EXPECT_EQ(q2->layers[2].moe.experts[5].up.bits, 4);  // the most precise the store has
  EXPECT_GT(quantize_experts(*q2, 2), 0);
  EXPECT_EQ(q2->layers[2].moe.experts[5].up.bits, 2);
}

TEST(PackedStore, LoadsTheMostPreciseExpertsByDefaultAndMixedPrecisionPerExpert) {
  ScratchDir scratch;
  std::string store = scratch / "store";
  pack_model(bundled_model().string(), store, quiet({2, 4}));
  auto by_default = load_model(store);
  EXPECT_EQ(by_default->layers[5].moe.experts[7].up.bits, 4);
  ExpertPrecision mixed{{2}, {{{0, 1}, 4}, {{8, 15}, 4}}};  // layer 8 is the MTP layer of this 8-layer model
  auto model = load_packed_model(store, mixed);
  EXPECT_EQ(model->layers[0].moe.experts[1].gate.bits, 4);
  EXPECT_EQ(model->layers[0].moe.experts[2].gate.bits, 2);
  EXPECT_EQ(model->mtp->layer.moe.experts[15].down.bits, 4);
  EXPECT_EQ(model->mtp->layer.moe.experts[14].down.bits, 2);
  std::string missing = error_of([&] { load_packed_model(store, ExpertPrecision{{3}, {}}); });
  EXPECT_NE(missing.find("layer 0 expert 0: no record in precision q3"), std::string::npos) << missing;
}

// A store packs again (e.g. to add a precision): Q4 records are copied bit for bit, Q2 derived from them.
TEST(PackedStore, RepackingAStoreKeepsItsRecordsExactly) {
  ScratchDir scratch;
  std::string first = scratch / "first", second = scratch / "second";
  pack_model(bundled_model().string(), first, quiet({4}));
  pack_model(first, second, quiet({4, 2}));
  PackedStore a(first), b(second);
  const ExpertFile &q4_a = a.manifest().experts[0], &q4_b = b.manifest().experts[0];
  ASSERT_EQ(q4_a.records.size(), q4_b.records.size());
  for (size_t i = 0; i < q4_a.records.size(); ++i) EXPECT_EQ(q4_a.records[i].checksum, q4_b.records[i].checksum);
  EXPECT_EQ(a.manifest().tensors.size(), b.manifest().tensors.size());
  EXPECT_EQ(b.manifest().experts[1].bits, 2);
  const std::vector<int32_t> ids = {3, 99, 2048};
  expect_same_model_outputs(*load_model(second), *load_model(first), ids, "repacked q4");
  EXPECT_TRUE(fs::exists(fs::path(second) / "tokenizer.json"));
}

TEST(PackedStore, LayoutIsAlignedAndVerifies) {
  ScratchDir scratch;
  std::string store = scratch / "store";
  pack_model(bundled_model().string(), store, quiet({4, 3}));
  PackedStore opened(store);
  const Manifest& m = opened.manifest();
  EXPECT_EQ(m.version, kStoreVersion);
  EXPECT_EQ(m.config["hidden_size"], 320);
  for (const auto& t : m.tensors) {
    EXPECT_EQ(t.offset % m.alignment, 0u) << t.name;
    EXPECT_EQ(t.file == "ngram.bin", t.name.find("ngram_embedding") != std::string::npos) << t.name;
    EXPECT_EQ(t.name.find(".mlp.experts."), std::string::npos) << t.name << " belongs in expert records";
  }
  ASSERT_EQ(m.experts.size(), 2u);
  for (const auto& e : m.experts) {
    EXPECT_EQ(e.records.size(), size_t(9 * 16)) << "8 trunk layers and the MTP layer, 16 experts each";
    EXPECT_EQ(e.record_bytes % m.alignment, 0u);
  }
  for (const char* copied : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"})
    EXPECT_TRUE(fs::exists(fs::path(store) / copied)) << copied;
  EXPECT_FALSE(fs::exists(fs::path(store) / "model.safetensors"));
  EXPECT_TRUE(verify_store(store, ProgressMode::Quiet).empty());
}

// --- damaged stores ---------------------------------------------------------------------------------------------

class DamagedStore : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pristine_ = new ScratchDir("pristine");
    pack_model((test::mtp_fixtures() / "mtp_f32_hc4").string(), (*pristine_) / "store", quiet({0}));
  }
  static void TearDownTestSuite() { delete pristine_; }

  void SetUp() override {
    store_ = scratch_ / "store";
    fs::copy((*pristine_) / "store", store_);
  }
  std::string path(const std::string& name) const { return (fs::path(store_) / name).string(); }
  json manifest() const {
    std::ifstream in(path("manifest.json"));
    return json::parse(in);
  }
  void write_manifest(const json& m) const { std::ofstream(path("manifest.json")) << m.dump(); }
  std::string load_error() const {
    return error_of([&] { load_model(store_); });
  }
  void flip_byte(const std::string& file, uint64_t offset) const {
    std::fstream f(path(file), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(std::streamoff(offset));
    char c = 0;
    f.read(&c, 1);
    c = char(c ^ 0x40);
    f.seekp(std::streamoff(offset));
    f.write(&c, 1);
  }

  static ScratchDir* pristine_;
  ScratchDir scratch_;
  std::string store_;
};
ScratchDir* DamagedStore::pristine_ = nullptr;

void expect_contains(const std::string& message, std::initializer_list<std::string> parts) {
  for (const auto& part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
}

TEST_F(DamagedStore, TruncatedFileIsNamed) {
  fs::resize_file(path("experts-f32.bin"), fs::file_size(path("experts-f32.bin")) - 100);
  expect_contains(load_error(), {"experts-f32.bin", "truncated"});
}

TEST_F(DamagedStore, MissingFileIsNamed) {
  fs::remove(path("dense.bin"));
  expect_contains(load_error(), {"dense.bin", "cannot open"});
}

TEST_F(DamagedStore, ChecksumMismatchNamesTheRecordOrTensor) {
  PackedStore store(store_);
  const ExpertFile& experts = store.manifest().experts.front();
  const ExpertRecord& record = experts.records[11];
  flip_byte(experts.file, record.offset + 5);
  const StoredTensor& tensor = store.manifest().tensors.front();
  flip_byte(tensor.file, tensor.offset);
  std::vector<std::string> problems = verify_store(store_, ProgressMode::Quiet);
  ASSERT_EQ(problems.size(), 2u);
  expect_contains(problems[0], {"dense.bin", "tensor " + tensor.name, "checksum mismatch"});
  expect_contains(
      problems[1],
      {"experts-f32.bin", fmt::format("record layer {} expert {}", record.layer, record.expert), "checksum mismatch"});
}

TEST_F(DamagedStore, ChangedTokenizerFailsVerification) {
  flip_byte("config.json", 3);
  std::vector<std::string> problems = verify_store(store_, ProgressMode::Quiet);
  ASSERT_EQ(problems.size(), 1u);
  expect_contains(problems[0], {"config.json", "checksum mismatch"});
}

TEST_F(DamagedStore, WrongVersionAndFormat) {
  json m = manifest();
  m["version"] = 2;
  write_manifest(m);
  expect_contains(load_error(), {"manifest.json", "version", "2 is not supported"});
  m["format"] = "something-else";
  write_manifest(m);
  expect_contains(load_error(), {"manifest.json", "format"});
}

TEST_F(DamagedStore, BadFieldsAreNamed) {
  struct Case {
    std::function<void(json&)> damage;
    std::vector<std::string> expected;
  };
  std::vector<Case> cases = {
      {[](json& m) { m["tensors"][2].erase("offset"); }, {"tensors[2].offset", "missing"}},
      {[](json& m) { m["tensors"][2]["offset"] = 100; }, {"tensors[2].offset", "alignment"}},
      {[](json& m) { m["tensors"][2]["offset"] = 1ull << 40; }, {"tensors[2].offset", "outside dense.bin"}},
      {[](json& m) { m["tensors"][0]["dtype"] = "F99"; }, {"tensors[0].dtype", "unknown dtype F99"}},
      {[](json& m) { m["tensors"][0]["shape"] = {-1}; }, {"tensors[0].shape"}},
      {[](json& m) { m["tensors"][1]["bytes"] = 4; }, {"tensors[1].bytes", "needs"}},
      {[](json& m) { m["tensors"][1]["file"] = "nowhere.bin"; }, {"tensors[1].file", "nowhere.bin"}},
      {[](json& m) { m["tensors"][1]["xxh3"] = "xyz"; }, {"tensors[1].xxh3", "hex"}},
      {[](json& m) { m["tensors"][1]["offset"] = m["tensors"][0]["offset"]; }, {"overlap", "dense.bin"}},
      {[](json& m) { m["files"][0]["name"] = "../escape.bin"; }, {"files[0].name", "plain file name"}},
      {[](json& m) { m["alignment"] = 1000; }, {"alignment", "power of two"}},
      {[](json& m) { m["experts"][0]["bits"] = 5; }, {"experts[0].bits", "5 bits"}},
      {[](json& m) { m["experts"][0]["record_bytes"] = 4095; }, {"experts[0].record_bytes"}},
      {[](json& m) { m["experts"][0]["records"][3]["expert"] = 0; }, {"experts[0].records[3].expert", "twice"}},
      {[](json& m) { m["experts"][0]["records"][3]["offset"] = 1ull << 40; }, {"experts[0].records[3].offset"}},
      {[](json& m) { m["experts"][0]["records"][3]["layer"] = 99; }, {"record layer 99 expert", "outside the model"}},
      {[](json& m) { m["experts"][0]["parts"].erase(0); }, {"experts[0].parts", "gate"}},
      {[](json& m) { m["experts"][0]["parts"][1]["offset"] = 1ull << 40; }, {"experts[0].parts[1].offset"}},
      {[](json& m) { m["config"]["hidden_size"] = "wide"; }, {"manifest.json: config", "hidden_size"}},
      {[](json& m) { m.erase("experts"); }, {"experts", "missing"}},
  };
  const json pristine = manifest();
  for (const auto& c : cases) {
    json m = pristine;
    c.damage(m);
    write_manifest(m);
    std::string message = load_error();
    for (const auto& part : c.expected)
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
  std::ofstream(path("manifest.json")) << "{ not json";
  expect_contains(load_error(), {"manifest.json", "not valid JSON"});
}

TEST_F(DamagedStore, ExpertGeometryMustMatchTheConfig) {
  json m = manifest();
  m["config"]["moe_intermediate_size"] = 8;
  write_manifest(m);
  expect_contains(load_error(), {"experts-f32.bin[layer 0 expert 0].gate", "expected shape [8, 32]"});
}

// --- packing failures -------------------------------------------------------------------------------------------

// Nothing named after the output may remain: no store, no staging directory.
void expect_nothing_left(const ScratchDir& scratch) {
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(scratch.path)) left.push_back(entry.path().filename().string());
  EXPECT_TRUE(left.empty()) << "left behind: " << (left.empty() ? "" : left.front());
}

TEST(PackFailures, RefusesUpFrontWhenTheDiskIsTooSmall) {
  ScratchDir scratch;
  PackOptions options = quiet({4});
  uint64_t asked = 0;
  options.free_space = [&](const std::string&) { return asked = 1'000'000; };
  std::string message = error_of([&] { pack_model(bundled_model().string(), scratch / "store", options); });
  expect_contains(message, {scratch.path.string(), "not enough free space", "1000000 bytes"});
  EXPECT_EQ(asked, 1'000'000u);
  expect_nothing_left(scratch);
}

TEST(PackFailures, SpaceDecision) {
  EXPECT_NO_THROW(check_enough_space("/d", 1000, uint64_t(1) << 30));
  expect_contains(error_of([] { check_enough_space("/d", uint64_t(1) << 30, uint64_t(1) << 30); }),
                  {"/d", "not enough free space", "1073741824 bytes"});
  EXPECT_GT(free_bytes(fs::temp_directory_path().string()), 0u);
}

TEST(PackFailures, InterruptedPackLeavesNothingBehind) {
  for (int polls_before_interrupt : {0, 3, 40}) {
    ScratchDir scratch;
    PackOptions options = quiet({4, 2});
    int polls = 0;
    options.interrupted = [&] { return polls++ >= polls_before_interrupt; };
    std::string message = error_of([&] { pack_model(bundled_model().string(), scratch / "store", options); });
    expect_contains(message, {"interrupted"});
    expect_nothing_left(scratch);
  }
}

// The real Ctrl-C path, in a child process so the handler and its flag stay out of this one: the signal only sets
// the flag, the pack notices it at its next write and unwinds, removing the partial store.
TEST(PackFailures, CtrlCStopsThePackAndRemovesThePartialStore) {
  ScratchDir scratch;
  const std::string out = scratch / "store";
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    install_interrupt_handlers();
    std::raise(SIGINT);
    PackOptions options = quiet({4});
    options.interrupted = nullptr;  // the default: the signal flag
    try {
      pack_model(bundled_model().string(), out, options);
    } catch (const Error& e) {
      ::_exit(std::string(e.what()).find("interrupted") != std::string::npos ? 0 : 2);
    }
    ::_exit(3);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: another error, 3: the pack completed";
  expect_nothing_left(scratch);
}

TEST(PackFailures, ExistingOutputIsNotTouched) {
  ScratchDir scratch;
  fs::create_directory(scratch / "store");
  std::ofstream(scratch / "store/keep") << "mine";
  expect_contains(error_of([&] { pack_model(bundled_model().string(), scratch / "store", quiet({4})); }),
                  {"already exists"});
  EXPECT_TRUE(fs::exists(scratch / "store/keep"));
}

TEST(PackFailures, UnquantizableExpertsAskForDense) {
  ScratchDir scratch;
  std::string fixture = (test::model_fixtures() / "tiny_f32_hc4_ple1").string();
  expect_contains(error_of([&] { pack_model(fixture, scratch / "store", quiet({4})); }),
                  {"--experts 4", "multiples of 64", "--experts dense"});
  expect_nothing_left(scratch);
}

TEST(PackCli, PackVerifyAndLoadThroughTheBinary) {
  ScratchDir scratch;
  const std::string binary = VAVILOV_BINARY;
  std::string fixture = (test::mtp_fixtures() / "mtp_f32_hc3_fused").string();
  std::string store = scratch / "store";
  auto run = [&](const std::string& args) { return std::system((binary + " " + args + " 2>/dev/null").c_str()); };
  ASSERT_EQ(run("pack --model " + fixture + " --out " + store + " --experts dense"), 0);
  EXPECT_EQ(run("pack --verify " + store), 0);
  ASSERT_EQ(run("logits --model " + store + " --ids 1,5,9 --out " + (scratch / "a.f32")), 0);
  ASSERT_EQ(run("logits --model " + fixture + " --ids 1,5,9 --out " + (scratch / "b.f32")), 0);
  expect_identical(test::read_floats(scratch / "a.f32"), test::read_floats(scratch / "b.f32"), "logits via CLI");
  EXPECT_NE(run("pack --model " + fixture + " --out " + (scratch / "other") + " --experts 5"), 0);
  fs::resize_file(fs::path(store) / "dense.bin", 10);
  EXPECT_NE(run("pack --verify " + store), 0);
}

TEST(Progress, TextShowsBytesRateAndEta) {
  EXPECT_EQ(format_bytes(999), "999 B");
  EXPECT_EQ(format_bytes(1.5e9), "1.50 GB");
  EXPECT_EQ(format_bytes(812e6), "812.0 MB");
  EXPECT_EQ(format_duration(3723), "1:02:03");
  EXPECT_EQ(progress_text("packing", 1'000'000'000, 3'000'000'000, 2.0),
            "packing  1.00 GB / 3.00 GB  500.0 MB/s  ETA 0:04");
  EXPECT_EQ(progress_text("packing", 3'000'000'000, 3'000'000'000, 6.0), "packing  3.00 GB / 3.00 GB  500.0 MB/s");
}

std::string read_all(std::FILE* file) {
  std::fflush(file);
  std::rewind(file);
  std::string text;
  for (int c; (c = std::fgetc(file)) != EOF;) text += char(c);
  return text;
}

TEST(Progress, OutsideATerminalOnlyTheSummaryOrNothing) {
  for (ProgressMode mode : {ProgressMode::Auto, ProgressMode::Terminal, ProgressMode::Quiet}) {
    std::FILE* out = std::tmpfile();
    ASSERT_NE(out, nullptr);
    {
      Progress progress("packing x", 3000, mode, out);
      progress.add(1000);
      progress.add(2000);
      progress.finish();
    }
    std::string text = read_all(out);
    std::fclose(out);
    if (mode == ProgressMode::Auto)
      expect_contains(text, {"packing x: 3.00 kB in ", " s (", "/s)\n"});
    else
      EXPECT_EQ(text, "") << int(mode);
  }
}

// On a terminal (a pseudo-terminal here) the bar is redrawn in place, then replaced by the summary.
TEST(Progress, OnATerminalABarRedrawnInPlace) {
  int master = ::posix_openpt(O_RDWR | O_NOCTTY);
  if (master < 0) GTEST_SKIP() << "no pseudo-terminals on this machine";
  ASSERT_EQ(::grantpt(master), 0);
  ASSERT_EQ(::unlockpt(master), 0);
  std::FILE* terminal = std::fopen(::ptsname(master), "w");
  ASSERT_NE(terminal, nullptr);
  {
    Progress progress("loading m", 4'000'000'000, ProgressMode::Terminal, terminal);
    std::this_thread::sleep_for(std::chrono::milliseconds(150));  // past the redraw interval
    progress.add(1'000'000'000);
    progress.finish();
  }
  std::fclose(terminal);
  std::string text;
  char buffer[512];
  for (ssize_t n; (n = ::read(master, buffer, sizeof buffer)) > 0;) {
    text.append(buffer, size_t(n));
    if (text.find("/s)") != std::string::npos) break;
  }
  ::close(master);
  expect_contains(text, {"\r[######..................] loading m  1.00 GB / 4.00 GB  ", "ETA ", "\x1b[K",
                         "\rloading m: 1.00 GB in "});
}

}  // namespace
}  // namespace vavilov
