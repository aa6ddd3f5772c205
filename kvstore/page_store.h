// The page-store interface that every KV tier implements (DESIGN.md section 4), and the document
// catalog implemented by the durable tiers.
//
// Tiers: HostCache (byte-budgeted LRU in host memory), LocalStore (RocksDB), RemoteStore (client
// of the KV store service), and TieredStore, which chains them. A page is identified by
// (document, layer, kv_head, page_index); the document id already carries the model fingerprint
// and KV layout (kvstore/document_id.h). Page bytes are the page_format.h encoding; summaries are
// opaque bytes with a kind tag.
//
// Lookup semantics: Get* fill one entry per key, in key order; an entry is null when this tier
// does not hold it (a miss, not an error). A non-OK status means the whole call failed (e.g.
// DataLoss for a page whose checksum does not match, Unavailable for a lost connection).
// Put* return only when the batch is stored with the tier's guarantee (durable tiers: synced to
// the write-ahead log); a failed Put stores nothing of its batch.
//
// Implementations are thread-safe.
#ifndef STRATA_KVSTORE_PAGE_STORE_H_
#define STRATA_KVSTORE_PAGE_STORE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvstore/document_id.h"
#include "strata/v1/kvstore.pb.h"

namespace strata::kvstore {

struct PageKey {
  DocumentId document;
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  uint32_t page_index = 0;

  bool operator==(const PageKey& o) const {
    return document == o.document && layer == o.layer && kv_head == o.kv_head &&
           page_index == o.page_index;
  }
  template <typename H>
  friend H AbslHashValue(H h, const PageKey& k) {
    return H::combine(std::move(h), k.document.bytes, k.layer, k.kv_head, k.page_index);
  }
};

struct SummaryKey {
  DocumentId document;
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  uint32_t kind = 0;
  uint32_t index = 0;

  bool operator==(const SummaryKey& o) const {
    return document == o.document && layer == o.layer && kv_head == o.kv_head && kind == o.kind &&
           index == o.index;
  }
  template <typename H>
  friend H AbslHashValue(H h, const SummaryKey& k) {
    return H::combine(std::move(h), k.document.bytes, k.layer, k.kv_head, k.kind, k.index);
  }
};

// Where page buffers come from. The default uses new[]; the CUDA backend can supply pinned host
// memory. Implementations must be thread-safe.
class PageAllocator {
 public:
  virtual ~PageAllocator() = default;
  // Returns `bytes` of memory or nullptr when none is available.
  virtual void* Allocate(size_t bytes) = 0;
  virtual void Free(void* p, size_t bytes) = 0;
};
// The process-wide default allocator (operator new[]). Never null; never destroyed.
PageAllocator* DefaultPageAllocator();

// An immutable byte buffer holding one encoded page (or one summary payload), freed through the
// allocator it came from when the last reference goes away.
class PageBuffer {
 public:
  // Copies `bytes` into memory from `allocator` (default: DefaultPageAllocator()).
  // ResourceExhausted when the allocator returns nullptr.
  static absl::StatusOr<std::shared_ptr<const PageBuffer>> Copy(absl::string_view bytes,
                                                                PageAllocator* allocator = nullptr);
  // `bytes` of uninitialized memory from `allocator`, for the caller to fill through
  // mutable_data() before it shares the buffer (as a PageRef). ResourceExhausted as Copy.
  static absl::StatusOr<std::shared_ptr<PageBuffer>> Allocate(size_t bytes, PageAllocator* allocator = nullptr);
  // Takes `bytes` without copying them (e.g. a page of a received message); allocator() is null.
  static std::shared_ptr<const PageBuffer> Adopt(std::string bytes);
  ~PageBuffer();
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;

  const char* data() const { return data_; }
  char* mutable_data() { return data_; }
  size_t size() const { return size_; }
  absl::string_view view() const { return absl::string_view(data_, size_); }
  // The allocator the bytes came from; null for adopted bytes.
  PageAllocator* allocator() const { return allocator_; }

