// A decode that reads the document's KV through the GPU page cache (CPU backend): the document is
// prefilled, its pages persisted to a host tier, and the prompt/decode tokens run with a cache of
// their own plus GpuCacheAttention over a page cache far smaller than the document's KV. Logits
// must equal those of the whole sequence in one KvCache (both bf16 KV).
#include "engine/gpu_cache_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "engine/attention_policy.h"
#include "engine/internal/test_model.h"
#include "engine/kv_cache.h"
#include "engine/selection_cache.h"
#include "engine/transformer.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kvstore/backend_page_allocator.h"
#include "kvstore/host_cache.h"
#include "kvstore/page_format.h"

namespace strata::engine {
namespace {

using ::strata::testing::StatusIs;
using test_model::DType;
using test_model::MakeModel;
using test_model::RefModel;

constexpr int kPage = 16;

float MaxDiff(const float* a, const float* b, int64_t n) {
  float m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float d = std::fabs(a[i] - b[i]);
    if (!(d <= m)) m = std::isnan(d) ? INFINITY : d;
  }
  return m;
}

class GpuCacheAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeModel(DType::kF32, false, false, &ref_);
    backend_ = kernels::MakeCpuBackend(1);
    TransformerOptions opt;
    opt.prefill_chunk_size = 16;
    auto tf = Transformer::Create(model_->config, model_->weights, backend_.get(), opt);
    ASSERT_TRUE(tf.ok()) << tf.status();
    tf_ = *std::move(tf);
    std::mt19937 rng(5);
    ids_.resize(kTotal);
    for (int32_t& id : ids_) id = static_cast<int32_t>(rng() % model_->config.vocab_size);
    // Reference: the whole sequence in one bf16 cache.
    const int64_t V = model_->config.vocab_size;
    want_.assign(static_cast<size_t>(kTotal) * V, NAN);
    STRATA_ASSERT_OK_AND_ASSIGN(
        auto whole, KvCache::Create(tf_->MakeCacheOptions(kTotal, kPage, DType::kBF16),
                                    backend_.get()));
    auto dense = MakeDensePolicy();
    STRATA_ASSERT_OK(tf_->Forward(ids_.data(), kTotal, 0, whole.get(), dense.get(), want_.data(),
                                  true));
    // The document alone, persisted page by page into the host tier.
    STRATA_ASSERT_OK_AND_ASSIGN(
        auto doc, KvCache::Create(tf_->MakeCacheOptions(kDoc, kPage, DType::kBF16),
                                  backend_.get()));
    std::vector<float> unused(static_cast<size_t>(kDoc) * V);
    auto dense2 = MakeDensePolicy();
    STRATA_ASSERT_OK(tf_->Forward(ids_.data(), kDoc, 0, doc.get(), dense2.get(), unused.data(),
                                  true));
    kvstore::HostCacheOptions ho;
    STRATA_ASSERT_OK_AND_ASSIGN(host_, kvstore::HostCache::Create(ho));
    document_.bytes.fill(7);
    const int d = model_->config.head_dim;
    kvstore::PageShape shape;
    shape.page_size = kPage;
    shape.head_dim = d;
    std::vector<kvstore::PageWrite> writes;
    for (int l = 0; l < model_->config.num_layers; ++l) {
      for (int g = 0; g < model_->config.num_kv_heads; ++g) {
        for (int p = 0; p * kPage < kDoc; ++p) {
          const int valid = std::min(kPage, kDoc - p * kPage);
          const size_t off = static_cast<size_t>(doc->SlotOf(l, g, p)) * kPage * d * 2;
          kernels::TensorView k(static_cast<char*>(doc->k_pool(l).data) + off, DType::kBF16,
                                {valid, d});
          kernels::TensorView v(static_cast<char*>(doc->v_pool(l).data) + off, DType::kBF16,
                                {valid, d});
          STRATA_ASSERT_OK_AND_ASSIGN(std::string page, kvstore::EncodePage(shape, k, v));
          kvstore::PageWrite w;
          w.key = kvstore::PageKey{document_, static_cast<uint32_t>(l), static_cast<uint32_t>(g),
                                   static_cast<uint32_t>(p)};
          STRATA_ASSERT_OK_AND_ASSIGN(w.data, kvstore::PageBuffer::Copy(page));
          writes.push_back(std::move(w));
          // The minmax summary, as the worker persists it (kind 1).
          std::vector<float> kf(static_cast<size_t>(valid) * d), summary(2 * d);
          kernels::ConvertToF32(k.data, DType::kBF16, kf.data(), valid * d);
          for (int j = 0; j < d; ++j) {
            summary[j] = INFINITY;
            summary[d + j] = -INFINITY;
          }
          for (int t = 0; t < valid; ++t) {
            for (int j = 0; j < d; ++j) {
              summary[j] = std::min(summary[j], kf[t * d + j]);
              summary[d + j] = std::max(summary[d + j], kf[t * d + j]);
            }
          }
          kvstore::SummaryWrite sw;
          sw.key = kvstore::SummaryKey{document_, static_cast<uint32_t>(l),
                                       static_cast<uint32_t>(g), 1, static_cast<uint32_t>(p)};
          STRATA_ASSERT_OK_AND_ASSIGN(
              sw.data, kvstore::PageBuffer::Copy(absl::string_view(
                           reinterpret_cast<const char*>(summary.data()), 2 * d * sizeof(float))));
          summaries_.push_back(std::move(sw));
        }
      }
    }
    STRATA_ASSERT_OK(host_->Put(writes, summaries_));
  }

  MinMaxChooserOptions ChooserOptions(int budget, int window) {
    MinMaxChooserOptions c;
    c.store = host_.get();
    c.document = document_;
    c.summary_kind = 1;
    c.num_layers = model_->config.num_layers;
    c.num_kv_heads = model_->config.num_kv_heads;
    c.head_dim = model_->config.head_dim;
    c.num_pages = (kDoc + kPage - 1) / kPage;
    c.budget_pages = budget;
    c.window_pages = window;
    return c;
  }

  // A device-managed cache of 12 slots over the document's pages re-encoded in `shape` (bf16 or
  // fp8) into a new host tier `*tier` whose buffers come from `alloc` (read in place).
  absl::StatusOr<std::unique_ptr<kvstore::GpuPageCache>> MakeDeviceManagedCache(
      const kvstore::PageShape& shape, kvstore::BackendPageAllocator* alloc,
      std::unique_ptr<kvstore::HostCache>* tier) {
    const int hkv = model_->config.num_kv_heads, d = model_->config.head_dim;
  kvstore::HostCacheOptions ho;
  ho.allocator = alloc;
  STRATA_ASSIGN_OR_RETURN(*tier, kvstore::HostCache::Create(ho));
  std::vector<kvstore::PageKey> keys;
  for (int l = 0; l < model_->config.num_layers; ++l) {
    for (int g = 0; g < hkv; ++g) {
      for (int p = 0; p < kPagesPerHead; ++p) {
        keys.push_back(kvstore::PageKey{document_, static_cast<uint32_t>(l),
                                        static_cast<uint32_t>(g), static_cast<uint32_t>(p)});
      }
    }
  }
  std::vector<kvstore::PageRef> refs;
  STRATA_RETURN_IF_ERROR(host_->GetPages(keys, &refs));
  std::vector<kvstore::PageWrite> writes;
  std::vector<float> k(kPage * d), v(kPage * d);
  for (size_t i = 0; i < keys.size(); ++i) {
    STRATA_RETURN_IF_ERROR(kvstore::DecodePage(refs[i]->view(), k.data(), v.data()));
    STRATA_ASSIGN_OR_RETURN(kvstore::PageHeader h, kvstore::ParsePageHeader(refs[i]->view()));
    STRATA_ASSIGN_OR_RETURN(
        std::string page,
        kvstore::EncodePage(shape, kernels::TensorView(k.data(), DType::kF32, {h.num_tokens, d}),
                            kernels::TensorView(v.data(), DType::kF32, {h.num_tokens, d})));
    STRATA_ASSIGN_OR_RETURN(kvstore::PageRef buf, kvstore::PageBuffer::Copy(page, alloc));
    writes.push_back(kvstore::PageWrite{keys[i], std::move(buf)});
  }
  STRATA_RETURN_IF_ERROR((*tier)->Put(writes, {}));
  kvstore::GpuCacheOptions co;
  co.document = document_;
  co.num_layers = model_->config.num_layers;
  co.num_kv_heads = hkv;
  co.pages_per_head = kPagesPerHead;
  co.page_size = kPage;
  co.head_dim = d;
  co.num_slots = 12;
  co.source = tier->get();
  co.in_place_allocator = alloc;
  co.hold_source_pages = true;
  co.device_managed = true;
  return kvstore::GpuPageCache::Create(co, backend_.get());
  }

  std::unique_ptr<kvstore::GpuPageCache> MakeCache(int64_t slots) {
    kvstore::GpuCacheOptions o;
    o.document = document_;
    o.num_layers = model_->config.num_layers;
    o.num_kv_heads = model_->config.num_kv_heads;
    o.pages_per_head = (kDoc + kPage - 1) / kPage;
    o.page_size = kPage;
    o.head_dim = model_->config.head_dim;
    o.num_slots = slots;
    o.max_batch_pages = 2;
    o.source = host_.get();
    auto c = kvstore::GpuPageCache::Create(o, backend_.get());
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // The reference of the device-selection tests: the host path over FixedPages through `cache`
  // (*host: the hook, for its counters; *logits as RunAfterDocument).
  void RunFixedPagesOnHost(kvstore::GpuPageCache* cache, std::unique_ptr<GpuCacheAttention>* host,
                           std::vector<float>* logits) {
    GpuCacheAttentionOptions o;
    o.document_tokens = kDoc;
    o.chooser = [this](int, int g, const float*, int, int, std::vector<int32_t>* p) {
      *p = FixedPages(g);
      return absl::OkStatus();
    };
    STRATA_ASSERT_OK_AND_ASSIGN(*host, GpuCacheAttention::Create(o, cache, backend_.get()));
    RunAfterDocument(host->get(), logits);
  }

  // Runs tokens [kDoc, kTotal): the prompt as one chunk, then the rest one token at a time (decode).
  void RunAfterDocument(ExternalAttention* ext, std::vector<float>* logits) {
    const int64_t V = model_->config.vocab_size;
    logits->assign(static_cast<size_t>(kTotal - kDoc) * V, NAN);
    STRATA_ASSERT_OK_AND_ASSIGN(
        auto local, KvCache::Create(tf_->MakeCacheOptions(kTotal - kDoc, kPage, DType::kBF16),
                                    backend_.get()));
    auto dense = MakeDensePolicy();
    ForwardOptions fo;
    fo.cache_first_position = kDoc;
    fo.external = ext;
    constexpr int kPrompt = 5;
    STRATA_ASSERT_OK(tf_->Forward(ids_.data() + kDoc, kPrompt, kDoc, local.get(), dense.get(),
                                  logits->data(), true, fo));
    for (int t = kDoc + kPrompt; t < kTotal; ++t) {
      STRATA_ASSERT_OK(tf_->Forward(ids_.data() + t, 1, t, local.get(), dense.get(),
                                    logits->data() + (t - kDoc) * V, false, fo));
    }
  }

  static constexpr int kDoc = 88;    // 6 pages per head, the last one partial
  static constexpr int kTotal = 100;

  // A fixed selection per KV head: page 0 (prefix), two middle pages (a device CandidateList of
  // page ids, fanout kPage, one -1 pad) and the last page (suffix, partial).
  static constexpr int kPagesPerHead = (kDoc + kPage - 1) / kPage;  // 6, the last partial
  const std::vector<std::vector<int32_t>> fixed_middle_ = {{2, 4, -1}, {1, 3, -1}};
  std::unique_ptr<kernels::Buffer> fixed_parents_;
  // The pages of KV head g, sorted (as a PageChooser returns them).
  std::vector<int32_t> FixedPages(int g) const {
    std::vector<int32_t> v = {0};
    for (int32_t p : fixed_middle_[g]) {
      if (p >= 0) v.push_back(p);
    }
    v.push_back(kPagesPerHead - 1);
    std::sort(v.begin(), v.end());
    return v;
  }
  // The same as a device selection (the parents uploaded on first use).
  absl::Status FixedSelection(DeviceTokenSelection* sel) {
    const int hkv = model_->config.num_kv_heads;
    if (fixed_parents_ == nullptr) {
      std::vector<int32_t> parents;
      for (const auto& m : fixed_middle_) parents.insert(parents.end(), m.begin(), m.end());
      STRATA_ASSIGN_OR_RETURN(fixed_parents_, backend_->Allocate(parents.size() * 4));
      STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(fixed_parents_->data(), parents.data(),
                                                    parents.size() * 4, nullptr));
    }
    sel->valid = true;
    sel->prefix_end = kPage;
    sel->middle.parents = fixed_parents_->View(DType::kI32, {hkv, 3});
    sel->middle.fanout = kPage;
    sel->middle.begin = kPage;
    sel->middle.end = (kPagesPerHead - 1) * kPage;
    sel->suffix_begin = (kPagesPerHead - 1) * kPage;
    sel->suffix_end = kDoc;
    return absl::OkStatus();
  }
  RefModel ref_;
  std::unique_ptr<test_model::TestModel> model_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Transformer> tf_;
  std::vector<int32_t> ids_;
  std::vector<float> want_;
  std::unique_ptr<kvstore::HostCache> host_;
  kvstore::DocumentId document_;
  std::vector<kvstore::SummaryWrite> summaries_;
};

