// Test helpers: deterministic random pages and documents for kvstore tests (test-only target
// strata::kvstore_testing). Thread-safe (pure functions).
#ifndef STRATA_KVSTORE_TESTING_TEST_PAGES_H_
#define STRATA_KVSTORE_TESTING_TEST_PAGES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kvstore/document_id.h"
#include "kvstore/page_store.h"
#include "strata/v1/kvstore.pb.h"

namespace strata::kvstore::testing {

// A small layout: `layers` x `heads`, bf16 pages of P tokens and head dim d.
KvLayout SmallLayout(int layers = 2, int heads = 2, int page_size = 16, int head_dim = 32);

// The encoded page of (layer, kv_head, page_index) of a document of `num_tokens` tokens, filled
// with bf16 values derived deterministically from (seed, layer, kv_head, page_index).
std::string MakePage(const KvLayout& layout, uint64_t num_tokens, uint32_t layer,
                     uint32_t kv_head, uint32_t page_index, uint64_t seed);
// A deterministic summary payload.
std::string MakeSummary(uint32_t layer, uint32_t kv_head, uint32_t kind, uint32_t index,
                        uint64_t seed);

// A document request: id computed from `seed`-derived tokens, one summary kind (kind 1, one
// entry per page), the given TTL.
v1::CreateDocumentRequest MakeDocumentRequest(const KvLayout& layout, uint64_t num_tokens,
                                              uint64_t seed, int64_t ttl_seconds = 0);

// Every page and summary write of the document described by `request`.
void MakeDocumentWrites(const v1::CreateDocumentRequest& request, uint64_t seed,
                        std::vector<PageWrite>* pages, std::vector<SummaryWrite>* summaries);

}  // namespace strata::kvstore::testing

#endif  // STRATA_KVSTORE_TESTING_TEST_PAGES_H_
