// safetensors reading: a valid single file and sharded directory, zero-size tensors, and one test per malformed
// input. Every error must name the file and, where there is one, the tensor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "core/error.h"
#include "error_of.h"
#include "io/safetensors.h"

namespace vavilov {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

using test::error_of;

// Each test gets its own directory, removed afterwards.
class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "vavilov_st_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write_raw(const std::string& name, const std::string& bytes) {
    std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }

  // The 8-byte little-endian header length, the header, then `data_bytes` bytes of data.
  std::string write(const std::string& name, const std::string& header, size_t data_bytes) {
    uint64_t length = header.size();
    std::string bytes(8, '\0');
    std::memcpy(bytes.data(), &length, 8);
    return write_raw(name, bytes + header + std::string(data_bytes, '\x01'));
  }

  // The error of opening a single file whose header is `header`, with `data_bytes` bytes of data.
  std::string open_error(const std::string& header, size_t data_bytes) {
    std::string path = write("model.safetensors", header, data_bytes);
    return error_of([&] { SafetensorsFile file(path); });
  }

  std::string dir() const { return dir_.string(); }

  fs::path dir_;
};

TEST_F(Safetensors, ReadsAValidFile) {
  std::string path = write("model.safetensors",
                           R"({"__metadata__": {"format": "pt"},
                               "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
                               "b": {"dtype": "F32", "shape": [], "data_offsets": [12, 16]}})",
                           16);
  TensorStore store(dir());
  const TensorView& a = store.get("a");
  EXPECT_EQ(a.dtype, DType::BF16);
  EXPECT_EQ(a.shape_string(), "[2, 3]");
  EXPECT_EQ(a.numel(), 6);
  EXPECT_EQ(a.bytes, 12u);
  EXPECT_EQ(a.file, path);
  EXPECT_EQ(store.get("b").numel(), 1);
  EXPECT_EQ(store.get("b").data, a.data + 12);
  EXPECT_THAT(error_of([&] { store.get("c"); }), AllOf(HasSubstr(dir()), HasSubstr("missing tensor c")));
}

TEST_F(Safetensors, AcceptsZeroSizeTensorsAnywhere) {
  // Empty tensors own no bytes: one at the end of the data and one inside another tensor's range are fine.
  write("model.safetensors",
        R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "empty_end": {"dtype": "F32", "shape": [0, 4], "data_offsets": [16, 16]},
            "empty_inside": {"dtype": "BF16", "shape": [3, 0], "data_offsets": [8, 8]},
            "empty_huge": {"dtype": "I64", "shape": [9223372036854775807, 9223372036854775807, 0],
                           "data_offsets": [0, 0]}})",
        16);
  TensorStore store(dir());
  EXPECT_EQ(store.get("empty_end").numel(), 0);
  EXPECT_EQ(store.get("empty_end").bytes, 0u);
  EXPECT_EQ(store.get("empty_inside").bytes, 0u);
  EXPECT_EQ(store.get("empty_huge").bytes, 0u);
}

TEST_F(Safetensors, FileShorterThanEightBytes) {
  std::string path = write_raw("model.safetensors", "abc");
  EXPECT_THAT(error_of([&] { SafetensorsFile file(path); }), AllOf(HasSubstr(path), HasSubstr("truncated")));
}

TEST_F(Safetensors, HeaderLengthBeyondTheFile) {
  std::string path = write_raw("model.safetensors", std::string("\xff\x00\x00\x00\x00\x00\x00\x00{}", 10));
  EXPECT_THAT(error_of([&] { SafetensorsFile file(path); }),
              AllOf(HasSubstr(path), HasSubstr("header length 255 exceeds")));
}

TEST_F(Safetensors, DataSectionShorterThanOffsets) {
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 15),
              AllOf(HasSubstr("model.safetensors: tensor w"), HasSubstr("outside the 15 data bytes")));
}

