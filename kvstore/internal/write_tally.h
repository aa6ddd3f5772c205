// Which index entries (pages and summaries) of one WRITING document a LocalStore has written and
// acknowledged since it created the document: one bit per possible entry, set after the write that
// stored it returned OK, and a count of distinct bits set. FinalizeDocument takes a complete tally
// instead of counting the document's index entries in RocksDB, which after a prefill of ingested
// batches means first reads of hundreds of small overlapping files (seconds per 256K-token shard on
// the H100 machine; bench/RESULTS.md). A tally exists only for a document this store instance
// created, so it holds every write the document ever had; after a reopen there is none and
// FinalizeDocument counts.
//
// Keys must be inside the document (LocalStore checks them before writing). Thread-safe: bits are
// set with atomic ORs, so concurrent batches of one document count each entry once.
#ifndef STRATA_KVSTORE_INTERNAL_WRITE_TALLY_H_
#define STRATA_KVSTORE_INTERNAL_WRITE_TALLY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvstore/page_store.h"
#include "strata/v1/kvstore.pb.h"

namespace strata::kvstore::internal {

class WriteTally {
 public:
  // Largest tally kept (bits, pages and summaries together): 2^28 bits, 32 MiB (16M tokens of
  // 16-token pages on 32 layers x 8 KV heads). A larger
  // document gets none (Make returns null) and is counted at finalize.
  static constexpr uint64_t kMaxBits = uint64_t{1} << 28;

  // A tally for `doc` (its layout, num_pages and summary specs), or null when it would exceed
  // kMaxBits.
  static std::unique_ptr<WriteTally> Make(const v1::Document& doc);

  void AddPage(const PageKey& k);
  void AddSummary(const SummaryKey& k);  // the kind must be one of the document's

  uint64_t pages() const { return pages_.load(std::memory_order_relaxed); }
  uint64_t summaries() const { return summaries_.load(std::memory_order_relaxed); }

 private:
  struct Kind {
    uint32_t kind;
    uint64_t offset;  // of index 0 within one (layer, kv_head)'s summaries
  };
  WriteTally() = default;
  bool Set(uint64_t bit);  // true when the bit was clear

  uint32_t layers_ = 0, kv_heads_ = 0;
  uint64_t page_bits_ = 0, summaries_per_head_ = 0;
  std::vector<Kind> kinds_;
  std::unique_ptr<std::atomic<uint64_t>[]> words_;
  std::atomic<uint64_t> pages_{0}, summaries_{0};
};

}  // namespace strata::kvstore::internal

#endif  // STRATA_KVSTORE_INTERNAL_WRITE_TALLY_H_