TEST_F(GpuCacheAttentionTest, DecodeThroughTheCacheMatchesTheWholeSequence) {
  // 2 layers x 2 KV heads x 6 pages = 24 document pages; the cache holds 5.
  auto cache = MakeCache(5);
  ASSERT_NE(cache, nullptr);
  GpuCacheAttentionOptions o;
  o.document_tokens = kDoc;
  o.max_pages_per_chunk = 4;
  STRATA_ASSERT_OK_AND_ASSIGN(auto ext, GpuCacheAttention::Create(o, cache.get(), backend_.get()));
  std::vector<float> got;
  RunAfterDocument(ext.get(), &got);
  const int64_t V = model_->config.vocab_size;
  EXPECT_LE(MaxDiff(got.data(), want_.data() + kDoc * V, (kTotal - kDoc) * V), 1e-4f);
  // 8 forwards x 2 layers; 12 pages per layer in chunks of 4.
  EXPECT_EQ(ext->counters().calls, 16);
  EXPECT_EQ(ext->counters().chunks, 48);
  const kvstore::GpuCacheStats s = cache->stats();
  EXPECT_EQ(s.lookups, 16 * 12);
  EXPECT_GT(s.evictions, 0);
  EXPECT_EQ(cache->pinned_slots(), 0);
}