TEST_F(Safetensors, HeaderNotJson) {
  EXPECT_THAT(open_error(R"({"w": {"dtype": )", 0), HasSubstr("model.safetensors: header is not valid JSON"));
}

TEST_F(Safetensors, HeaderNotAnObject) {
  EXPECT_THAT(open_error("[1, 2, 3]", 0), HasSubstr("model.safetensors: header is not a JSON object"));
}

TEST_F(Safetensors, EntryNotAnObject) {
  EXPECT_THAT(open_error(R"({"w": [1]})", 0), HasSubstr("model.safetensors: tensor w: header entry is not an object"));
}

TEST_F(Safetensors, BadDtype) {
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}})", 16),
              HasSubstr("model.safetensors: tensor w: unsupported dtype F128"));
}

TEST_F(Safetensors, MissingDtype) {
  EXPECT_THAT(open_error(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", 4),
              HasSubstr("model.safetensors: tensor w: missing dtype"));
}

TEST_F(Safetensors, NegativeShape) {
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}})", 16),
              HasSubstr("model.safetensors: tensor w: negative dimension -1"));
}

TEST_F(Safetensors, NonIntegerShape) {
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", 8),
              HasSubstr("model.safetensors: tensor w: shape entries must be integers"));
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}})", 8),
              HasSubstr("model.safetensors: tensor w: shape entries must be integers"));
}

TEST_F(Safetensors, ShapeTooLarge) {
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 8]}})", 8),
              HasSubstr("model.safetensors: tensor w: shape dimension 18446744073709551615 is too large"));
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})", 8),
              HasSubstr("model.safetensors: tensor w: shape overflows"));
}

TEST_F(Safetensors, OffsetsOutOfRange) {
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [100, 104]}})", 8),
              AllOf(HasSubstr("model.safetensors: tensor w"), HasSubstr("data_offsets [100, 104] outside")));
}

TEST_F(Safetensors, OffsetsNegativeOrMalformed) {
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 8),
              HasSubstr("model.safetensors: tensor w: data_offsets must be non-negative integers"));
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 8),
              HasSubstr("model.safetensors: tensor w: data_offsets must be [begin, end]"));
}

TEST_F(Safetensors, OffsetsReversed) {
  EXPECT_THAT(open_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8),
              AllOf(HasSubstr("model.safetensors: tensor w"), HasSubstr("data_offsets [8, 4]")));
}

TEST_F(Safetensors, OverlappingTensors) {
  EXPECT_THAT(open_error(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                             "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})",
                         20),
              HasSubstr("model.safetensors: tensors a and b overlap"));
}

TEST_F(Safetensors, OverlapIsNotHiddenByTensorsInBetween) {
  // Sorted by begin: a [0,32), e [8,8) empty, c [12,16), b [20,28). b overlaps a though its neighbour is c.
  EXPECT_THAT(open_error(R"({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
                             "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
                             "b": {"dtype": "F32", "shape": [2], "data_offsets": [20, 28]}})",
                         32),
              AllOf(HasSubstr("model.safetensors: tensors a and b overlap")));
  EXPECT_THAT(open_error(R"({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
                             "c": {"dtype": "F32", "shape": [1], "data_offsets": [32, 36]},
                             "d": {"dtype": "U8", "shape": [4], "data_offsets": [28, 32]}})",
                         36),
              HasSubstr("model.safetensors: tensors a and d overlap"));
}

TEST_F(Safetensors, ByteCountDoesNotMatchShape) {
  EXPECT_THAT(open_error(R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 24]}})", 24),
              HasSubstr("model.safetensors: tensor w: shape/dtype need 12 bytes but data_offsets give 24"));
}

TEST_F(Safetensors, ParseHeaderDirectly) {
  auto entries =
      parse_safetensors_header(R"({"x": {"dtype": "U8", "shape": [3], "data_offsets": [1, 4]}})", 4, "mem.safetensors");
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].begin, 1u);
  EXPECT_EQ(entries[0].end, 4u);
  EXPECT_THAT(error_of([] { parse_safetensors_header("{}}", 0, "mem.safetensors"); }),
              HasSubstr("mem.safetensors: header is not valid JSON"));
}

