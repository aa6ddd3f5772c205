#include "kvstore/document_id.h"

#include <numeric>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace strata::kvstore {
namespace {

using ::strata::testing::StatusIs;

KvLayout Layout() {
  KvLayout l;
  l.num_layers = 32;
  l.num_kv_heads = 8;
  l.page = PageShape{kernels::DType::kBF16, 64, 128};
  return l;
}

std::vector<int32_t> Tokens(int n, int offset = 0) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), offset);
  return t;
}

TEST(DocumentIdTest, KnownValueIsStableAcrossProcessesAndBuilds) {
  // Pinned value: changing it changes every stored document's identity.
  STRATA_ASSERT_OK_AND_ASSIGN(DocumentIdentity id,
                              ComputeDocumentIdentity("model-abc", Layout(), Tokens(130)));
  const std::string hex = id.id.ToHex();
  EXPECT_EQ(hex.size(), 32u);
  STRATA_ASSERT_OK_AND_ASSIGN(DocumentIdentity again,
                              ComputeDocumentIdentity("model-abc", Layout(), Tokens(130)));
  EXPECT_EQ(again.id, id.id);
  EXPECT_EQ(id.page_chain.size(), 3u);  // 64 + 64 + 2
  EXPECT_EQ(hex, "efd13efd6a8de3f17907d25e0a4c18d2") << "document id encoding changed";
}

TEST(DocumentIdTest, NamespacedByModelLayoutAndContent) {
  STRATA_ASSERT_OK_AND_ASSIGN(DocumentIdentity base,
                              ComputeDocumentIdentity("m1", Layout(), Tokens(200)));
  STRATA_ASSERT_OK_AND_ASSIGN(DocumentIdentity other_model,
                              ComputeDocumentIdentity("m2", Layout(), Tokens(200)));
  KvLayout fp8 = Layout();
  fp8.page.dtype = kernels::DType::kFP8E4M3;
  STRATA_ASSERT_OK_AND_ASSIGN(DocumentIdentity other_layout,
                              ComputeDocumentIdentity("m1", fp8, Tokens(200)));
  std::vector<int32_t> t = Tokens(200);
  t[150] = 7;
  STRATA_ASSERT_OK_AND_ASSIGN(DocumentIdentity other_tokens,
                              ComputeDocumentIdentity("m1", Layout(), t));
  STRATA_ASSERT_OK_AND_ASSIGN(DocumentIdentity shorter,
                              ComputeDocumentIdentity("m1", Layout(), Tokens(199)));
  EXPECT_NE(base.id, other_model.id);
  EXPECT_NE(base.id, other_layout.id);
  EXPECT_NE(base.id, other_tokens.id);
  EXPECT_NE(base.id, shorter.id);
  // The chain agrees on the pages before the change (prefix sharing) and differs after.
  EXPECT_EQ(base.page_chain[0], other_tokens.page_chain[0]);
  EXPECT_EQ(base.page_chain[1], other_tokens.page_chain[1]);
  EXPECT_NE(base.page_chain[2], other_tokens.page_chain[2]);
  EXPECT_EQ(base.page_chain[2], shorter.page_chain[2]);
  EXPECT_NE(base.page_chain[3], shorter.page_chain[3]);
}

TEST(DocumentIdTest, HexRoundTripAndValidation) {
  STRATA_ASSERT_OK_AND_ASSIGN(DocumentIdentity id, ComputeDocumentIdentity("m", Layout(), Tokens(5)));
  STRATA_ASSERT_OK_AND_ASSIGN(DocumentId back, DocumentId::FromHex(id.id.ToHex()));
  EXPECT_EQ(back, id.id);
  EXPECT_THAT(DocumentId::FromHex("abc"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DocumentId::FromHex(std::string(31, 'a') + "g"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ComputeDocumentIdentity("", Layout(), Tokens(5)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  KvLayout bad = Layout();
  bad.num_layers = 0;
  EXPECT_THAT(ComputeDocumentIdentity("m", bad, Tokens(5)),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace strata::kvstore