 private:
  PageBuffer(char* data, size_t size, PageAllocator* allocator)
      : data_(data), size_(size), allocator_(allocator) {}
  explicit PageBuffer(std::string bytes)
      : owned_(std::move(bytes)), data_(owned_.data()), size_(owned_.size()), allocator_(nullptr) {}
  std::string owned_;  // adopted bytes (Adopt), else empty
  char* data_;
  size_t size_;
  PageAllocator* allocator_;
};
using PageRef = std::shared_ptr<const PageBuffer>;

struct PageWrite {
  PageKey key;
  PageRef data;  // encoded page
};

struct SummaryWrite {
  SummaryKey key;
  PageRef data;  // summary payload (opaque)
};

class PageStore {
 public:
  virtual ~PageStore() = default;

  // The tier label used in metrics: "host", "disk", "remote", or "tiered".
  virtual const char* tier() const = 0;

  // Looks up pages; (*out)[i] is the page of keys[i] or null when this tier does not hold it.
  // Returned pages have passed their checksum. Errors as in the file comment.
  virtual absl::Status GetPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out) = 0;
  // Stores a batch of pages and summaries atomically (all or nothing). Durable tiers check the
  // pages against their document: NotFound (unknown document), FailedPrecondition (READY
  // document), InvalidArgument (wrong size, layout or index), DataLoss (bad checksum).
  virtual absl::Status Put(absl::Span<const PageWrite> pages,
                           absl::Span<const SummaryWrite> summaries) = 0;
  // Put for a document being written (WRITING), whose pages matter only once it is READY: a
  // durable tier may keep the batch in memory only (LocalStore: no write-ahead log) until the
  // document's FinalizeDocument, which makes every such batch durable before the document becomes
  // READY. A crash before that may lose deferred batches; the document then stays WRITING with
  // those pages (and their index entries) missing, so it cannot be finalized until they are
  // written again. Errors as Put. The default is Put.
  virtual absl::Status PutDeferred(absl::Span<const PageWrite> pages,
                                   absl::Span<const SummaryWrite> summaries) {
    return Put(pages, summaries);
  }
  // Looks up summaries; (*out)[i] is the payload of keys[i] or null.
  virtual absl::Status GetSummaries(absl::Span<const SummaryKey> keys,
                                    std::vector<PageRef>* out) = 0;
};

// Documents: lifecycle of the durable tiers (LocalStore, RemoteStore). Document metadata is the
// strata.v1.Document message. Thread-safe.
class DocumentCatalog {
 public:
  virtual ~DocumentCatalog() = default;

  // Creates a WRITING document, or returns the existing one with *created = false.
  // InvalidArgument: malformed request; FailedPrecondition: an existing document with the same id
  // but a different layout or length.
  virtual absl::StatusOr<v1::Document> CreateDocument(const v1::CreateDocumentRequest& request,
                                                      bool* created) = 0;
  // WRITING -> READY once every page and summary is stored (durably). FailedPrecondition with the
  // missing counts otherwise; NotFound for an unknown document. READY stays READY (idempotent).
  virtual absl::StatusOr<v1::Document> FinalizeDocument(const DocumentId& id) = 0;
  // The document with stored_pages / stored_summaries filled. NotFound.
  virtual absl::StatusOr<v1::Document> GetDocument(const DocumentId& id) = 0;
  // The document without the stored counts (left 0): its state, layout and length for callers that
  // need nothing else (a job starting on a READY document). Counting scans the document's index,
  // a cost that grows with the document (about 0.2 s for the 1M index entries of a 128K-token
  // 8B-shape document); this does not. NotFound.
  virtual absl::StatusOr<v1::Document> GetDocumentInfo(const DocumentId& id) = 0;
  virtual absl::StatusOr<std::vector<v1::Document>> ListDocuments(
      const v1::ListDocumentsRequest& request) = 0;
  // Sets `pinned` and, for ttl_seconds > 0, expire_time = now + ttl. NotFound.
  virtual absl::StatusOr<v1::Document> PinDocument(const DocumentId& id, bool pinned,
                                                   int64_t ttl_seconds) = 0;
  // Deletes the document with all its pages and summaries. NotFound.
  virtual absl::Status DeleteDocument(const DocumentId& id) = 0;
};

// Conversions between the C++ layout and the wire form. FromProto: InvalidArgument when invalid.
v1::KvLayout LayoutToProto(const KvLayout& layout);
absl::StatusOr<KvLayout> LayoutFromProto(const v1::KvLayout& layout);

}  // namespace strata::kvstore

#endif  // STRATA_KVSTORE_PAGE_STORE_H_
