#include "model/safetensors.h"

#include <sys/types.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/internal/test_files.h"

namespace strata::model {
namespace {

using ::strata::model::testing::ReadFileBytes;
using ::strata::model::testing::TempDir;
using ::strata::model::testing::WriteFileBytes;
using ::strata::testing::StatusIs;
using ::testing::HasSubstr;

// A raw file: 8-byte length (or `declared_len` when given), header text, data bytes.
std::string RawFile(const std::string& header, const std::string& data, int64_t declared_len = -1) {
  uint64_t n = declared_len >= 0 ? static_cast<uint64_t>(declared_len) : header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

absl::Status OpenStatus(const TempDir& dir, const std::string& bytes) {
  const std::string path = dir.Join("t.safetensors");
  EXPECT_TRUE(WriteFileBytes(path, bytes));
  return SafetensorsFile::Open(path).status();
}

TEST(SafetensorsTest, RoundTripAllDtypesAndMetadata) {
  TempDir dir;
  std::vector<float> a = {1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, 7.0f};
  std::vector<uint16_t> b(12), h(5);
  for (size_t i = 0; i < b.size(); ++i) b[i] = kernels::F32ToBF16(0.5f * i - 1.0f);
  for (size_t i = 0; i < h.size(); ++i) h[i] = kernels::F32ToF16(0.25f * i);
  const std::string path = dir.Join("rt.safetensors");
  STRATA_ASSERT_OK(WriteSafetensors(path,
                                    {{"a", kernels::DType::kF32, {2, 3}, a.data()},
                                     {"b.weight", kernels::DType::kBF16, {3, 2, 2}, b.data()},
                                     {"h", kernels::DType::kF16, {5}, h.data()}},
                                    {{"format", "pt"}, {"note", "strata"}}));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<SafetensorsFile> f, SafetensorsFile::Open(path));
  EXPECT_EQ(f->num_tensors(), 3u);
  EXPECT_EQ(f->TensorNames(), (std::vector<std::string>{"a", "b.weight", "h"}));
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->metadata().at("note"), "strata");

  STRATA_ASSERT_OK_AND_ASSIGN(kernels::TensorView va, f->Get("a"));
  EXPECT_EQ(va.dtype, kernels::DType::kF32);
  EXPECT_EQ(va.rank, 2);
  EXPECT_EQ(va.dim(0), 2);
  EXPECT_EQ(va.dim(1), 3);
  EXPECT_EQ(std::memcmp(va.data, a.data(), a.size() * 4), 0);
  // The writer aligns the data area to 8 bytes: the first tensor's data is 8-aligned.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(va.data) % 8, 0u);

  STRATA_ASSERT_OK_AND_ASSIGN(kernels::TensorView vb, f->Get("b.weight"));
  EXPECT_EQ(vb.dtype, kernels::DType::kBF16);
  EXPECT_EQ(vb.rank, 3);
  EXPECT_EQ(std::memcmp(vb.data, b.data(), b.size() * 2), 0);
  STRATA_ASSERT_OK_AND_ASSIGN(kernels::TensorView vh, f->Get("h"));
  EXPECT_EQ(vh.dtype, kernels::DType::kF16);
  EXPECT_EQ(std::memcmp(vh.data, h.data(), h.size() * 2), 0);