TEST_F(GpuCacheAttentionTest, ChooserDecidesWhatIsAttended) {
  auto cache = MakeCache(8);
  ASSERT_NE(cache, nullptr);
  // Choosing nothing equals a forward that cannot see the document.
  GpuCacheAttentionOptions none;
  none.document_tokens = kDoc;
  none.chooser = [](int, int, const float*, int, int, std::vector<int32_t>*) {
    return absl::OkStatus();
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto ext, GpuCacheAttention::Create(none, cache.get(),
                                                                  backend_.get()));
  std::vector<float> with_none, blind;
  RunAfterDocument(ext.get(), &with_none);
  RunAfterDocument(nullptr, &blind);
  EXPECT_EQ(with_none, blind);
  EXPECT_EQ(cache->stats().lookups, 0);
  // Every page, chosen explicitly (12 per layer: chunks of 8 and 4): the exact result.
  GpuCacheAttentionOptions all;
  all.document_tokens = kDoc;
  all.chooser = [](int, int, const float*, int, int, std::vector<int32_t>* pages) {
    for (int p = 0; p < 6; ++p) pages->push_back(p);
    return absl::OkStatus();
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto ext2, GpuCacheAttention::Create(all, cache.get(),
                                                                   backend_.get()));
  std::vector<float> got;
  RunAfterDocument(ext2.get(), &got);
  const int64_t V = model_->config.vocab_size;
  EXPECT_LE(MaxDiff(got.data(), want_.data() + kDoc * V, (kTotal - kDoc) * V), 1e-4f);
  // A chooser that picks a page outside the document fails the forward.
  GpuCacheAttentionOptions bad;
  bad.document_tokens = kDoc;
  bad.chooser = [](int, int, const float*, int, int, std::vector<int32_t>* pages) {
    pages->push_back(6);
    return absl::OkStatus();
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto ext3, GpuCacheAttention::Create(bad, cache.get(),
                                                                   backend_.get()));
  std::vector<AttentionPartial> parts;
  std::vector<float> q(4 * 8, 0.5f);
  EXPECT_THAT(ext3->Attend(0, q.data(), 1, 4, kDoc, &parts),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // A chooser's error ends the call with that error.
  GpuCacheAttentionOptions failing;
  failing.document_tokens = kDoc;
  failing.chooser = [](int, int, const float*, int, int, std::vector<int32_t>*) {
    return absl::DataLossError("summary checksum");
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto ext4, GpuCacheAttention::Create(failing, cache.get(),
                                                                   backend_.get()));
  EXPECT_THAT(ext4->Attend(0, q.data(), 1, 4, kDoc, &parts),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(cache->pinned_slots(), 0);
}

TEST_F(GpuCacheAttentionTest, MinMaxChooserSelectsFromPersistedSummaries) {
  auto cache = MakeCache(8);
  ASSERT_NE(cache, nullptr);
  const int64_t V = model_->config.vocab_size;
  // A budget that covers every page: exact.
  GpuCacheAttentionOptions o;
  o.document_tokens = kDoc;
  o.chooser = MakeMinMaxChooser(ChooserOptions(4, 1));
  STRATA_ASSERT_OK_AND_ASSIGN(auto ext, GpuCacheAttention::Create(o, cache.get(), backend_.get()));
  std::vector<float> got;
  RunAfterDocument(ext.get(), &got);
  EXPECT_LE(MaxDiff(got.data(), want_.data() + kDoc * V, (kTotal - kDoc) * V), 1e-4f);
  // Sink + 1 chosen + 1 window page per head: 3 of 6 pages attended, fewer lookups, finite logits
  // that differ from the exact ones.
  const int64_t lookups_before = cache->stats().lookups;
  o.chooser = MakeMinMaxChooser(ChooserOptions(1, 1));
  STRATA_ASSERT_OK_AND_ASSIGN(auto sparse, GpuCacheAttention::Create(o, cache.get(), backend_.get()));
  RunAfterDocument(sparse.get(), &got);
  EXPECT_EQ(sparse->counters().pages_attended, sparse->counters().calls * 2 * 3);
  EXPECT_EQ(cache->stats().lookups - lookups_before, sparse->counters().calls * 2 * 3);
  for (float x : got) ASSERT_TRUE(std::isfinite(x));
  EXPECT_GT(MaxDiff(got.data(), want_.data() + kDoc * V, (kTotal - kDoc) * V), 1e-4f);
}

TEST_F(GpuCacheAttentionTest, MinMaxChooserPicksTheHighestBoundChunksByTheirMeanQueryAndReportsMissingSummaries) {
  // Planted summaries: page 3's keys reach +4 in every channel, the others stay within 0.1.
  constexpr int kD = 8, kN = 6;
  kvstore::HostCacheOptions ho;
  STRATA_ASSERT_OK_AND_ASSIGN(auto store, kvstore::HostCache::Create(ho));
  std::vector<kvstore::SummaryWrite> writes;
  for (int p = 0; p < kN; ++p) {
    std::vector<float> s(2 * kD);
    for (int i = 0; i < kD; ++i) {
      s[i] = -0.1f;
      s[kD + i] = p == 3 ? 4.0f : 0.1f;
    }
    kvstore::SummaryWrite w;
    w.key = kvstore::SummaryKey{document_, 0, 1, 1, static_cast<uint32_t>(p)};
    STRATA_ASSERT_OK_AND_ASSIGN(w.data, kvstore::PageBuffer::Copy(absl::string_view(
                                            reinterpret_cast<const char*>(s.data()),
                                            s.size() * sizeof(float))));
    writes.push_back(std::move(w));
  }
  STRATA_ASSERT_OK(store->Put({}, writes));
  MinMaxChooserOptions c;
  c.store = store.get();
  c.document = document_;
  c.num_layers = 1;
  c.num_kv_heads = 2;
  c.head_dim = kD;
  c.num_pages = kN;
  c.budget_pages = 1;
  c.window_pages = 1;
  PageChooser choose = MakeMinMaxChooser(c);
  std::vector<float> q(4 * kD, 1.0f);  // 4 query heads, 2 per KV head, one token
  std::vector<int32_t> pages;
  STRATA_ASSERT_OK(choose(0, 1, q.data(), 1, 4, &pages));
  EXPECT_EQ(pages, (std::vector<int32_t>{0, 3, 5}));
  // A chunk chooses once with its mean query. Tokens (-3, 1) x q: the mean -q bounds every middle
  // page alike (0.1 per channel), so the tie goes to page 1; a vote summed over the tokens would
  // have taken page 3 (token 1 alone puts almost all of its vote there).
  std::vector<float> chunk(2 * 4 * kD);
  for (int i = 0; i < 4 * kD; ++i) chunk[i] = -3.0f, chunk[4 * kD + i] = 1.0f;
  pages.clear();
  STRATA_ASSERT_OK(choose(0, 1, chunk.data(), 2, 4, &pages));
  EXPECT_EQ(pages, (std::vector<int32_t>{0, 1, 5}));
  // Tokens (3, -1) x q: the mean q, the one-token choice.
  for (int i = 0; i < 4 * kD; ++i) chunk[i] = 3.0f, chunk[4 * kD + i] = -1.0f;
  pages.clear();
  STRATA_ASSERT_OK(choose(0, 1, chunk.data(), 2, 4, &pages));
  EXPECT_EQ(pages, (std::vector<int32_t>{0, 3, 5}));
  // KV head 0 has no summaries in this store; layer 1 is outside the options.
  pages.clear();
  EXPECT_THAT(choose(0, 0, q.data(), 1, 4, &pages), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(choose(1, 0, q.data(), 1, 4, &pages),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The selection cache, host chooser and device twin (DeviceSelectionCache + EnqueueMinMaxPageTopK
// on the CPU backend): planted summaries where page 3 bounds channels 0-3 high and page 2
// channels 4-7. q1 (channels 0-3) picks page 3; q2 (q1 plus channels 4-7 at 1.5) would pick page 2
// but has cosine 0.55 with q1, so at theta 0.5 it reuses page 3; q3 (cosine < 0 with q1) picks
// page 2 afresh; a call of several tokens (host) or Invalidate (device) forgets the entry.
TEST_F(GpuCacheAttentionTest, SelectionCacheReusesTheSelectionOfASimilarQuery) {
  constexpr int kD = 8, kN = 6, kHeads = 2, kGroup = 2;
  kvstore::HostCacheOptions ho;
  STRATA_ASSERT_OK_AND_ASSIGN(auto store, kvstore::HostCache::Create(ho));
  std::vector<kvstore::SummaryWrite> writes;
  std::vector<float> device_summaries;  // [kHeads, kN, 2 kD]
  for (int g = 0; g < kHeads; ++g) {
    for (int p = 0; p < kN; ++p) {
      std::vector<float> s(2 * kD);
      for (int i = 0; i < kD; ++i) {
        s[i] = -0.1f;
        s[kD + i] = (p == 3 && i < 4) || (p == 2 && i >= 4) ? 4.0f : 0.1f;
      }
      device_summaries.insert(device_summaries.end(), s.begin(), s.end());
      kvstore::SummaryWrite w;
      w.key = kvstore::SummaryKey{document_, 0, static_cast<uint32_t>(g), 1, static_cast<uint32_t>(p)};
      STRATA_ASSERT_OK_AND_ASSIGN(w.data, kvstore::PageBuffer::Copy(absl::string_view(
                                              reinterpret_cast<const char*>(s.data()),
                                              s.size() * sizeof(float))));
      writes.push_back(std::move(w));
    }
  }
  STRATA_ASSERT_OK(store->Put({}, writes));
  auto query = [&](float a, float b) {  // every query head: channels 0-3 = a, 4-7 = b
    std::vector<float> q(static_cast<size_t>(kHeads) * kGroup * kD);
    for (size_t i = 0; i < q.size(); ++i) q[i] = i % kD < 4 ? a : b;
    return q;
  };
  const std::vector<float> q1 = query(1, 0), q2 = query(1, 1.5f), q3 = query(-1, 1);
  MinMaxChooserOptions c;
  c.store = store.get();
  c.document = document_;
  c.num_layers = 1;
  c.num_kv_heads = kHeads;
  c.head_dim = kD;
  c.num_pages = kN;
  c.budget_pages = 1;
  c.window_pages = 1;
  PageChooser plain = MakeMinMaxChooser(c);
  SelectionCounters counts;
  c.cache_theta = 0.5;
  c.cache_counters = &counts;
  PageChooser cached = MakeMinMaxChooser(c);
  auto pick = [&](PageChooser& ch, const std::vector<float>& q, int tokens, int g) {
    std::vector<int32_t> pages;
    EXPECT_TRUE(ch(0, g, q.data(), tokens, kHeads * kGroup, &pages).ok());
    return pages;
  };
  using Pages = std::vector<int32_t>;
  std::vector<float> q11 = q1;
  q11.insert(q11.end(), q1.begin(), q1.end());  // two tokens
  for (int g = 0; g < kHeads; ++g) {
    EXPECT_EQ(pick(plain, q2, 1, g), (Pages{0, 2, 5}));  // q2 alone picks page 2
    EXPECT_EQ(pick(cached, q1, 1, g), (Pages{0, 3, 5}));
    EXPECT_EQ(pick(cached, q2, 1, g), (Pages{0, 3, 5})) << "a hit keeps q1's pages";
    EXPECT_EQ(pick(cached, q3, 1, g), (Pages{0, 2, 5}));
    EXPECT_EQ(pick(cached, q11, 2, g), (Pages{0, 3, 5}));  // forgets the entry
    EXPECT_EQ(pick(cached, q3, 1, g), (Pages{0, 2, 5}));   // a miss
  }
  EXPECT_EQ(counts.cache_lookups, 4 * kHeads);
  EXPECT_EQ(counts.cache_hits, 1 * kHeads);
  EXPECT_TRUE(pick(plain, q1, 1, 0) == (Pages{0, 3, 5}));

  // The device twin on the CPU backend.
  kernels::Backend* be = backend_.get();
  EXPECT_THAT(DeviceSelectionCache::Create(be, 1, kHeads, kGroup, kD, 1, 1.5).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DeviceSelectionCache::Create(be, 0, kHeads, kGroup, kD, 1, 0.5).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache,
                              DeviceSelectionCache::Create(be, 1, kHeads, kGroup, kD, 1, 0.5));
  std::vector<float> scores(static_cast<size_t>(kHeads) * kGroup * (kN - 2));
  const kernels::TensorView sums(device_summaries.data(), DType::kF32, {kHeads, kN, 2 * kD});
  // The check as its own op (Check, then skip flags), or inside the selection op
  // (EnqueueCachedMinMaxPageTopK): the same picks and counts.
  bool in_op = false;
  auto device_pick = [&](const std::vector<float>& q) {
    const kernels::TensorView qv(const_cast<float*>(q.data()), DType::kF32, {kHeads * kGroup, kD});
    const kernels::TensorView sv(scores.data(), DType::kF32, {kHeads, kGroup, kN - 2});
    if (in_op) {
      absl::StatusOr<kernels::TensorView> kept =
          EnqueueCachedMinMaxPageTopK(be, qv, sums, kN - 1, 1, sv, *cache, 0);
      EXPECT_TRUE(kept.ok()) << kept.status();
      if (kept.ok()) {
        EXPECT_EQ(kept->data, cache->kept(0).data);
      }
    } else {
      absl::StatusOr<const int32_t*> skip = cache->Check(0, qv, nullptr);
      EXPECT_TRUE(skip.ok()) << skip.status();
      EXPECT_TRUE(EnqueueMinMaxPageTopK(be, qv, sums, kN - 1, 1, sv, cache->kept(0),
                                        skip.ok() ? *skip : nullptr)
                      .ok());
    }
    const int32_t* kept = cache->kept(0).As<const int32_t>();
    return Pages(kept, kept + kHeads);
  };
  for (const bool op : {false, true}) {
    SCOPED_TRACE(op ? "check in the selection op" : "check as its own op");
    in_op = op;
    if (op) {
      STRATA_ASSERT_OK_AND_ASSIGN(cache, DeviceSelectionCache::Create(be, 1, kHeads, kGroup, kD, 1, 0.5));
    }
    EXPECT_EQ(device_pick(q1), (Pages{3, 3}));
    EXPECT_EQ(device_pick(q2), (Pages{3, 3}));  // hits on both heads
    EXPECT_EQ(device_pick(q3), (Pages{2, 2}));
    STRATA_ASSERT_OK(cache->Invalidate(0, nullptr));
    EXPECT_EQ(device_pick(q3), (Pages{2, 2}));  // a miss
    EXPECT_EQ(cache->lookups(), 4 * kHeads);
    STRATA_ASSERT_OK_AND_ASSIGN(const int64_t hits, cache->ReadHits(nullptr));
    EXPECT_EQ(hits, 1 * kHeads);
  }
  cache->CountChecks(3);
  EXPECT_EQ(cache->lookups(), 7 * kHeads);
  EXPECT_THAT(cache->Check(1, kernels::TensorView(const_cast<float*>(q1.data()), DType::kF32,
                                                   {kHeads * kGroup, kD}),
                           nullptr)
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(cache->Invalidate(-1, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
}

// Choosers of one document with different budgets share a MinMaxSummaryCache: each (layer, kv head)
// is held once (bytes of one copy), and they choose what choosers with their own caches choose;
// concurrent first reads of one entry return the same copy; a cache of another shape is refused.
TEST_F(GpuCacheAttentionTest, ChoosersSharingASummaryCacheHoldOneCopy) {
  const model::ModelConfig& c = model_->config;
  MinMaxChooserOptions base = ChooserOptions(1, 1);
  auto shared = std::make_shared<MinMaxSummaryCache>(host_.get(), document_, 1, base.num_layers,
                                                     base.num_kv_heads, base.head_dim, base.num_pages);
  {  // four threads read one entry first at once
    std::vector<const std::vector<float>*> seen(4, nullptr);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        absl::StatusOr<const std::vector<float>*> got = shared->Get(1, 0);
        if (got.ok()) seen[t] = *got;
      });
    }
    for (std::thread& t : threads) t.join();
    for (int t = 0; t < 4; ++t) {
      ASSERT_NE(seen[t], nullptr);
      EXPECT_EQ(seen[t], seen[0]);
    }
    EXPECT_EQ(shared->bytes(), static_cast<int64_t>(base.num_pages) * 2 * base.head_dim * 4);
  }
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(3) * c.num_heads * c.head_dim);
  for (float& x : q) x = nd(rng);
  for (int budget : {1, 3}) {
    MinMaxChooserOptions own = ChooserOptions(budget, 1), with = own;
    with.summaries = shared;
    with.store = nullptr;  // unused with a shared cache
    PageChooser a = MakeMinMaxChooser(own), b = MakeMinMaxChooser(with);
    for (int layer = 0; layer < c.num_layers; ++layer) {
      for (int g = 0; g < c.num_kv_heads; ++g) {
        std::vector<int32_t> pa, pb;
        STRATA_ASSERT_OK(a(layer, g, q.data(), 3, static_cast<int>(c.num_heads), &pa));
        STRATA_ASSERT_OK(b(layer, g, q.data(), 3, static_cast<int>(c.num_heads), &pb));
        EXPECT_EQ(pa, pb) << "budget " << budget << " layer " << layer << " head " << g;
      }
    }
  }
  EXPECT_EQ(shared->bytes(),
            static_cast<int64_t>(c.num_layers) * c.num_kv_heads * base.num_pages * 2 * base.head_dim * 4);
  MinMaxChooserOptions wrong = base;
  wrong.num_pages = base.num_pages + 1;
  wrong.summaries = shared;
  std::vector<int32_t> pages;
  EXPECT_THAT(MakeMinMaxChooser(wrong)(0, 0, q.data(), 1, static_cast<int>(c.num_heads), &pages),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(shared->Get(c.num_layers, 0).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(GpuCacheAttentionTest, DevicePathMatchesTheWholeSequence) {
  // The device path (q and partials in backend memory, MissPolicy::kOrdered): 12 pages per layer
  // in chunks of 4 through a cache of 5 slots, chunks merged on the device.
  auto cache = MakeCache(5);
  ASSERT_NE(cache, nullptr);
  GpuCacheAttentionOptions o;
  o.document_tokens = kDoc;
  o.max_pages_per_chunk = 4;
  o.device_path = true;
  STRATA_ASSERT_OK_AND_ASSIGN(auto ext, GpuCacheAttention::Create(o, cache.get(), backend_.get()));
  ASSERT_TRUE(ext->AttendsOnDevice());
  std::vector<float> got;
  RunAfterDocument(ext.get(), &got);
  const int64_t V = model_->config.vocab_size;
  EXPECT_LE(MaxDiff(got.data(), want_.data() + kDoc * V, (kTotal - kDoc) * V), 1e-4f);
  EXPECT_EQ(ext->counters().calls, 16);
  EXPECT_EQ(ext->counters().chunks, 48);
  EXPECT_EQ(cache->stats().lookups, 16 * 12);
  EXPECT_GT(cache->stats().evictions, 0);
  EXPECT_EQ(cache->pinned_slots(), 0);
}

TEST_F(GpuCacheAttentionTest, DevicePathGivesTheHostPathsLogitsForTheSameChooser) {
  // Sparse: sink + 1 chosen + 1 window page per head. One chunk per call, so the device path
  // merges exactly the values the host path merges: identical logits.
  const int64_t V = model_->config.vocab_size;
  auto cache_a = MakeCache(12);
  auto cache_b = MakeCache(12);
  auto cache_c = MakeCache(12);
  ASSERT_NE(cache_c, nullptr);
  GpuCacheAttentionOptions o;
  o.document_tokens = kDoc;
  o.chooser = MakeMinMaxChooser(ChooserOptions(1, 1));
  STRATA_ASSERT_OK_AND_ASSIGN(auto host, GpuCacheAttention::Create(o, cache_a.get(),
                                                                   backend_.get()));
  std::vector<float> want, got;
  RunAfterDocument(host.get(), &want);
  o.device_path = true;  // the host chooser, q copied to the host for it
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev, GpuCacheAttention::Create(o, cache_b.get(),
                                                                  backend_.get()));
  RunAfterDocument(dev.get(), &got);
  EXPECT_EQ(got, want);
  EXPECT_EQ(cache_b->stats().hits, cache_a->stats().hits);
  EXPECT_GT(MaxDiff(want.data(), want_.data() + kDoc * V, (kTotal - kDoc) * V), 1e-4f);
  // A device chooser that reads q from backend memory and asks the host chooser: the same again,
  // and it sees the same queries.
  PageChooser inner = MakeMinMaxChooser(ChooserOptions(1, 1));
  const int hkv = model_->config.num_kv_heads;
  int device_calls = 0;
  o.chooser = nullptr;
  o.device_chooser = [&](int layer, const kernels::TensorView& q,
                         std::vector<std::vector<int32_t>>* pages,
                         DeviceTokenSelection*) -> absl::Status {
    ++device_calls;
    if (q.rank != 3 || static_cast<int>(pages->size()) != hkv) {
      return absl::InternalError("unexpected shape");
    }
    std::vector<float> qh(static_cast<size_t>(q.NumElements()));
    STRATA_RETURN_IF_ERROR(backend_->CopyToHost(qh.data(), q.data, qh.size() * 4, nullptr));
    for (int g = 0; g < hkv; ++g) {
      STRATA_RETURN_IF_ERROR(inner(layer, g, qh.data(), static_cast<int>(q.dim(0)),
                                   static_cast<int>(q.dim(1)), &(*pages)[g]));
    }
    return absl::OkStatus();
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev2, GpuCacheAttention::Create(o, cache_c.get(),
                                                                   backend_.get()));
  // The prompt chunk (5 tokens) also goes through the device chooser.
  RunAfterDocument(dev2.get(), &got);
  EXPECT_EQ(got, want);
  EXPECT_EQ(device_calls, dev2->counters().calls);
  EXPECT_EQ(cache_c->pinned_slots(), 0);
}

TEST_F(GpuCacheAttentionTest, DeviceTokenSelectionAttendsThroughTheDevicePageTable) {
  // Per KV head: page 0 (prefix), two chosen middle pages (a device CandidateList of page ids,
  // fanout page_size, one -1 pad) and the last page (suffix, partial). The one-token steps attend
  // with SelectedAttention over the cache's device table; the prompt chunk (5 tokens) through
  // PagedAttention. Logits as the host path with the same pages, to rounding.
  const int hkv = model_->config.num_kv_heads;
  auto cache_a = MakeCache(12);
  auto cache_b = MakeCache(12);
  ASSERT_NE(cache_b, nullptr);
  GpuCacheAttentionOptions o;
  o.document_tokens = kDoc;
  std::unique_ptr<GpuCacheAttention> host;
  std::vector<float> want, got;
  RunFixedPagesOnHost(cache_a.get(), &host, &want);
  o.chooser = nullptr;
  o.device_path = true;
  o.device_chooser = [&](int, const kernels::TensorView& q,
                         std::vector<std::vector<int32_t>>* pages, DeviceTokenSelection* sel) {
    for (int g = 0; g < hkv; ++g) (*pages)[g] = FixedPages(g);
    return q.dim(0) == 1 ? FixedSelection(sel) : absl::OkStatus();
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev, GpuCacheAttention::Create(o, cache_b.get(),
                                                                  backend_.get()));
  RunAfterDocument(dev.get(), &got);
  // 7 one-token steps x 2 layers through SelectedAttention.
  EXPECT_EQ(dev->counters().selected_attention, 14);
  EXPECT_EQ(dev->counters().pages_attended, host->counters().pages_attended);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(MaxDiff(got.data(), want.data(), static_cast<int64_t>(got.size())), 1e-4f);
  const int64_t V = model_->config.vocab_size;
  EXPECT_GT(MaxDiff(want.data(), want_.data() + kDoc * V, (kTotal - kDoc) * V), 1e-4f);
  EXPECT_EQ(cache_b->pinned_slots(), 0);
}

TEST_F(GpuCacheAttentionTest, DeviceManagedCacheGivesTheHostPathsLogits) {
  // The selection of the test above, through a device-managed cache (kvstore::GpuCacheOptions::
  // device_managed: ResolvePages + SelectedAttention per query token, the prompt chunk included,
  // no host page lists): the logits of the host path with the same pages, to rounding.
  const int hkv = model_->config.num_kv_heads;
  auto cache_a = MakeCache(12);
  ASSERT_NE(cache_a, nullptr);
  GpuCacheAttentionOptions o;
  o.document_tokens = kDoc;
  std::unique_ptr<GpuCacheAttention> host;
  std::vector<float> want, got;
  RunFixedPagesOnHost(cache_a.get(), &host, &want);

  // The document's pages copied into a host tier in backend host memory (read in place).
  kvstore::PageShape shape;
  shape.page_size = kPage;
  shape.head_dim = model_->config.head_dim;
  kvstore::BackendPageAllocator alloc(backend_.get(), shape.EncodedBytes(), 1 << 16);
  std::unique_ptr<kvstore::HostCache> pinned;
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache_b, MakeDeviceManagedCache(shape, &alloc, &pinned));

  EXPECT_THAT(GpuCacheAttention::Create(o, cache_b.get(), backend_.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));  // host path on a device cache
  o.chooser = nullptr;
  o.device_path = true;
  int calls = 0;
  o.device_chooser = [&](int, const kernels::TensorView& q,
                         std::vector<std::vector<int32_t>>* pages, DeviceTokenSelection* sel) {
    ++calls;
    if (pages != nullptr || q.dim(0) != 1) return absl::InternalError("host pages asked for");
    return FixedSelection(sel);
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev, GpuCacheAttention::Create(o, cache_b.get(),
                                                                  backend_.get()));
  EXPECT_TRUE(dev->CapturableOnDevice());
  EXPECT_FALSE(host->CapturableOnDevice());
  RunAfterDocument(dev.get(), &got);
  // 5 prompt tokens and 7 decode steps, per layer, one token at a time.
  const int L = model_->config.num_layers;
  EXPECT_EQ(dev->counters().selected_attention, 12 * L);
  EXPECT_EQ(calls, 12 * L);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(MaxDiff(got.data(), want.data(), static_cast<int64_t>(got.size())), 1e-4f);
  STRATA_ASSERT_OK(cache_b->SyncDeviceStats());
  const kvstore::GpuCacheStats st = cache_b->stats();
  EXPECT_EQ(st.lookups, 12 * L * 4 * hkv);  // 4 distinct pages per head and call
  EXPECT_EQ(st.hits + st.fills, st.lookups);
  EXPECT_GE(st.fills, L * 4 * hkv);

  // chunk_selection: the prompt chunk asks the chooser once with all 5 tokens and resolves once;
  // the same logits (the selection does not depend on q here).
  auto cache_c = MakeDeviceManagedCache(shape, &alloc, &pinned);
  ASSERT_TRUE(cache_c.ok()) << cache_c.status();
  o.chunk_selection = true;
  std::vector<int64_t> tokens_seen;
  o.device_chooser = [&](int, const kernels::TensorView& q, std::vector<std::vector<int32_t>>* pages,
                         DeviceTokenSelection* sel) {
    if (pages != nullptr) return absl::InternalError("host pages asked for");
    tokens_seen.push_back(q.dim(0));
    return FixedSelection(sel);
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto chunked, GpuCacheAttention::Create(o, cache_c->get(), backend_.get()));
  std::vector<float> got_c;
  RunAfterDocument(chunked.get(), &got_c);
  ASSERT_EQ(tokens_seen.size(), static_cast<size_t>(8 * L));  // the chunk + 7 decode steps
  EXPECT_EQ(tokens_seen[0], 5);
  EXPECT_EQ(tokens_seen.back(), 1);
  EXPECT_EQ(chunked->counters().selected_attention, 12 * L);  // still one attention per token
  ASSERT_EQ(got_c.size(), want.size());
  EXPECT_LE(MaxDiff(got_c.data(), want.data(), static_cast<int64_t>(got_c.size())), 1e-4f);
  STRATA_ASSERT_OK((*cache_c)->SyncDeviceStats());
  EXPECT_EQ((*cache_c)->stats().lookups, 8 * L * 4 * hkv);
}

TEST_F(GpuCacheAttentionTest, DeviceManagedCacheOfFp8PagesUsesEachPagesScales) {
  // The document re-encoded as fp8 pages (each with its own K and V scale) in a device-managed
  // cache: the pools are fp8, SelectedAttention reads each slot's scales, and the logits stay
  // within fp8 rounding of the bf16 pages' (without the scales they would not: the stored values
  // are the keys / scale, up to 448).
  const int d = model_->config.head_dim;
  kvstore::PageShape bf16_shape, fp8_shape;
  bf16_shape.page_size = fp8_shape.page_size = kPage;
  bf16_shape.head_dim = fp8_shape.head_dim = d;
  fp8_shape.dtype = DType::kFP8E4M3;
  kvstore::BackendPageAllocator alloc16(backend_.get(), bf16_shape.EncodedBytes(), 1 << 16);
  kvstore::BackendPageAllocator alloc8(backend_.get(), fp8_shape.EncodedBytes(), 1 << 16);
  std::unique_ptr<kvstore::HostCache> tier16, tier8;
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache16,
                              MakeDeviceManagedCache(bf16_shape, &alloc16, &tier16));
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache8, MakeDeviceManagedCache(fp8_shape, &alloc8, &tier8));
  EXPECT_EQ(cache16->k_pool().dtype, DType::kBF16);
  EXPECT_EQ(cache8->k_pool().dtype, DType::kFP8E4M3);
  EXPECT_EQ(cache16->slot_scales(), nullptr);
  ASSERT_NE(cache8->slot_scales(), nullptr);
  EXPECT_EQ(cache8->page_bytes() * 2, cache16->page_bytes());
  GpuCacheAttentionOptions o;
  o.document_tokens = kDoc;
  o.device_path = true;
  o.device_chooser = [&](int, const kernels::TensorView&, std::vector<std::vector<int32_t>>*,
                         DeviceTokenSelection* sel) { return FixedSelection(sel); };
  STRATA_ASSERT_OK_AND_ASSIGN(auto a16, GpuCacheAttention::Create(o, cache16.get(),
                                                                  backend_.get()));
  STRATA_ASSERT_OK_AND_ASSIGN(auto a8, GpuCacheAttention::Create(o, cache8.get(),
                                                                 backend_.get()));
  std::vector<float> want, got;
  RunAfterDocument(a16.get(), &want);
  RunAfterDocument(a8.get(), &got);
  ASSERT_EQ(got.size(), want.size());
  const float diff = MaxDiff(got.data(), want.data(), static_cast<int64_t>(got.size()));
  float largest = 0;
  for (float x : want) largest = std::max(largest, std::fabs(x));
  EXPECT_GT(diff, 0.0f);  // fp8 rounding moved something
  // ... by rounding only: 0.26 of logits up to 11.1 when written; without the slot scales the
  // difference was 14.5.
  EXPECT_LT(diff, 0.05f * largest);
  // A host-managed cache over the same fp8 pages keeps bf16 pools (it dequantises at fill time;
  // kvstore/gpu_cache_test.cc checks the slots) and has no slot scales.
  kvstore::GpuCacheOptions host_managed = cache8->options();
  host_managed.device_managed = false;
  host_managed.hold_source_pages = true;
  STRATA_ASSERT_OK_AND_ASSIGN(auto hm, kvstore::GpuPageCache::Create(host_managed, backend_.get()));
  EXPECT_EQ(hm->k_pool().dtype, DType::kBF16);
  EXPECT_EQ(hm->slot_scales(), nullptr);
}

TEST_F(GpuCacheAttentionTest, DevicePathChecksItsArguments) {
  auto cache = MakeCache(8);
  ASSERT_NE(cache, nullptr);
  const int d = model_->config.head_dim;
  std::vector<float> q(4 * d, 0.5f), out(4 * d), lse(4), q3(3 * d, 0.5f);
  const kernels::TensorView qv(q.data(), DType::kF32, {1, 4, d});
  const kernels::TensorView ov(out.data(), DType::kF32, {1, 4, d});
  const kernels::TensorView lv(lse.data(), DType::kF32, {1, 4});
  GpuCacheAttentionOptions o;
  o.document_tokens = kDoc;
  STRATA_ASSERT_OK_AND_ASSIGN(auto off, GpuCacheAttention::Create(o, cache.get(), backend_.get()));
  EXPECT_FALSE(off->AttendsOnDevice());
  EXPECT_THAT(off->AttendOnDevice(0, qv, kDoc, ov, lv),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  o.device_path = true;
  STRATA_ASSERT_OK_AND_ASSIGN(auto on, GpuCacheAttention::Create(o, cache.get(), backend_.get()));
  STRATA_EXPECT_OK(on->AttendOnDevice(0, qv, kDoc, ov, lv));
  for (float x : lse) EXPECT_TRUE(std::isfinite(x));
  EXPECT_THAT(on->AttendOnDevice(0, kernels::TensorView(q3.data(), DType::kF32, {1, 3, d}), kDoc,
                                 ov, lv),
              StatusIs(absl::StatusCode::kInvalidArgument));  // 3 query heads for 2 KV heads
  EXPECT_THAT(on->AttendOnDevice(0, qv, kDoc, kernels::TensorView(out.data(), DType::kF32,
                                                                   {1, 2, d}), lv),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(on->AttendOnDevice(0, qv, kDoc - 1, ov, lv),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // A device chooser with the wrong number of heads, or an out-of-range page, fails the call.
  o.device_chooser = [](int, const kernels::TensorView&, std::vector<std::vector<int32_t>>* p,
                        DeviceTokenSelection*) {
    p->resize(1);
    return absl::OkStatus();
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto bad, GpuCacheAttention::Create(o, cache.get(), backend_.get()));
  EXPECT_THAT(bad->AttendOnDevice(0, qv, kDoc, ov, lv),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o.device_chooser = [](int, const kernels::TensorView&, std::vector<std::vector<int32_t>>* p,
                        DeviceTokenSelection*) {
    (*p)[0].push_back(6);
    return absl::OkStatus();
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto bad2, GpuCacheAttention::Create(o, cache.get(),
                                                                   backend_.get()));
  EXPECT_THAT(bad2->AttendOnDevice(0, qv, kDoc, ov, lv),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(cache->pinned_slots(), 0);
}

TEST_F(GpuCacheAttentionTest, OptionsAreChecked) {
  auto cache = MakeCache(4);
  ASSERT_NE(cache, nullptr);
  GpuCacheAttentionOptions o;
  o.document_tokens = 6 * kPage + 1;  // beyond the cache's page table
  EXPECT_THAT(GpuCacheAttention::Create(o, cache.get(), backend_.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o.document_tokens = kDoc;
  STRATA_ASSERT_OK_AND_ASSIGN(auto ext, GpuCacheAttention::Create(o, cache.get(), backend_.get()));
  std::vector<AttentionPartial> parts;
  std::vector<float> q(3 * 8, 0.5f);
  EXPECT_THAT(ext->Attend(0, q.data(), 1, 3, kDoc, &parts),  // 3 query heads for 2 KV heads
              StatusIs(absl::StatusCode::kInvalidArgument));
  // A chunk larger than the cache: ResourceExhausted from the cache, nothing left pinned.
  o.max_pages_per_chunk = 5;
  STRATA_ASSERT_OK_AND_ASSIGN(auto big, GpuCacheAttention::Create(o, cache.get(), backend_.get()));
  std::vector<float> q4(4 * 8, 0.5f);
  EXPECT_THAT(big->Attend(0, q4.data(), 1, 4, kDoc, &parts),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(cache->pinned_slots(), 0);
}

}  // namespace
}  // namespace strata::engine
