// Paged KV cache of one sequence (document + prompt + generated tokens).
//
// Layout (DESIGN.md section 2): a page holds `page_size` consecutive tokens of one layer and one
// KV head, K [page_size, head_dim] and V [page_size, head_dim]. Each layer has one pool of page
// slots in backend memory, k_pool / v_pool [num_slots, page_size, head_dim] of `dtype`; page p of
// KV head g of a layer lives in slot SlotOf(layer, g, p). Keys are stored after RoPE.
//
// Tokens are appended in order, layer by layer: Append(layer, ...) for tokens
// [length(layer), length(layer) + n). Pages fill from the front; a page is "full" when it holds
// page_size tokens. Thread-compatible.
#ifndef STRATA_ENGINE_KV_CACHE_H_
#define STRATA_ENGINE_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace strata::engine {

struct KvCacheOptions {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  // Tokens per page. Default: 64 (see bench/RESULTS.md, fidelity).
  int page_size = 64;
  // Storage dtype of K and V: f32 (exact reference), bf16, or fp8_e4m3 (kernels/backend.h "fp8 KV
  // pools": x / scale rounded to e4m3, as AppendKv writes it, with the per-tensor scales below;
  // attention, the device policy and the host sparse policies read it).
  kernels::DType dtype = kernels::DType::kF32;
  // Capacity in tokens; pools are allocated for it up front. ResourceExhausted beyond it.
  int64_t max_tokens = 0;
  // fp8 only: the dequantisation scales of K and V (stored * scale is the value; finite, > 0;
  // 1 for f32|bf16). 1 covers |x| <= 448 (e4m3's largest), as vLLM's default fp8 KV cache.
  float k_scale = 1.0f;
  float v_scale = 1.0f;

  absl::Status Validate() const;
};