// Sharded checkpoints: an index mapping tensor names to shard files in the same directory.
class Sharded : public Safetensors {
 protected:
  void write_index(const std::string& weight_map) {
    write_raw("model.safetensors.index.json", R"({"metadata": {}, "weight_map": )" + weight_map + "}");
  }
  void write_shards() {
    write("s1.safetensors", R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 4);
    write("s2.safetensors", R"({"b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 8);
  }
  std::string index() const { return (dir_ / "model.safetensors.index.json").string(); }
};

TEST_F(Sharded, ReadsAllShards) {
  write_shards();
  write_index(R"({"a": "s1.safetensors", "b": "s2.safetensors"})");
  TensorStore store(dir());
  EXPECT_EQ(store.tensors().size(), 2u);
  EXPECT_EQ(store.get("b").file, (dir_ / "s2.safetensors").string());
}

TEST_F(Sharded, IndexNamesAMissingShard) {
  write_shards();
  write_index(R"({"a": "s1.safetensors", "b": "s3.safetensors"})");
  EXPECT_THAT(error_of([&] { TensorStore store(dir()); }),
              AllOf(HasSubstr("s3.safetensors"), HasSubstr("cannot open")));
}

TEST_F(Sharded, TensorMissingFromItsShard) {
  write_shards();
  write_index(R"({"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors"})");
  EXPECT_THAT(error_of([&] { TensorStore store(dir()); }),
              AllOf(HasSubstr(index()), HasSubstr("tensor c listed in the index is missing from"),
                    HasSubstr("s2.safetensors")));
}

TEST_F(Sharded, TensorInADifferentShardThanIndexed) {
  write_shards();
  write_index(R"({"a": "s2.safetensors", "b": "s2.safetensors"})");
  EXPECT_THAT(error_of([&] { TensorStore store(dir()); }),
              AllOf(HasSubstr(index()), HasSubstr("tensor a listed in the index is missing from")));
}

TEST_F(Sharded, PathEscapingTheDirectory) {
  write_shards();
  for (const char* shard : {"../s1.safetensors", "..", "sub/s1.safetensors", "", "."}) {
    write_index(R"({"a": ")" + std::string(shard) + R"("})");
    EXPECT_THAT(error_of([&] { TensorStore store(dir()); }),
                AllOf(HasSubstr(index()), HasSubstr("weight_map[a] names a file outside the directory")))
        << shard;
  }
}

TEST_F(Sharded, DuplicateTensorAcrossShards) {
  write_shards();
  write("s3.safetensors", R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 4);
  write_index(R"({"a": "s1.safetensors", "b": "s2.safetensors", "x": "s3.safetensors"})");
  EXPECT_THAT(error_of([&] { TensorStore store(dir()); }),
              AllOf(HasSubstr("s3.safetensors: tensor a also appears in"), HasSubstr("s1.safetensors")));
}

TEST_F(Sharded, IndexNotJson) {
  write_raw("model.safetensors.index.json", "{\"weight_map\": ");
  EXPECT_THAT(error_of([&] { TensorStore store(dir()); }), AllOf(HasSubstr(index()), HasSubstr("not valid JSON")));
}

TEST_F(Sharded, IndexWithoutWeightMap) {
  write_raw("model.safetensors.index.json", "{}");
  EXPECT_THAT(error_of([&] { TensorStore store(dir()); }), AllOf(HasSubstr(index()), HasSubstr("weight_map")));
}

TEST_F(Safetensors, DirectoryWithoutWeights) {
  EXPECT_THAT(error_of([&] { TensorStore store(dir()); }), AllOf(HasSubstr(dir()), HasSubstr("no model.safetensors")));
}

}  // namespace
}  // namespace vavilov
