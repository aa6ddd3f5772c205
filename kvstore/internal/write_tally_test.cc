#include "kvstore/internal/write_tally.h"

#include <memory>

#include "gtest/gtest.h"

namespace strata::kvstore::internal {
namespace {

// A document of `pages` pages on `layers` x `heads` with summary kinds 1 (one per page) and 7
// (`segments` of them).
v1::Document Doc(uint64_t pages, uint32_t layers, uint32_t heads, uint32_t segments) {
  v1::Document d;
  d.set_num_pages(pages);
  d.mutable_layout()->set_num_layers(layers);
  d.mutable_layout()->set_num_kv_heads(heads);
  v1::SummarySpec* s = d.add_summaries();
  s->set_kind(1);
  s->set_count(static_cast<uint32_t>(pages));
  s = d.add_summaries();
  s->set_kind(7);
  s->set_count(segments);
  return d;
}

TEST(WriteTallyTest, CountsEachEntryOnceAndKeepsPagesSummariesAndKindsApart) {
  std::unique_ptr<WriteTally> t = WriteTally::Make(Doc(5, 2, 3, 2));
  ASSERT_NE(t, nullptr);
  const DocumentId doc;
  for (int rep = 0; rep < 2; ++rep) {
    for (uint32_t l = 0; l < 2; ++l) {
      for (uint32_t g = 0; g < 3; ++g) {
        for (uint32_t p = 0; p < 5; ++p) t->AddPage(PageKey{doc, l, g, p});
      }
    }
  }
  EXPECT_EQ(t->pages(), 30u);
  EXPECT_EQ(t->summaries(), 0u);
  // The same (layer, head, index) under two kinds: two summaries; an undeclared kind: none.
  t->AddSummary(SummaryKey{doc, 1, 2, 1, 1});
  t->AddSummary(SummaryKey{doc, 1, 2, 7, 1});
  t->AddSummary(SummaryKey{doc, 1, 2, 7, 1});
  t->AddSummary(SummaryKey{doc, 1, 2, 9, 1});
  EXPECT_EQ(t->summaries(), 2u);
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t g = 0; g < 3; ++g) {
      for (uint32_t i = 0; i < 5; ++i) t->AddSummary(SummaryKey{doc, l, g, 1, i});
      for (uint32_t i = 0; i < 2; ++i) t->AddSummary(SummaryKey{doc, l, g, 7, i});
    }
  }
  EXPECT_EQ(t->summaries(), 2u * 3 * (5 + 2));
  EXPECT_EQ(t->pages(), 30u);
}

TEST(WriteTallyTest, NoneBeyondTheCap) {
  // One layer and head: 2 bits per page (the page and its kind-1 summary) plus one per segment.
  // Exactly kMaxBits fit; one bit more, or a document far beyond, gets no tally (no overflow).
  const uint64_t half = WriteTally::kMaxBits / 2;
  EXPECT_NE(WriteTally::Make(Doc(half, 1, 1, 0)), nullptr);
  EXPECT_EQ(WriteTally::Make(Doc(half, 1, 1, 1)), nullptr);
  EXPECT_EQ(WriteTally::Make(Doc(uint64_t{1} << 31, 1024, 1024, 0)), nullptr);
}

}  // namespace
}  // namespace strata::kvstore::internal