class KvCache {
 public:
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheOptions& options,
                                                         kernels::Backend* backend);
  ~KvCache();

  const KvCacheOptions& options() const { return options_; }
  // A number no other KvCache of this process has had (for keying state tied to this cache's
  // lifetime, e.g. Transformer's decode graphs: addresses may be reused by a later cache).
  uint64_t id() const { return id_; }
  // Tokens stored in `layer`.
  int64_t length(int layer) const { return lengths_[layer]; }
  int64_t num_pages(int layer) const;  // pages touched: ceil(length / page_size)

  // Appends n tokens to `layer`. k, v: [n, num_kv_heads, head_dim] f32 in backend memory.
  // ResourceExhausted past max_tokens; InvalidArgument on shape mismatch.
  // On a device backend (not "cpu") the rows go straight into the pools with Backend::AppendKv
  // (one kernel, stream-ordered, no host copy). When the backend lacks AppendKv: the rows are
  // read back in one synchronous copy when v directly follows k in memory (two otherwise); the
  // pages the append ends in are then written with one asynchronous PageCopy from a pinned mirror
  // of each KV head's last page (queued on the default stream, no further synchronisation);
  // pages the append fills and leaves are written with synchronous copies as before. The next
  // Append of the same layer (whose read-back waits for the stream) is what makes the mirror safe
  // to rewrite.
  absl::Status Append(int layer, const kernels::TensorView& k, const kernels::TensorView& v);

  // Appends n tokens to `layer` from whole pages in the PageCopy staging layout of the cache's
  // dtype (kernels::PageCopyParams: K [page_size, head_dim] then V, PageCopyBytes apart): staging
  // page j * num_kv_heads + g is page length(layer) / page_size + j of KV head g, for j <
  // ceil(n / page_size); rows of the last page past n should be zero (a stored page's are). One
  // Backend::PageCopy on the default stream, no conversion: the bulk load of stored pages
  // (worker mounts), in place of Append's per-row path. `staging` (at least `staging_bytes` =
  // pages * num_kv_heads * PageCopyBytes) and `slots` (pages * num_kv_heads int32, written here)
  // are AllocateHost memory that the caller keeps unchanged until the copy has run (e.g. until
  // Backend::Synchronize(nullptr)). InvalidArgument when length(layer) is not a whole number of
  // pages, n < 0 or the staging is short; ResourceExhausted past max_tokens.
  absl::Status AppendPages(int layer, int64_t n, const void* staging, size_t staging_bytes,
                           int32_t* slots);

  // Graph mode (TransformerOptions::decode_graph): queues on the default stream the append of one
  // token's rows k, v ([1, num_kv_heads, head_dim] f32, backend memory) to `layer` with
  // Backend::AppendKv, the token's cache index read from *index_device (backend memory) when the
  // kernel runs; changes nothing on the host, so the launch can be captured in a graph and
  // replayed. After each run, CommitAppend(1) records the token. `rope` (AppendKvParams::rope),
  // when its inv_freq is set, rotates k on the way in and its x (the token's queries) in place.
  // Unimplemented when the backend lacks AppendKv (the CPU backend); InvalidArgument for a bad
  // layer or shape.
  absl::Status EnqueueAppendAt(int layer, const kernels::TensorView& k,
                               const kernels::TensorView& v, const int32_t* index_device,
                               const kernels::RopeParams& rope = {});
  // Records n tokens appended to every layer outside Append (by EnqueueAppendAt launches that have
  // run). ResourceExhausted (nothing changed) past max_tokens.
  absl::Status CommitAppend(int64_t n);
  // Pages per KV head: slots of KV head g are g * pages_per_head() + [0, pages_per_head()).
  int64_t pages_per_head() const { return pages_per_head_; }

  // [num_slots, page_size, head_dim] views of the layer's pools.
  kernels::TensorView k_pool(int layer) const;
  kernels::TensorView v_pool(int layer) const;
  int32_t SlotOf(int layer, int kv_head, int64_t page) const;
  // The page table of every layer (slots do not depend on the layer): [num_kv_heads, width] i32,
  // entry (g, p) = SlotOf(layer, g, p) for p < pages_per_head(), -1 beyond (width may exceed the
  // cache's pages, e.g. a table sized for a larger cache; columns past width are dropped).
  std::vector<int32_t> PageTable(int64_t width) const;

  // Appends to `spans` the spans covering tokens [begin, end) of `kv_head` (page by page).
  void AppendSpans(int layer, int kv_head, int64_t begin, int64_t end,
                   std::vector<kernels::KvSpan>* spans) const;

 private:
  KvCache(const KvCacheOptions& options, kernels::Backend* backend);
  // One row of head_dim f32 values to its storage form at dst (fp8: x / scale as e4m3).
  void StoreRow(const float* x, float scale, char* dst);

  KvCacheOptions options_;
  kernels::Backend* backend_;
  uint64_t id_;
  int64_t pages_per_head_ = 0;  // ceil(max_tokens / page_size)
  std::vector<int64_t> lengths_;
  std::vector<std::unique_ptr<kernels::Buffer>> k_pools_, v_pools_;
  // Device backends: per (layer, KV head) a copy of the head's last page in the PageCopy staging
  // layout (K then V, pool dtype), and the slot of that page; AllocateHost memory. Null on the
  // CPU backend (or if AllocateHost failed: then every page goes through synchronous copies).
  std::unique_ptr<kernels::Buffer> tail_pages_, tail_slots_;
  size_t tail_page_bytes_ = 0;  // kernels::PageCopyBytes(page_size, head_dim, dtype)
  bool device_append_ = true;  // Backend::AppendKv not yet found Unimplemented
  std::vector<float> host_rows_;  // read-back of the appended K and V rows
  std::vector<uint8_t> stage_k_, stage_v_;  // converted rows of one page run (synchronous path)
  std::vector<float> scaled_row_;  // StoreRow's x / scale for fp8 with a scale other than 1
};

}  // namespace strata::engine

#endif  // STRATA_ENGINE_KV_CACHE_H_