  EXPECT_THAT(f->Get("missing"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
  // No temporary file left behind.
  EXPECT_THAT(SafetensorsFile::Open(path + ".tmp"), StatusIs(absl::StatusCode::kNotFound));
}

TEST(SafetensorsTest, StreamingWriterInPieces) {
  TempDir dir;
  const std::string path = dir.Join("s.safetensors");
  std::vector<float> x(1000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto w, SafetensorsWriter::Create(path, {{"x", kernels::DType::kF32, {10, 100}},
                                               {"y", kernels::DType::kF32, {0}},
                                               {"z", kernels::DType::kF32, {1000}}}));
  EXPECT_EQ(w->next_entry(), 0u);
  STRATA_ASSERT_OK(w->Write(x.data(), 400 * 4));
  EXPECT_EQ(w->next_entry(), 0u);
  STRATA_ASSERT_OK(w->Write(x.data() + 400, 600 * 4));
  EXPECT_EQ(w->next_entry(), 2u);  // the empty "y" is complete too
  // Closing early is an error; the file does not appear.
  EXPECT_THAT(w->Close(), StatusIs(absl::StatusCode::kFailedPrecondition));
  STRATA_ASSERT_OK(w->Write(x.data(), 1000 * 4));
  EXPECT_THAT(w->Write(x.data(), 4), StatusIs(absl::StatusCode::kFailedPrecondition));
  STRATA_ASSERT_OK(w->Close());
  STRATA_ASSERT_OK_AND_ASSIGN(auto f, SafetensorsFile::Open(path));
  STRATA_ASSERT_OK_AND_ASSIGN(kernels::TensorView z, f->Get("z"));
  EXPECT_EQ(z.As<float>()[999], 999.0f);
  STRATA_ASSERT_OK_AND_ASSIGN(kernels::TensorView y, f->Get("y"));
  EXPECT_EQ(y.NumElements(), 0);
}

TEST(SafetensorsTest, WriterRejectsBadEntries) {
  TempDir dir;
  const std::string path = dir.Join("bad.safetensors");
  EXPECT_THAT(SafetensorsWriter::Create(
                  path, {{"a", kernels::DType::kF32, {1}}, {"a", kernels::DType::kF32, {1}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate")));
  EXPECT_THAT(SafetensorsWriter::Create(path, {{"a", kernels::DType::kI32, {1}}}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(SafetensorsWriter::Create(path, {{"__metadata__", kernels::DType::kF32, {1}}}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(SafetensorsWriter::Create(path, {{"a", kernels::DType::kF32, {-1}}}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  EXPECT_THAT(SafetensorsFile::Open("/nonexistent/dir/x.safetensors"),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST(SafetensorsTest, ShorterThanLengthPrefix) {
  TempDir dir;
  EXPECT_THAT(OpenStatus(dir, ""), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(OpenStatus(dir, "abc"), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(SafetensorsTest, HeaderLengthPastEof) {
  TempDir dir;
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  EXPECT_THAT(OpenStatus(dir, RawFile(header, "abcd", header.size() + 5)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("past the end")));
  EXPECT_THAT(OpenStatus(dir, RawFile(header, "abcd", int64_t{1} << 62)),
              StatusIs(absl::StatusCode::kDataLoss));
}

TEST(SafetensorsTest, HeaderLengthAboveCap) {
  TempDir dir;
  const std::string path = dir.Join("big.safetensors");
  ASSERT_TRUE(WriteFileBytes(path, RawFile("{}", "", kMaxSafetensorsHeaderBytes + 1)));
  // Make the file long enough (sparse) that only the cap is violated.
  ASSERT_EQ(truncate(path.c_str(), kMaxSafetensorsHeaderBytes + 64), 0);
  EXPECT_THAT(SafetensorsFile::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cap")));
}

TEST(SafetensorsTest, GarbageJson) {
  TempDir dir;
  EXPECT_THAT(OpenStatus(dir, RawFile("{\"a\": [1, 2", "")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("JSON")));
  EXPECT_THAT(OpenStatus(dir, RawFile("\x01\x02\xff\xfe garbage", "")),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(OpenStatus(dir, RawFile("[1,2,3]", "")),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(OpenStatus(dir, RawFile(R"({"a": 5})", "")),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(SafetensorsTest, MissingOrMistypedFields) {
  TempDir dir;
  const std::string data(16, '\0');
  for (const char* header : {
           R"({"a":{"shape":[1],"data_offsets":[0,4]}})",
           R"({"a":{"dtype":"F32","data_offsets":[0,4]}})",
           R"({"a":{"dtype":"F32","shape":[1]}})",
           R"({"a":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})",
           R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
           R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})",
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})",
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})",
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":"0,4"}})",
           R"({"__metadata__":{"k":1}})",
       }) {
    EXPECT_THAT(OpenStatus(dir, RawFile(header, data)),
                StatusIs(absl::StatusCode::kInvalidArgument))
        << header;
  }
}

TEST(SafetensorsTest, OverlappingOffsets) {
  TempDir dir;
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  EXPECT_THAT(OpenStatus(dir, RawFile(header, std::string(12, '\0'))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlap")));
  // Identical ranges overlap too; touching ranges and empty tensors do not.
  const std::string same = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_THAT(OpenStatus(dir, RawFile(same, std::string(8, '\0'))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlap")));
  const std::string touching = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                               R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  STRATA_EXPECT_OK(OpenStatus(dir, RawFile(touching, std::string(16, '\0'))));
}

TEST(SafetensorsTest, OffsetsPastTheEnd) {
  TempDir dir;
  const std::string header = R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  EXPECT_THAT(OpenStatus(dir, RawFile(header, std::string(12, '\0'))),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("'a'")));
  const std::string huge =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,18446744073709551615]}})";
  EXPECT_FALSE(OpenStatus(dir, RawFile(huge, std::string(4, '\0'))).ok());
}

TEST(SafetensorsTest, BeginAfterEnd) {
  TempDir dir;
  const std::string header = R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})";
  EXPECT_THAT(OpenStatus(dir, RawFile(header, std::string(8, '\0'))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("begin")));
}

TEST(SafetensorsTest, ShapeBytesMismatch) {
  TempDir dir;
  const std::string header = R"({"a":{"dtype":"BF16","shape":[3,2],"data_offsets":[0,8]}})";
  EXPECT_THAT(OpenStatus(dir, RawFile(header, std::string(16, '\0'))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs 12 bytes")));
  // A shape whose element count overflows 64 bits.
  const std::string overflow =
      R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})";
  EXPECT_THAT(OpenStatus(dir, RawFile(overflow, std::string(8, '\0'))),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(SafetensorsTest, UnknownDtypeInFileIsRejected) {
  TempDir dir;
  const std::string header = R"({"a":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,2]}})";
  EXPECT_THAT(OpenStatus(dir, RawFile(header, std::string(2, '\0'))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Q4_K")));
}

TEST(SafetensorsTest, OtherDtypesListedButRejectedWhenRequested) {
  TempDir dir;
  const std::string header = R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
                             R"("mask":{"dtype":"U8","shape":[4],"data_offsets":[16,20]},)"
                             R"("w":{"dtype":"F32","shape":[1],"data_offsets":[20,24]},)"
                             R"("s":{"dtype":"F32","shape":[],"data_offsets":[24,28]}})";
  const std::string path = dir.Join("mixed.safetensors");
  ASSERT_TRUE(WriteFileBytes(path, RawFile(header, std::string(28, '\0'))));
  STRATA_ASSERT_OK_AND_ASSIGN(auto f, SafetensorsFile::Open(path));
  EXPECT_EQ(f->num_tensors(), 4u);
  EXPECT_THAT(f->Get("ids"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("I64")));
  EXPECT_THAT(f->Get("mask"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("U8")));
  EXPECT_THAT(f->Get("s"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
  STRATA_EXPECT_OK(f->Get("w"));
  ASSERT_NE(f->Find("ids"), nullptr);
  EXPECT_EQ(f->Find("ids")->dtype, "I64");
}

TEST(SafetensorsTest, TruncatedAtEveryLength) {
  TempDir dir;
  const std::string path = dir.Join("full.safetensors");
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  STRATA_ASSERT_OK(WriteSafetensors(path, {{"x", kernels::DType::kF32, {6}, x.data()},
                                           {"y", kernels::DType::kF32, {2}, x.data()}}));
  const std::string full = ReadFileBytes(path);
  ASSERT_GT(full.size(), 40u);
  for (size_t len = 0; len < full.size(); ++len) {
    absl::Status s = OpenStatus(dir, full.substr(0, len));
    EXPECT_FALSE(s.ok()) << "length " << len;
    EXPECT_TRUE(s.code() == absl::StatusCode::kDataLoss ||
                s.code() == absl::StatusCode::kInvalidArgument)
        << "length " << len << ": " << s;
  }
  STRATA_EXPECT_OK(OpenStatus(dir, full));
}

// Random corruption of the header bytes never crashes; whatever opens still serves in-bounds views.
TEST(SafetensorsTest, RandomHeaderCorruptionNeverCrashes) {
  const uint32_t seed = 20261122;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  TempDir dir;
  const std::string path = dir.Join("fuzz.safetensors");
  std::vector<float> x(24, 1.0f);
  STRATA_ASSERT_OK(WriteSafetensors(path,
                                    {{"alpha", kernels::DType::kF32, {4, 6}, x.data()},
                                     {"beta", kernels::DType::kF32, {3}, x.data()}},
                                    {{"format", "pt"}}));
  const std::string full = ReadFileBytes(path);
  int opened = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    std::string mutated = full;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      size_t pos = rng() % std::min<size_t>(mutated.size(), 8 + 140);
      mutated[pos] = static_cast<char>(rng() % 2 ? rng() % 256 : "0123456789[]{},:\""[rng() % 17]);
    }
    ASSERT_TRUE(WriteFileBytes(path, mutated));
    auto f = SafetensorsFile::Open(path);
    if (!f.ok()) {
      EXPECT_TRUE(f.status().code() == absl::StatusCode::kDataLoss ||
                  f.status().code() == absl::StatusCode::kInvalidArgument)
          << f.status();
      continue;
    }
    ++opened;
    for (const std::string& name : (*f)->TensorNames()) {
      auto v = (*f)->Get(name);
      if (!v.ok()) continue;
      const uint8_t* p = static_cast<const uint8_t*>(v->data);
      volatile uint8_t sink = 0;
      for (size_t i = 0; i < v->Bytes(); ++i) sink = sink ^ p[i];  // reads stay in the map
      (void)sink;
    }
  }
  std::printf("%d of 1500 corrupted files still opened\n", opened);
}

}  // namespace
}  // namespace strata::model
