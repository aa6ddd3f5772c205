// Transformer forward; see engine/transformer.h.
#include "engine/transformer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "engine/sparse/device_policy.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::engine {

namespace {
std::atomic<uint64_t> next_external_attention_id{1};
}  // namespace

ExternalAttention::ExternalAttention() : instance_id_(next_external_attention_id.fetch_add(1)) {}

using kernels::DType;
using kernels::TensorView;

absl::Status TransformerOptions::Validate() const {
  if (prefill_chunk_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_chunk_size must be >= 1, got ", prefill_chunk_size));
  }
  if (matmul_precision != kernels::MatMulPrecision::kSplit &&
      matmul_precision != kernels::MatMulPrecision::kRoundActivations) {
    return absl::InvalidArgumentError(absl::StrCat("unknown matmul_precision ",
                                                   static_cast<int>(matmul_precision)));
  }
  if (weight_format != WeightFormat::kCheckpoint && weight_format != WeightFormat::kFP8) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown weight_format ", static_cast<int>(weight_format)));
  }
  return absl::OkStatus();
}

absl::StatusOr<WeightFormat> ParseWeightFormat(absl::string_view name) {
  if (name == "checkpoint") return WeightFormat::kCheckpoint;
  if (name == "fp8") return WeightFormat::kFP8;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown weight format '", name, "' (want checkpoint or fp8)"));
}

const char* WeightFormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kCheckpoint:
      return "checkpoint";
    case WeightFormat::kFP8:
      return "fp8";
  }
  return "unknown";
}

absl::StatusOr<kernels::MatMulPrecision> ParseMatMulPrecision(absl::string_view name) {
  if (name == "split") return kernels::MatMulPrecision::kSplit;
  if (name == "bf16") return kernels::MatMulPrecision::kRoundActivations;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown matmul precision '", name, "' (want split or bf16)"));
}

const char* MatMulPrecisionName(kernels::MatMulPrecision p) {
  switch (p) {
    case kernels::MatMulPrecision::kSplit:
      return "split";
    case kernels::MatMulPrecision::kRoundActivations:
      return "bf16";
  }
  return "unknown";
}

namespace {

absl::Status CheckShape(const TensorView& v, std::initializer_list<int64_t> dims,
                        const std::string& name) {
  bool ok = v.data != nullptr && v.rank == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) {
    if (ok && v.shape[i] != d) ok = false;
    ++i;
  }
  if (!ok) {
    std::string want;
    for (int64_t d : dims) absl::StrAppend(&want, want.empty() ? "" : ",", d);
    return absl::InvalidArgumentError(
        absl::StrCat("weight ", name, " is ", v.DebugString(), ", expected [", want, "]"));
  }
  return absl::OkStatus();
}

TensorView View2(kernels::Buffer* b, int64_t rows, int64_t cols, DType t = DType::kF32) {
  return TensorView(b->data(), t, {rows, cols});
}

}  // namespace

Transformer::Transformer(const model::ModelConfig& config, const TransformerOptions& options,
                         kernels::Backend* backend)
    : config_(config), options_(options), backend_(backend), host_memory_(backend->Name() == "cpu") {}

Transformer::~Transformer() {
  // Marks still pending end with the backend; waiting here keeps the step slots' copies done.
  for (const int64_t m : step_mark_) {
    if (m >= 0) backend_->WaitMark(m).IgnoreError();
  }
}

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::Create(
    const model::ModelConfig& config, const model::ModelWeights& weights,
    kernels::Backend* backend, const TransformerOptions& options) {
  if (backend == nullptr) return absl::InvalidArgumentError("Transformer: null backend");
  STRATA_RETURN_IF_ERROR(config.Validate());
  STRATA_RETURN_IF_ERROR(options.Validate());
  std::unique_ptr<Transformer> t(new Transformer(config, options, backend));
  STRATA_RETURN_IF_ERROR(t->Init(weights));
  return t;
}

absl::Status Transformer::MatMul(kernels::MatMulParams p, const TensorView& weight_scale) {
  p.precision = options_.matmul_precision;
  p.weight_scale = weight_scale;
  return backend_->MatMul(p, nullptr);
}

absl::Status Transformer::QuantizeForUpload(TensorView* w, TensorView* scale) {
  *scale = TensorView();
  if (options_.weight_format != WeightFormat::kFP8 || w->data == nullptr) return absl::OkStatus();
  const int64_t rows = w->dim(0), cols = w->dim(1);
  std::vector<uint8_t>& q = host_quantized_.emplace_back(static_cast<size_t>(rows * cols));
  std::vector<uint8_t>& sc = host_quantized_.emplace_back(static_cast<size_t>(rows) * 4);
  kernels::QuantizeRowsToFP8E4M3(w->data, w->dtype, rows, cols, q.data(),
                                 reinterpret_cast<float*>(sc.data()));
  *w = TensorView(q.data(), DType::kFP8E4M3, {rows, cols});
  *scale = TensorView(sc.data(), DType::kF32, {rows});
  return absl::OkStatus();
}

absl::Status Transformer::UploadScales(const std::vector<const TensorView*>& parts,
                                       const std::vector<TensorView*>& outs, bool matrices_fused,
                                       TensorView* fused) {
  *fused = TensorView();
  if (matrices_fused && parts[0]->data != nullptr) {
    STRATA_ASSIGN_OR_RETURN(const bool done, UploadFused(parts, outs, fused));
    if (!done) return absl::InternalError("the row scales of a fused matrix could not be fused");
    return absl::OkStatus();
  }
  for (size_t i = 0; i < parts.size(); ++i) STRATA_RETURN_IF_ERROR(Upload(*parts[i], outs[i]));
  return absl::OkStatus();
}

absl::Status Transformer::Upload(const TensorView& host, TensorView* out) {
  if (host.data == nullptr) {
    *out = host;
    return absl::OkStatus();
  }
  if (host_memory_) {
    *out = host;
    return absl::OkStatus();
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> buf, backend_->Allocate(host.Bytes()));
  STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(buf->data(), host.data, host.Bytes(), nullptr));
  *out = host;
  out->data = buf->data();
  weight_buffers_.push_back(std::move(buf));
  return absl::OkStatus();
}

absl::StatusOr<bool> Transformer::UploadFused(const std::vector<const TensorView*>& parts,
                                              const std::vector<TensorView*>& outs,
                                              TensorView* fused) {
  if (host_memory_ || parts.empty()) return false;
  const TensorView& first = *parts[0];
  if (first.rank < 1 || first.rank > 2) return false;
  int64_t rows = 0;
  for (const TensorView* p : parts) {
    if (p->data == nullptr || p->dtype != first.dtype || p->rank != first.rank ||
        (p->rank == 2 && p->dim(1) != first.dim(1))) {
      return false;
    }
    rows += p->dim(0);
  }
  size_t bytes = 0;
  for (const TensorView* p : parts) bytes += p->Bytes();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> buf, backend_->Allocate(bytes));
  char* at = static_cast<char*>(buf->data());
  for (size_t i = 0; i < parts.size(); ++i) {
    STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(at, parts[i]->data, parts[i]->Bytes(), nullptr));
    *outs[i] = *parts[i];
    outs[i]->data = at;
    at += parts[i]->Bytes();
  }
  *fused = first;
  fused->data = buf->data();
  fused->shape[0] = rows;
  weight_buffers_.push_back(std::move(buf));
  return true;
}

absl::Status Transformer::Init(const model::ModelWeights& w) {
  const int64_t hidden = config_.hidden_size, vocab = config_.vocab_size;
  const int64_t qdim = config_.num_heads * config_.head_dim;
  const int64_t kvdim = config_.num_kv_heads * config_.head_dim;
  const int64_t ffn = config_.intermediate_size;
  STRATA_RETURN_IF_ERROR(CheckShape(w.embed_tokens, {vocab, hidden}, "embed_tokens"));
  STRATA_RETURN_IF_ERROR(CheckShape(w.final_norm, {hidden}, "final_norm"));
  STRATA_RETURN_IF_ERROR(CheckShape(w.lm_head, {vocab, hidden}, "lm_head"));
  if (static_cast<int64_t>(w.layers.size()) != config_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("weights have ", w.layers.size(),
                                                   " layers, config ", config_.num_layers));
  }
  const bool fp8 = options_.weight_format == WeightFormat::kFP8;
  // Host quantised copies are dropped once uploaded (a host-memory backend reads them in place).
  auto drop_host_quantized = [&] {
    if (!host_memory_) host_quantized_.clear();
  };
  STRATA_RETURN_IF_ERROR(Upload(w.embed_tokens, &embed_tokens_));
  STRATA_RETURN_IF_ERROR(Upload(w.final_norm, &final_norm_));
  if (w.lm_head.data == w.embed_tokens.data && !fp8) {
    lm_head_ = embed_tokens_;  // tied: upload once
  } else {
    TensorView head = w.lm_head, head_scale;  // fp8: its own quantised copy even when tied
    STRATA_RETURN_IF_ERROR(QuantizeForUpload(&head, &head_scale));
    STRATA_RETURN_IF_ERROR(Upload(head, &lm_head_));
    STRATA_RETURN_IF_ERROR(Upload(head_scale, &lm_head_scale_));
    drop_host_quantized();
  }
  layers_.resize(w.layers.size());
  scales_.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    model::LayerWeights s = w.layers[l];  // views; the matrices become fp8 ones with kFP8
    model::LayerWeights& d = layers_[l];
    LayerScales& ds = scales_[l];
    const std::string p = absl::StrCat("layers.", l, ".");
    STRATA_RETURN_IF_ERROR(CheckShape(s.input_norm, {hidden}, p + "input_norm"));
    STRATA_RETURN_IF_ERROR(CheckShape(s.q_proj, {qdim, hidden}, p + "q_proj"));
    STRATA_RETURN_IF_ERROR(CheckShape(s.k_proj, {kvdim, hidden}, p + "k_proj"));
    STRATA_RETURN_IF_ERROR(CheckShape(s.v_proj, {kvdim, hidden}, p + "v_proj"));
    STRATA_RETURN_IF_ERROR(CheckShape(s.o_proj, {hidden, qdim}, p + "o_proj"));
    STRATA_RETURN_IF_ERROR(CheckShape(s.post_attention_norm, {hidden}, p + "post_attention_norm"));
    STRATA_RETURN_IF_ERROR(CheckShape(s.gate_proj, {ffn, hidden}, p + "gate_proj"));
    STRATA_RETURN_IF_ERROR(CheckShape(s.up_proj, {ffn, hidden}, p + "up_proj"));
    STRATA_RETURN_IF_ERROR(CheckShape(s.down_proj, {hidden, ffn}, p + "down_proj"));
    if (config_.attention_bias) {
      STRATA_RETURN_IF_ERROR(CheckShape(s.q_bias, {qdim}, p + "q_bias"));
      STRATA_RETURN_IF_ERROR(CheckShape(s.k_bias, {kvdim}, p + "k_bias"));
      STRATA_RETURN_IF_ERROR(CheckShape(s.v_bias, {kvdim}, p + "v_bias"));
    }
    LayerScales hs;  // host scales (kFP8)
    STRATA_RETURN_IF_ERROR(QuantizeForUpload(&s.q_proj, &hs.q));
    STRATA_RETURN_IF_ERROR(QuantizeForUpload(&s.k_proj, &hs.k));
    STRATA_RETURN_IF_ERROR(QuantizeForUpload(&s.v_proj, &hs.v));
    STRATA_RETURN_IF_ERROR(QuantizeForUpload(&s.o_proj, &hs.o));
    STRATA_RETURN_IF_ERROR(QuantizeForUpload(&s.gate_proj, &hs.gate));
    STRATA_RETURN_IF_ERROR(QuantizeForUpload(&s.up_proj, &hs.up));
    STRATA_RETURN_IF_ERROR(QuantizeForUpload(&s.down_proj, &hs.down));
    STRATA_RETURN_IF_ERROR(Upload(s.input_norm, &d.input_norm));
    FusedWeights& f = fused_.emplace_back();
    bool qkv_fused = false;
    if (!config_.attention_bias ||
        (s.q_bias.dtype == s.k_bias.dtype && s.q_bias.dtype == s.v_bias.dtype)) {
      STRATA_ASSIGN_OR_RETURN(qkv_fused, UploadFused({&s.q_proj, &s.k_proj, &s.v_proj},
                                                     {&d.q_proj, &d.k_proj, &d.v_proj}, &f.qkv));
    }
    STRATA_RETURN_IF_ERROR(
        UploadScales({&hs.q, &hs.k, &hs.v}, {&ds.q, &ds.k, &ds.v}, qkv_fused, &f.qkv_scale));
    if (!qkv_fused) {
      f.qkv = TensorView();
      STRATA_RETURN_IF_ERROR(Upload(s.q_proj, &d.q_proj));
      STRATA_RETURN_IF_ERROR(Upload(s.k_proj, &d.k_proj));
      STRATA_RETURN_IF_ERROR(Upload(s.v_proj, &d.v_proj));
    }
    if (config_.attention_bias) {
      bool bias_fused = false;
      if (qkv_fused) {
        STRATA_ASSIGN_OR_RETURN(bias_fused,
                                UploadFused({&s.q_bias, &s.k_bias, &s.v_bias},
                                            {&d.q_bias, &d.k_bias, &d.v_bias}, &f.qkv_bias));
      }
      if (!bias_fused) {
        f.qkv = TensorView();  // the fused matrix is still what q/k/v_proj view; just unused
        f.qkv_bias = TensorView();
        STRATA_RETURN_IF_ERROR(Upload(s.q_bias, &d.q_bias));
        STRATA_RETURN_IF_ERROR(Upload(s.k_bias, &d.k_bias));
        STRATA_RETURN_IF_ERROR(Upload(s.v_bias, &d.v_bias));
      }
    }
    STRATA_RETURN_IF_ERROR(Upload(s.o_proj, &d.o_proj));
    STRATA_RETURN_IF_ERROR(Upload(hs.o, &ds.o));
    STRATA_RETURN_IF_ERROR(Upload(s.post_attention_norm, &d.post_attention_norm));
    STRATA_ASSIGN_OR_RETURN(const bool gu_fused,
                            UploadFused({&s.gate_proj, &s.up_proj}, {&d.gate_proj, &d.up_proj},
                                        &f.gate_up));
    STRATA_RETURN_IF_ERROR(
        UploadScales({&hs.gate, &hs.up}, {&ds.gate, &ds.up}, gu_fused, &f.gate_up_scale));
    if (!gu_fused) {
      f.gate_up = TensorView();
      STRATA_RETURN_IF_ERROR(Upload(s.gate_proj, &d.gate_proj));
      STRATA_RETURN_IF_ERROR(Upload(s.up_proj, &d.up_proj));
    }
    STRATA_RETURN_IF_ERROR(Upload(s.down_proj, &d.down_proj));
    STRATA_RETURN_IF_ERROR(Upload(hs.down, &ds.down));
    drop_host_quantized();
  }

  // Scratch for one chunk.
  const int64_t c = options_.prefill_chunk_size;
  auto alloc = [&](std::unique_ptr<kernels::Buffer>* b, int64_t elems) -> absl::Status {
    STRATA_ASSIGN_OR_RETURN(*b, backend_->Allocate(static_cast<size_t>(elems) * 4));
    return absl::OkStatus();
  };
  STRATA_RETURN_IF_ERROR(alloc(&x_, c * hidden));
  STRATA_RETURN_IF_ERROR(alloc(&xn_, c * hidden));
  STRATA_RETURN_IF_ERROR(alloc(&qkv_, c * (qdim + 2 * kvdim)));
  STRATA_RETURN_IF_ERROR(alloc(&attn_, c * qdim));
  STRATA_RETURN_IF_ERROR(alloc(&lse_, c * config_.num_heads));
  STRATA_RETURN_IF_ERROR(alloc(&o_, c * hidden));
  STRATA_RETURN_IF_ERROR(alloc(&gate_up_, 2 * c * ffn));
  STRATA_RETURN_IF_ERROR(alloc(&ids_, c));
  STRATA_RETURN_IF_ERROR(alloc(&pos_, c));
  const std::vector<float> inv_freq = config_.RopeInvFreq();
  if (static_cast<int64_t>(inv_freq.size()) != config_.head_dim / 2) {
    return absl::InvalidArgumentError("RopeInvFreq has the wrong length");
  }
  STRATA_RETURN_IF_ERROR(alloc(&inv_freq_buf_, config_.head_dim / 2));
  STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(inv_freq_buf_->data(), inv_freq.data(),
                                                inv_freq.size() * 4, nullptr));
  inv_freq_ = TensorView(inv_freq_buf_->data(), DType::kF32, {config_.head_dim / 2});
  return absl::OkStatus();
}

KvCacheOptions Transformer::MakeCacheOptions(int64_t max_tokens, int page_size,
                                             kernels::DType dtype) const {
  KvCacheOptions o;
  o.num_layers = static_cast<int>(config_.num_layers);
  o.num_kv_heads = static_cast<int>(config_.num_kv_heads);
  o.head_dim = static_cast<int>(config_.head_dim);
  o.page_size = page_size;
  o.dtype = dtype;
  o.max_tokens = max_tokens;
  return o;
}

absl::Status Transformer::Forward(const int32_t* ids, int64_t n, int64_t start_pos,
                                  KvCache* cache, AttentionPolicy* policy, float* logits_out,
                                  bool all_logits) {
  return Forward(ids, n, start_pos, cache, policy, logits_out, all_logits, ForwardOptions());
}

absl::Status Transformer::Forward(const int32_t* ids, int64_t n, int64_t start_pos,
                                  KvCache* cache, AttentionPolicy* policy, float* logits_out,
                                  bool all_logits, const ForwardOptions& fo) {
  if (fo.cache_first_position < 0 || fo.cache_first_position > start_pos) {
    return absl::InvalidArgumentError(absl::StrCat("Forward: cache_first_position ",
                                                   fo.cache_first_position, " not in [0, ",
                                                   start_pos, "]"));
  }
  if (fo.device_token != nullptr && n != 1) {
    return absl::InvalidArgumentError("Forward: device_token is for one-token calls");
  }
  if (n < 1 || (ids == nullptr && fo.device_token == nullptr) ||
      (logits_out == nullptr && !fo.logits_on_device)) {
    return absl::InvalidArgumentError("Forward: needs n >= 1 tokens, ids and logits_out");
  }
  if (fo.logits_on_device && all_logits) {
    return absl::InvalidArgumentError("Forward: logits_on_device keeps the last row only");
  }
  if (cache == nullptr || policy == nullptr) {
    return absl::InvalidArgumentError("Forward: null cache or policy");
  }
  const KvCacheOptions& co = cache->options();
  if (co.num_layers != config_.num_layers || co.num_kv_heads != config_.num_kv_heads ||
      co.head_dim != config_.head_dim) {
    return absl::InvalidArgumentError("Forward: the KV cache does not match the model shape");
  }
  for (int l = 0; l < co.num_layers; ++l) {
    if (cache->length(l) != start_pos - fo.cache_first_position) {
      return absl::InvalidArgumentError(absl::StrCat("Forward: start_pos ", start_pos,
                                                     " but layer ", l, " caches ",
                                                     cache->length(l), " tokens from position ",
                                                     fo.cache_first_position));
    }
  }
  if (start_pos + n > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("Forward: positions beyond int32");
  }
  int32_t device_id = -1;
  if (fo.device_token != nullptr) {
    // The replayed graph reads the id on the device; any other path needs it on the host.
    if (options_.decode_graph) {
      STRATA_ASSIGN_OR_RETURN(const bool done,
                              ForwardGraphStep(-1, start_pos, cache, policy, logits_out, fo));
      if (done) return absl::OkStatus();
    }
    STRATA_RETURN_IF_ERROR(
        backend_->CopyToHost(&device_id, fo.device_token, sizeof(device_id), nullptr));
    ids = &device_id;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("Forward: token id ", ids[i], " at ", i,
                                                     " is outside [0, ", config_.vocab_size, ")"));
    }
  }
  if (options_.decode_graph && n == 1 && fo.device_token == nullptr) {
    STRATA_ASSIGN_OR_RETURN(const bool done,
                            ForwardGraphStep(ids[0], start_pos, cache, policy, logits_out, fo));
    if (done) return absl::OkStatus();
  }
  const int64_t chunk = options_.prefill_chunk_size;
  const int64_t vocab = config_.vocab_size;
  for (int64_t b = 0; b < n; b += chunk) {
    const int64_t m = std::min(chunk, n - b);
    const bool last = b + m == n;
    if (!all_logits && !last) {
      ForwardOptions no_logits = fo;  // no logits for this chunk, not even on the device
      no_logits.logits_on_device = false;
      STRATA_RETURN_IF_ERROR(
          ForwardChunk(ids + b, m, start_pos + b, cache, policy, nullptr, false, no_logits));
    } else {
      STRATA_RETURN_IF_ERROR(ForwardChunk(ids + b, m, start_pos + b, cache, policy,
                                          all_logits ? logits_out + b * vocab : logits_out,
                                          all_logits, fo));
    }
  }
  return absl::OkStatus();
}

absl::Status Transformer::HostStaging::Reserve(kernels::Backend* be, size_t floats) {
  if (!plain_only_ && (pinned_ == nullptr || pinned_->bytes() < floats * 4)) {
    pinned_.reset();
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> pinned = be->AllocateHost(floats * 4);
    if (pinned.ok()) {
      pinned_ = *std::move(pinned);
    } else {
      plain_only_ = true;
      STRATA_LOG(WARNING) << "Transformer: no pinned host staging (" << pinned.status()
                          << "); copies between the host and the backend wait";
    }
  }
  if (plain_only_ && plain_.size() < floats) plain_.resize(floats);
  return absl::OkStatus();
}

absl::StatusOr<bool> Transformer::HostStaging::CopyIn(kernels::Backend* be, void* dst, size_t from, size_t n) {
  if (pinned_ == nullptr) {
    STRATA_RETURN_IF_ERROR(be->CopyToDevice(dst, plain_.data() + from, n * 4, nullptr));
    return false;
  }
  STRATA_RETURN_IF_ERROR(be->CopyToDeviceAsync(dst, data() + from, n * 4, nullptr));
  return true;
}

absl::Status Transformer::HostStaging::CopyOut(kernels::Backend* be, const void* src, size_t n) {
  if (pinned_ == nullptr) return be->CopyToHost(plain_.data(), src, n * 4, nullptr);
  STRATA_RETURN_IF_ERROR(be->CopyToHostAsync(data(), src, n * 4, nullptr));
  return be->Synchronize(nullptr);
}

absl::Status Transformer::MergeExternal(int64_t row0, int64_t n,
                                        const std::vector<AttentionPartial>& parts, bool* staged) {
  kernels::Backend* be = backend_;
  const int64_t hq = config_.num_heads, d = config_.head_dim;
  const size_t o_elems = static_cast<size_t>(n * hq * d), l_elems = static_cast<size_t>(n * hq);
  const size_t max_o = static_cast<size_t>(options_.prefill_chunk_size * hq * d);
  const size_t max_l = static_cast<size_t>(options_.prefill_chunk_size * hq);
  for (size_t i = 0; i < parts.size(); ++i) {
    const AttentionPartial& p = parts[i];
    if (p.o.size() != o_elems || p.lse.size() != l_elems) {
      return absl::InvalidArgumentError(absl::StrCat("Forward: external partial ", i, " has ",
                                                     p.o.size(), "/", p.lse.size(),
                                                     " values, expected ", o_elems, "/", l_elems));
    }
  }
  float* attn_rows = static_cast<float*>(attn_->data()) + row0 * hq * d;
  float* lse_rows = static_cast<float*>(lse_->data()) + row0 * hq;
  std::vector<TensorView> outs, lses;
  outs.emplace_back(attn_rows, DType::kF32, std::initializer_list<int64_t>{n, hq, d});
  lses.emplace_back(lse_rows, DType::kF32, std::initializer_list<int64_t>{n, hq});
  if (host_memory_) {
    for (const AttentionPartial& p : parts) {
      outs.emplace_back(const_cast<float*>(p.o.data()), DType::kF32, std::initializer_list<int64_t>{n, hq, d});
      lses.emplace_back(const_cast<float*>(p.lse.data()), DType::kF32, std::initializer_list<int64_t>{n, hq});
    }
  } else if (!parts.empty()) {
    const int64_t num_parts = static_cast<int64_t>(parts.size());
    if (row0 + n > part_rows_cap_ || num_parts > part_cap_) {
      // Grown: nothing queued may still read the old buffers.
      STRATA_RETURN_IF_ERROR(be->Synchronize(nullptr));
      if (part_mark_ >= 0) STRATA_RETURN_IF_ERROR(be->WaitMark(std::exchange(part_mark_, -1)));
      part_dev_.reset();
      // Rows grow by doubling (up to a chunk), so a batch that gains a row at a time regrows rarely.
      part_rows_cap_ = std::max(row0 + n, std::min<int64_t>(2 * part_rows_cap_, options_.prefill_chunk_size));
      part_cap_ = std::max(num_parts, part_cap_);
      const size_t floats = static_cast<size_t>(part_rows_cap_ * part_cap_ * (hq * d + hq));
      STRATA_RETURN_IF_ERROR(part_host_.Reserve(be, floats));
      STRATA_ASSIGN_OR_RETURN(part_dev_, be->Allocate(floats * 4));
    }
    // This call's rows: every part's o rows, then its lse rows, packed; one copy.
    const size_t region = static_cast<size_t>(row0 * part_cap_ * (hq * d + hq));
    float* host = part_host_.data() + region;
    float* dev = static_cast<float*>(part_dev_->data()) + region;
    size_t at = 0;
    for (const AttentionPartial& p : parts) {
      std::memcpy(host + at, p.o.data(), o_elems * 4);
      std::memcpy(host + at + o_elems, p.lse.data(), l_elems * 4);
      outs.emplace_back(dev + at, DType::kF32, std::initializer_list<int64_t>{n, hq, d});
      lses.emplace_back(dev + at + o_elems, DType::kF32, std::initializer_list<int64_t>{n, hq});
      at += o_elems + l_elems;
    }
    STRATA_ASSIGN_OR_RETURN(const bool queued, part_host_.CopyIn(be, dev, region, at));
    if (queued && staged != nullptr) *staged = true;
  }
  if (merged_ == nullptr) {
    STRATA_ASSIGN_OR_RETURN(merged_, be->Allocate(max_o * 4));
    STRATA_ASSIGN_OR_RETURN(merged_lse_, be->Allocate(max_l * 4));
  }
  kernels::MergeAttentionParams mp;
  mp.outs = outs.data();
  mp.lses = lses.data();
  mp.num_parts = static_cast<int>(outs.size());
  mp.out = TensorView(static_cast<float*>(merged_->data()) + row0 * hq * d, DType::kF32, {n, hq, d});
  mp.lse = TensorView(static_cast<float*>(merged_lse_->data()) + row0 * hq, DType::kF32, {n, hq});
  return be->MergeAttention(mp, nullptr);
}

absl::Status Transformer::MergeDevicePartial(int64_t row0, int64_t n) {
  kernels::Backend* be = backend_;
  const int64_t hq = config_.num_heads, d = config_.head_dim;
  const size_t max_o = static_cast<size_t>(options_.prefill_chunk_size * hq * d);
  const size_t max_l = static_cast<size_t>(options_.prefill_chunk_size * hq);
  if (merged_ == nullptr) {
    STRATA_ASSIGN_OR_RETURN(merged_, be->Allocate(max_o * 4));
    STRATA_ASSIGN_OR_RETURN(merged_lse_, be->Allocate(max_l * 4));
  }
  const TensorView outs[2] = {
      TensorView(static_cast<float*>(attn_->data()) + row0 * hq * d, DType::kF32, {n, hq, d}),
      TensorView(static_cast<float*>(ext_o_->data()) + row0 * hq * d, DType::kF32, {n, hq, d})};
  const TensorView lses[2] = {
      TensorView(static_cast<float*>(lse_->data()) + row0 * hq, DType::kF32, {n, hq}),
      TensorView(static_cast<float*>(ext_lse_->data()) + row0 * hq, DType::kF32, {n, hq})};
  kernels::MergeAttentionParams mp;
  mp.outs = outs;
  mp.lses = lses;
  mp.num_parts = 2;
  mp.out = TensorView(static_cast<float*>(merged_->data()) + row0 * hq * d, DType::kF32, {n, hq, d});
  mp.lse = TensorView(static_cast<float*>(merged_lse_->data()) + row0 * hq, DType::kF32, {n, hq});
  return be->MergeAttention(mp, nullptr);
}

absl::StatusOr<bool> Transformer::ForwardGraphStep(int32_t id, int64_t pos, KvCache* cache,
                                                   AttentionPolicy* policy, float* logits_out,
                                                   const ForwardOptions& fo) {
  GraphRow row;
  row.id = id;
  row.pos = pos;
  row.cache = cache;
  row.policy = policy;
  row.options = &fo;
  STRATA_ASSIGN_OR_RETURN(const bool done, ReplayGraphRows({row}, fo.device_token));
  if (done && !fo.logits_on_device) {
    STRATA_RETURN_IF_ERROR(backend_->CopyToHost(logits_out, logits_->data(),
                                                config_.vocab_size * sizeof(float), nullptr));
  }
  return done;
}

absl::StatusOr<bool> Transformer::ReplayGraphRows(const std::vector<GraphRow>& rows,
                                                  const int32_t* device_token) {
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t max_rows = options_.prefill_chunk_size;
  bool& unavailable = n > 1 ? batch_graph_unavailable_ : graph_unavailable_;
  if (host_memory_ || unavailable || n < 1 || n > max_rows || (device_token != nullptr && n > 1)) {
    return false;
  }
  // STRATA_DECODE_GRAPH_BATCH=0 leaves steps of several rows to the normal path (A/B).
  static const bool batch_graphs = [] {
    const char* v = std::getenv("STRATA_DECODE_GRAPH_BATCH");
    return v == nullptr || std::string(v) != "0";
  }();
  if (n > 1 && !batch_graphs) return false;
  DecodeGraphKey key;
  key.device_token = device_token;
  bool any_external = false;
  for (const GraphRow& r : rows) {
    ExternalAttention* external = r.options->external;
    if (external != nullptr && !(external->AttendsOnDevice() && external->CapturableOnDevice())) {
      return false;
    }
    if (r.options->device_policy != nullptr || r.policy->Name() != "dense") return false;
    const int64_t index = r.pos - r.options->cache_first_position;
    if (index + 1 > r.cache->options().max_tokens) {
      return absl::ResourceExhaustedError(absl::StrCat("kv cache: ", index, " + 1 tokens exceed max_tokens ",
                                                       r.cache->options().max_tokens));
    }
    // The graph records the cache's pools and the hook's device buffers: keyed by their lifetimes
    // (ids are never reused, addresses may be).
    key.ids.push_back(r.cache->id());
    key.ids.push_back(external == nullptr ? 0 : external->instance_id());
    any_external = any_external || external != nullptr;
  }
  kernels::Backend* be = backend_;
  bool captured = false;
  auto found = std::find_if(graphs_.begin(), graphs_.end(),
                            [&key](const DecodeGraph& e) { return e.key == key; });
  if (found != graphs_.end()) {
    std::rotate(found, found + 1, graphs_.end());  // most recently used last
  } else {
    // Allocations and copies before the capture (they may not run inside one). logits_ first:
    // growing it drops the graphs recorded so far.
    STRATA_RETURN_IF_ERROR(EnsureLogitsRows(n));
    if (step_ == nullptr) {
      STRATA_ASSIGN_OR_RETURN(step_, be->Allocate(static_cast<size_t>(4 * max_rows) * sizeof(int32_t)));
    }
    if (step_host_ == nullptr) {
      STRATA_ASSIGN_OR_RETURN(step_host_,
                              be->AllocateHost(static_cast<size_t>(2 * 4 * max_rows) * sizeof(int32_t)));
    }
    DecodeGraph entry;
    entry.key = key;
    std::vector<kernels::Buffer*> tables;
    for (const GraphRow& r : rows) {
      const std::vector<int32_t> table = r.cache->PageTable(r.cache->pages_per_head());
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> t,
                              be->Allocate(table.size() * sizeof(int32_t)));
      STRATA_RETURN_IF_ERROR(
          be->CopyToDevice(t->data(), table.data(), table.size() * sizeof(int32_t), nullptr));
      tables.push_back(t.get());
      entry.page_tables.push_back(std::move(t));
    }
    if (any_external) {
      // The hooks' partials and the merge output, allocated before the capture.
      const int64_t hq = config_.num_heads, d = config_.head_dim;
      if (ext_o_ == nullptr) {
        STRATA_ASSIGN_OR_RETURN(ext_o_, be->Allocate(static_cast<size_t>(max_rows * hq * d) * 4));
        STRATA_ASSIGN_OR_RETURN(ext_lse_, be->Allocate(static_cast<size_t>(max_rows * hq) * 4));
      }
      if (merged_ == nullptr) {
        STRATA_ASSIGN_OR_RETURN(merged_, be->Allocate(static_cast<size_t>(max_rows * hq * d) * 4));
        STRATA_ASSIGN_OR_RETURN(merged_lse_, be->Allocate(static_cast<size_t>(max_rows * hq) * 4));
      }
      for (const GraphRow& r : rows) {
        ExternalAttention* external = r.options->external;
        if (external != nullptr &&
            !external->PrepareCapture(static_cast<int>(config_.num_heads)).ok()) {
          return false;
        }
      }
    }
    const absl::Status begun = be->BeginCapture(nullptr);
    if (!begun.ok()) {
      STRATA_LOG(WARNING) << "decode_graph: capture refused (" << begun << "); "
                          << (n > 1 ? "batched" : "one-token")
                          << " steps take the normal path from now on";
      unavailable = true;
      return false;
    }
    const absl::Status recorded = RecordGraphStep(rows, tables, device_token);
    absl::StatusOr<std::unique_ptr<kernels::Graph>> graph = be->EndCapture(nullptr);
    if (!recorded.ok() || !graph.ok()) {
      // Nothing ran and no host state changed: the normal path takes this step and the next.
      STRATA_LOG(WARNING) << "decode_graph: the step of " << n << " rows could not be recorded ("
                          << (recorded.ok() ? graph.status() : recorded) << "); "
                          << (n > 1 ? "batched" : "one-token")
                          << " steps take the normal path from now on";
      unavailable = true;
      return false;
    }
    entry.graph = *std::move(graph);
    captured = true;  // AttendOnDevice ran (on the host) while recording: its accounting is done
    ++graph_captures_;
    if (graphs_.size() >= kMaxDecodeGraphs) graphs_.erase(graphs_.begin());
    graphs_.push_back(std::move(entry));
  }
  kernels::Graph* graph = graphs_.back().graph.get();
  // The step's values through the next host slot, without waiting for the device (a device_token
  // graph does not read step_[0]).
  int64_t& slot_mark = step_mark_[step_slot_];
  if (slot_mark >= 0) {
    const int64_t m = slot_mark;
    slot_mark = -1;
    STRATA_RETURN_IF_ERROR(be->WaitMark(m));
  }
  int32_t* slot = static_cast<int32_t*>(step_host_->data()) + 4 * max_rows * step_slot_;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t index = rows[r].pos - rows[r].options->cache_first_position;
    slot[r] = rows[r].id;
    slot[n + r] = static_cast<int32_t>(rows[r].pos);
    slot[2 * n + r] = static_cast<int32_t>(index);
    slot[3 * n + r] = static_cast<int32_t>(index + 1);
  }
  STRATA_RETURN_IF_ERROR(
      be->CopyToDeviceAsync(step_->data(), slot, static_cast<size_t>(4 * n) * sizeof(int32_t), nullptr));
  STRATA_ASSIGN_OR_RETURN(slot_mark, be->RecordMark(nullptr));
  step_slot_ ^= 1;
  STRATA_RETURN_IF_ERROR(graph->Replay(nullptr));
  // Host bookkeeping while the step runs on the device.
  for (const GraphRow& r : rows) {
    const int64_t index = r.pos - r.options->cache_first_position;
    STRATA_RETURN_IF_ERROR(r.cache->CommitAppend(1));
    for (int layer = 0; layer < r.cache->options().num_layers; ++layer) {
      STRATA_RETURN_IF_ERROR(r.policy->OnAppend(layer, *r.cache, index, index + 1));
      // The dense policy's spans are not used (the graph attends [0, length) on the device); the
      // call keeps its counters those of the normal path.
      STRATA_RETURN_IF_ERROR(r.policy->Select(layer, nullptr, 1, static_cast<int>(config_.num_heads),
                                              index, *r.cache, &selection_));
    }
    if (r.options->external != nullptr && !captured) r.options->external->OnReplayedStep(r.pos);
  }
  graph_steps_ += n;
  return true;
}

absl::Status Transformer::Mlp(int layer, int64_t n) {
  kernels::Backend* be = backend_;
  const int64_t hidden = config_.hidden_size, ffn = config_.intermediate_size;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const model::LayerWeights& w = layers_[layer];
  const LayerScales& ws = scales_[layer];
  const FusedWeights& fw = fused_[layer];
  const TensorView x = View2(x_.get(), n, hidden);
  const TensorView xn = View2(xn_.get(), n, hidden);
  const TensorView o = View2(o_.get(), n, hidden);
  float* const gate_rows = static_cast<float*>(gate_up_->data());
  const TensorView gate(gate_rows, DType::kF32, {n, ffn});
  const TensorView up(gate_rows + n * ffn, DType::kF32, {n, ffn});
  STRATA_RETURN_IF_ERROR(be->RmsNorm({x, w.post_attention_norm, xn, eps, o}, nullptr));
  if (n == 1 && fw.gate_up.data != nullptr) {
    const TensorView gate_up(gate_rows, DType::kF32, {1, 2 * ffn});
    STRATA_RETURN_IF_ERROR(MatMul({xn, fw.gate_up, TensorView(), gate_up}, fw.gate_up_scale));
  } else {
    STRATA_RETURN_IF_ERROR(MatMul({xn, w.gate_proj, TensorView(), gate}, ws.gate));
    STRATA_RETURN_IF_ERROR(MatMul({xn, w.up_proj, TensorView(), up}, ws.up));
  }
  STRATA_RETURN_IF_ERROR(be->SwiGlu({gate, up, gate}, nullptr));
  return MatMul({gate, w.down_proj, TensorView(), o}, ws.down);
}

absl::Status Transformer::RecordGraphStep(const std::vector<GraphRow>& rows,
                                          const std::vector<kernels::Buffer*>& page_tables,
                                          const int32_t* device_token) {
  kernels::Backend* be = backend_;
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t hidden = config_.hidden_size, vocab = config_.vocab_size;
  const int64_t hq = config_.num_heads, hkv = config_.num_kv_heads, d = config_.head_dim;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const int32_t* step = static_cast<const int32_t*>(step_->data());
  const int32_t* id_dev = device_token != nullptr ? device_token : step;
  const int32_t* pos_dev = step + n;
  const int32_t* index_dev = step + 2 * n;
  const int32_t* len_dev = step + 3 * n;
  const TensorView x = View2(x_.get(), n, hidden);
  const TensorView xn = View2(xn_.get(), n, hidden);
  // The rows as RunLayers lays them out: q [n, hq * d], then k and v [n, hkv * d]; gate then up.
  float* const q_rows = static_cast<float*>(qkv_->data());
  float* const k_rows = q_rows + n * hq * d;
  float* const v_rows = k_rows + n * hkv * d;
  float* const attn_rows = static_cast<float*>(attn_->data());
  float* const lse_rows = static_cast<float*>(lse_->data());
  const TensorView q(q_rows, DType::kF32, {n, hq * d});
  const TensorView k(k_rows, DType::kF32, {n, hkv * d});
  const TensorView v(v_rows, DType::kF32, {n, hkv * d});
  const TensorView qkv(q_rows, DType::kF32, {1, (hq + 2 * hkv) * d});  // one row only
  const TensorView o = View2(o_.get(), n, hidden);
  const TensorView attn = View2(attn_.get(), n, hq * d);
  bool any_external = false;
  std::vector<kernels::SelectedAttentionParams> local(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    any_external = any_external || rows[r].options->external != nullptr;
    kernels::SelectedAttentionParams& ap = local[r];
    ap.q = TensorView(q_rows + r * hq * d, DType::kF32, {1, hq, d});
    ap.page_table = TensorView(page_tables[r]->data(), DType::kI32, {hkv, rows[r].cache->pages_per_head()});
    ap.prefix_end = rows[r].cache->options().max_tokens;
    ap.prefix_len = len_dev + r;
    ap.scale = 1.0f / std::sqrt(static_cast<float>(d));
    ap.out = TensorView(attn_rows + r * hq * d, DType::kF32, {1, hq, d});
    ap.lse = TensorView(lse_rows + r * hq, DType::kF32, {1, hq});
  }

  STRATA_RETURN_IF_ERROR(be->Embedding({id_dev, embed_tokens_, x}, nullptr));
  const int num_layers = static_cast<int>(layers_.size());
  for (int layer = 0; layer < num_layers; ++layer) {
    const model::LayerWeights& w = layers_[layer];
    const LayerScales& ws = scales_[layer];
    const FusedWeights& fw = fused_[layer];
    // The previous layer's MLP output is added to x by this norm (RmsNormParams::residual).
    STRATA_RETURN_IF_ERROR(be->RmsNorm({x, w.input_norm, xn, eps, layer > 0 ? o : TensorView()}, nullptr));
    if (n == 1 && fw.qkv.data != nullptr) {
      STRATA_RETURN_IF_ERROR(MatMul({xn, fw.qkv, fw.qkv_bias, qkv}, fw.qkv_scale));
    } else {
      STRATA_RETURN_IF_ERROR(MatMul({xn, w.q_proj, w.q_bias, q}, ws.q));
      STRATA_RETURN_IF_ERROR(MatMul({xn, w.k_proj, w.k_bias, k}, ws.k));
      STRATA_RETURN_IF_ERROR(MatMul({xn, w.v_proj, w.v_bias, v}, ws.v));
    }
    // Each row's RoPE rides on its KV append (AppendKvParams::rope): the keys go in rotated and
    // the row's queries are rotated in place, one kernel instead of a Rope and an append.
    for (int64_t r = 0; r < n; ++r) {
      const kernels::RopeParams rope{local[r].q, pos_dev + r, inv_freq_, 1.0f};
      STRATA_RETURN_IF_ERROR(rows[r].cache->EnqueueAppendAt(
          layer, TensorView(k_rows + r * hkv * d, DType::kF32, {1, hkv, d}),
          TensorView(v_rows + r * hkv * d, DType::kF32, {1, hkv, d}), index_dev + r, rope));
      local[r].k_pool = rows[r].cache->k_pool(layer);
      local[r].v_pool = rows[r].cache->v_pool(layer);
      local[r].k_scale = rows[r].cache->options().k_scale;  // fp8 caches (1 otherwise)
      local[r].v_scale = rows[r].cache->options().v_scale;
    }
    if (any_external) {
      // The local attention of every row on a forked branch, beside the hooks' (their
      // selection, page fills and attention); both only read q, and the merges wait for both.
      // STRATA_DECODE_GRAPH_FORK=0 queues it in line instead (A/B).
      static const bool fork = [] {
        const char* v = std::getenv("STRATA_DECODE_GRAPH_FORK");
        return v == nullptr || std::string(v) != "0";
      }();
      kernels::Stream side = nullptr;
      if (fork) {
        STRATA_ASSIGN_OR_RETURN(side, be->ForkStream(nullptr));
      }
      absl::Status s;
      for (int64_t r = 0; r < n && s.ok(); ++r) s = be->SelectedAttention(local[r], side);
      for (int64_t r = 0; r < n && s.ok(); ++r) {
        ExternalAttention* external = rows[r].options->external;
        if (external == nullptr) continue;
        s = external->AttendOnDevice(
            layer, local[r].q, rows[r].pos,
            TensorView(static_cast<float*>(ext_o_->data()) + r * hq * d, DType::kF32, {1, hq, d}),
            TensorView(static_cast<float*>(ext_lse_->data()) + r * hq, DType::kF32, {1, hq}));
      }
      const absl::Status joined = fork ? be->JoinStream(side, nullptr) : absl::OkStatus();
      STRATA_RETURN_IF_ERROR(s);
      STRATA_RETURN_IF_ERROR(joined);
      // Every row goes through the merge (one without a hook: a copy) so the O projection reads
      // one buffer.
      for (int64_t r = 0; r < n; ++r) {
        if (rows[r].options->external != nullptr) {
          STRATA_RETURN_IF_ERROR(MergeDevicePartial(r, 1));
        } else {
          STRATA_RETURN_IF_ERROR(MergeExternal(r, 1, {}, nullptr));
        }
      }
      STRATA_RETURN_IF_ERROR(MatMul({View2(merged_.get(), n, hq * d), w.o_proj, TensorView(), o}, ws.o));
    } else {
      for (int64_t r = 0; r < n; ++r) {
        STRATA_RETURN_IF_ERROR(be->SelectedAttention(local[r], nullptr));
      }
      STRATA_RETURN_IF_ERROR(MatMul({attn, w.o_proj, TensorView(), o}, ws.o));
    }
    STRATA_RETURN_IF_ERROR(Mlp(layer, n));
  }
  STRATA_RETURN_IF_ERROR(be->RmsNorm({x, final_norm_, xn, eps, num_layers > 0 ? o : TensorView()}, nullptr));
  const TensorView lo(logits_->data(), DType::kF32, {n, vocab});
  return MatMul({xn, lm_head_, TensorView(), lo}, lm_head_scale_);
}

absl::Status Transformer::ForwardChunk(const int32_t* ids, int64_t n, int64_t start_pos,
                                       KvCache* cache, AttentionPolicy* policy,
                                       float* logits_out, bool all_logits,
                                       const ForwardOptions& fo) {
  std::vector<Segment> segs(1);
  segs[0].cache = cache;
  segs[0].policy = policy;
  segs[0].options = &fo;
  segs[0].row0 = 0;
  segs[0].n = n;
  segs[0].start_pos = start_pos;
  STRATA_RETURN_IF_ERROR(RunLayers(ids, n, segs));
  if (logits_out == nullptr && !fo.logits_on_device) return absl::OkStatus();
  // Final norm and LM head: every row, or only the last one.
  const int64_t rows = all_logits ? n : 1;
  return Logits(n - rows, rows, fo.logits_on_device ? nullptr : logits_out);
}

absl::Status Transformer::Logits(int64_t first, int64_t rows, float* logits_out) {
  kernels::Backend* be = backend_;
  const int64_t hidden = config_.hidden_size, vocab = config_.vocab_size;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  float* x_rows = static_cast<float*>(x_->data()) + first * hidden;
  const TensorView xr(x_rows, DType::kF32, {rows, hidden});
  const TensorView xnr(xn_->data(), DType::kF32, {rows, hidden});
  STRATA_RETURN_IF_ERROR(be->RmsNorm({xr, final_norm_, xnr, eps}, nullptr));
  if (logits_out == nullptr) {
    // logits_on_device (and ForwardBatch's draws): into logits_, no copy, no wait.
    STRATA_RETURN_IF_ERROR(EnsureLogitsRows(rows));
    const TensorView lo(logits_->data(), DType::kF32, {rows, vocab});
    return MatMul({xnr, lm_head_, TensorView(), lo}, lm_head_scale_);
  }
  if (host_memory_) {
    const TensorView lo(logits_out, DType::kF32, {rows, vocab});
    STRATA_RETURN_IF_ERROR(MatMul({xnr, lm_head_, TensorView(), lo}, lm_head_scale_));
  } else {
    STRATA_RETURN_IF_ERROR(EnsureLogitsRows(rows));
    const TensorView lo(logits_->data(), DType::kF32, {rows, vocab});
    STRATA_RETURN_IF_ERROR(MatMul({xnr, lm_head_, TensorView(), lo}, lm_head_scale_));
    STRATA_RETURN_IF_ERROR(be->CopyToHost(logits_out, logits_->data(), rows * vocab * 4, nullptr));
  }
  return be->Synchronize(nullptr);
}

absl::Status Transformer::EnsureLogitsRows(int64_t rows) {
  if (logits_ != nullptr && logits_rows_ >= rows) return absl::OkStatus();
  // The graphs first: they may hold work that writes the old buffer.
  graphs_.clear();
  logits_.reset();
  logits_rows_ = 0;
  STRATA_ASSIGN_OR_RETURN(
      logits_, backend_->Allocate(static_cast<size_t>(rows * config_.vocab_size) * sizeof(float)));
  logits_rows_ = rows;
  return absl::OkStatus();
}

kernels::TensorView Transformer::device_logits() const {
  if (logits_ == nullptr) return TensorView();
  return TensorView(logits_->data(), DType::kF32, {1, config_.vocab_size});
}

absl::Status Transformer::ForwardBatch(std::vector<BatchItem>& items) {
  const int64_t B = static_cast<int64_t>(items.size());
  if (B < 1 || B > options_.prefill_chunk_size) {
    return absl::InvalidArgumentError(absl::StrCat("ForwardBatch: ", B, " items, want 1..",
                                                   options_.prefill_chunk_size));
  }
  std::vector<int32_t> ids(B);
  std::vector<Segment> segs(B);
  for (int64_t b = 0; b < B; ++b) {
    const BatchItem& it = items[b];
    if (it.cache == nullptr || it.policy == nullptr ||
        (it.logits_out == nullptr && it.token == nullptr) ||
        ((it.sample == nullptr) != (it.token == nullptr))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ForwardBatch: item ", b,
          " needs a cache, a policy and logits_out or sample with token"));
    }
    const KvCacheOptions& co = it.cache->options();
    if (co.num_layers != config_.num_layers || co.num_kv_heads != config_.num_kv_heads ||
        co.head_dim != config_.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardBatch: item ", b,
                                                     ": the KV cache does not match the model"));
    }
    const int64_t base = it.options.cache_first_position;
    if (base < 0 || base > it.pos || it.pos + 1 > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardBatch: item ", b, ": bad position"));
    }
    for (int l = 0; l < co.num_layers; ++l) {
      if (it.cache->length(l) != it.pos - base) {
        return absl::InvalidArgumentError(absl::StrCat("ForwardBatch: item ", b, ": position ",
                                                       it.pos, " but the cache holds ",
                                                       it.cache->length(l), " tokens"));
      }
    }
    if (it.id < 0 || it.id >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardBatch: item ", b, ": token id ",
                                                     it.id, " out of range"));
    }
    for (int64_t c = 0; c < b; ++c) {
      if (items[c].cache == it.cache) {
        return absl::InvalidArgumentError("ForwardBatch: one cache appears twice");
      }
    }
    ids[b] = it.id;
    segs[b].cache = it.cache;
    segs[b].policy = it.policy;
    segs[b].options = &it.options;
    segs[b].row0 = b;
    segs[b].n = 1;
    segs[b].start_pos = it.pos;
  }
  std::vector<int64_t> order(static_cast<size_t>(B));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (options_.decode_graph) {
    // The rows in the order of their caches' ids, so that the same sequences decoding together
    // replay one graph whichever order their steps came in.
    std::sort(order.begin(), order.end(), [&items](int64_t a, int64_t b) {
      return items[a].cache->id() < items[b].cache->id();
    });
    std::vector<GraphRow> rows(static_cast<size_t>(B));
    for (int64_t r = 0; r < B; ++r) {
      const BatchItem& it = items[order[r]];
      rows[r].id = it.id;
      rows[r].pos = it.pos;
      rows[r].cache = it.cache;
      rows[r].policy = it.policy;
      rows[r].options = &it.options;
    }
    STRATA_ASSIGN_OR_RETURN(const bool done, ReplayGraphRows(rows, nullptr));
    if (done) return FinishBatch(items, order, /*on_device=*/true);
    std::iota(order.begin(), order.end(), int64_t{0});
  }
  STRATA_RETURN_IF_ERROR(RunLayers(ids.data(), B, segs));
  return FinishBatch(items, order, /*on_device=*/false);
}

absl::Status Transformer::FinishBatch(std::vector<BatchItem>& items,
                                      const std::vector<int64_t>& order, bool on_device) {
  const int64_t B = static_cast<int64_t>(items.size());
  const int64_t vocab = config_.vocab_size;
  bool sampled = false;
  for (const BatchItem& it : items) sampled = sampled || it.sample != nullptr;
  if (sampled) {
    // The logits stay on the backend: the sampled items get their tokens, the others their rows
    // (greedy rows drawn for them too, unused).
    std::vector<kernels::SampleRow> rows_sample(static_cast<size_t>(B));
    for (int64_t r = 0; r < B; ++r) {
      if (items[order[r]].sample != nullptr) rows_sample[r] = *items[order[r]].sample;
    }
    if (!on_device) STRATA_RETURN_IF_ERROR(Logits(0, B, nullptr));
    STRATA_RETURN_IF_ERROR(PickRows(TensorView(logits_->data(), DType::kF32, {B, vocab}),
                                    rows_sample.data()));
    const float* rows = static_cast<const float*>(logits_->data());
    for (int64_t r = 0; r < B; ++r) {
      BatchItem& it = items[order[r]];
      if (it.token != nullptr) {
        *it.token = picked_[r];
      } else {
        STRATA_RETURN_IF_ERROR(backend_->CopyToHost(it.logits_out, rows + r * vocab,
                                                    vocab * sizeof(float), nullptr));
      }
    }
    return absl::OkStatus();
  }
  batch_logits_.resize(static_cast<size_t>(B * vocab));
  if (on_device) {
    STRATA_RETURN_IF_ERROR(backend_->CopyToHost(batch_logits_.data(), logits_->data(),
                                                static_cast<size_t>(B * vocab) * sizeof(float),
                                                nullptr));
  } else {
    STRATA_RETURN_IF_ERROR(Logits(0, B, batch_logits_.data()));
  }
  for (int64_t r = 0; r < B; ++r) {
    std::memcpy(items[order[r]].logits_out, batch_logits_.data() + r * vocab,
                vocab * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status Transformer::PickRows(const TensorView& logits, const kernels::SampleRow* sample) {
  kernels::Backend* be = backend_;
  const int64_t rows = logits.dim(0), vocab = logits.dim(1);
  if (sample_rows_ == nullptr) {
    const int64_t max_rows = options_.prefill_chunk_size;
    STRATA_ASSIGN_OR_RETURN(sample_rows_,
                            be->Allocate(static_cast<size_t>(max_rows) * sizeof(kernels::SampleRow)));
    STRATA_ASSIGN_OR_RETURN(sample_tokens_,
                            be->Allocate(static_cast<size_t>(max_rows) * sizeof(int32_t)));
  }
  picked_.resize(static_cast<size_t>(rows));
  kernels::SampleParams p;
  p.logits = logits;
  p.rows = static_cast<const kernels::SampleRow*>(sample_rows_->data());
  p.tokens = sample_tokens_->View(DType::kI32, {rows});
  if (!be->Supports(p).ok()) {
    // A backend that cannot sample: the rows to the host and the CPU twin there.
    batch_logits_.resize(static_cast<size_t>(rows * vocab));
    STRATA_RETURN_IF_ERROR(
        be->CopyToHost(batch_logits_.data(), logits.data, rows * vocab * sizeof(float), nullptr));
    kernels::SampleParams h;
    h.logits = TensorView(batch_logits_.data(), DType::kF32, {rows, vocab});
    h.rows = sample;
    h.tokens = TensorView(picked_.data(), DType::kI32, {rows});
    return kernels::CpuSample(h);
  }
  STRATA_RETURN_IF_ERROR(be->CopyToDevice(sample_rows_->data(), sample,
                                          static_cast<size_t>(rows) * sizeof(kernels::SampleRow),
                                          nullptr));
  STRATA_RETURN_IF_ERROR(be->Sample(p, nullptr));
  return be->CopyToHost(picked_.data(), sample_tokens_->data(), rows * sizeof(int32_t), nullptr);
}

absl::StatusOr<int32_t> Transformer::PickToken(const kernels::SampleRow& row) {
  const TensorView logits = device_logits();
  if (logits.data == nullptr) {
    return absl::FailedPreconditionError("PickToken: no Forward with logits_on_device yet");
  }
  STRATA_RETURN_IF_ERROR(PickRows(logits, &row));
  return picked_[0];
}

absl::Status Transformer::RunLayers(const int32_t* ids, int64_t n, const std::vector<Segment>& segs) {
  kernels::Backend* be = backend_;
  const int64_t hidden = config_.hidden_size;
  const int64_t hq = config_.num_heads, hkv = config_.num_kv_heads, d = config_.head_dim;
  const float eps = static_cast<float>(config_.rms_norm_eps);

  positions_host_.resize(n);
  for (const Segment& sg : segs) {
    for (int64_t i = 0; i < sg.n; ++i) {
      positions_host_[sg.row0 + i] = static_cast<int32_t>(sg.start_pos + i);
    }
  }
  STRATA_RETURN_IF_ERROR(be->CopyToDevice(ids_->data(), ids, n * 4, nullptr));
  STRATA_RETURN_IF_ERROR(be->CopyToDevice(pos_->data(), positions_host_.data(), n * 4, nullptr));
  const int32_t* ids_dev = static_cast<const int32_t*>(ids_->data());
  const int32_t* pos_dev = static_cast<const int32_t*>(pos_->data());

  const TensorView x = View2(x_.get(), n, hidden);
  const TensorView xn = View2(xn_.get(), n, hidden);
  // Rows of this call: q [n, hq * d], then k and v [n, hkv * d] (see qkv_); gate then up.
  float* const q_rows = static_cast<float*>(qkv_->data());
  float* const k_rows = q_rows + n * hq * d;
  float* const v_rows = k_rows + n * hkv * d;
  const TensorView q(q_rows, DType::kF32, {n, hq * d});
  const TensorView k(k_rows, DType::kF32, {n, hkv * d});
  const TensorView v(v_rows, DType::kF32, {n, hkv * d});
  const TensorView qkv(q_rows, DType::kF32, {n, (hq + 2 * hkv) * d});
  const TensorView attn = View2(attn_.get(), n, hq * d);
  const TensorView o = View2(o_.get(), n, hidden);
  const TensorView q3(q_rows, DType::kF32, {n, hq, d});
  const TensorView k3(k_rows, DType::kF32, {n, hkv, d});
  // One token: q and k are adjacent heads of one row, roped in one call.
  const TensorView qk3(q_rows, DType::kF32, {1, hq + hkv, d});
  // Whether any segment's attention reads the query on the host (a host policy's Select, or an
  // external attention); when none does, the per-layer copy of q to the host is skipped.
  bool host_query = false;
  for (const Segment& sg : segs) {
    const bool device_attend = sg.options->device_policy != nullptr &&
                               (sg.n == 1 || sg.options->device_prefill);
    const bool external_host =
        sg.options->external != nullptr && !sg.options->external->AttendsOnDevice();
    if (external_host || (!device_attend && sg.policy->ReadsQuery())) {
      host_query = true;
    }
  }
  float* const attn_rows = static_cast<float*>(attn_->data());
  float* const lse_rows = static_cast<float*>(lse_->data());
  segment_parts_.resize(segs.size());
  segment_device_part_.assign(segs.size(), 0);

  STRATA_RETURN_IF_ERROR(be->Embedding({ids_dev, embed_tokens_, x}, nullptr));
  const int num_layers = static_cast<int>(layers_.size());
  for (int layer = 0; layer < num_layers; ++layer) {
    const model::LayerWeights& w = layers_[layer];
    const LayerScales& ws = scales_[layer];
    // The previous layer's MLP output is added to x by this norm (RmsNormParams::residual).
    STRATA_RETURN_IF_ERROR(be->RmsNorm({x, w.input_norm, xn, eps, layer > 0 ? o : TensorView()}, nullptr));
    const FusedWeights& fw = fused_[layer];
    if (n == 1 && fw.qkv.data != nullptr) {
      // One token: [q | k | v] from one GEMV (each output row computed as by the separate ones).
      STRATA_RETURN_IF_ERROR(MatMul({xn, fw.qkv, fw.qkv_bias, qkv}, fw.qkv_scale));
      STRATA_RETURN_IF_ERROR(be->Rope({qk3, pos_dev, inv_freq_, 1.0f}, nullptr));
    } else {
      STRATA_RETURN_IF_ERROR(MatMul({xn, w.q_proj, w.q_bias, q}, ws.q));
      STRATA_RETURN_IF_ERROR(MatMul({xn, w.k_proj, w.k_bias, k}, ws.k));
      STRATA_RETURN_IF_ERROR(MatMul({xn, w.v_proj, w.v_bias, v}, ws.v));
      STRATA_RETURN_IF_ERROR(be->Rope({q3, pos_dev, inv_freq_, 1.0f}, nullptr));
      STRATA_RETURN_IF_ERROR(be->Rope({k3, pos_dev, inv_freq_, 1.0f}, nullptr));
    }
    const float* q_host = q_rows;
    if (!host_memory_ && host_query) {
      const size_t q_floats = static_cast<size_t>(n * hq * d);
      STRATA_RETURN_IF_ERROR(q_host_.Reserve(be, q_floats));
      STRATA_RETURN_IF_ERROR(q_host_.CopyOut(be, q_rows, q_floats));
      q_host = q_host_.data();
    }
    bool merge = false;
    // Host-query external attentions first learn every segment's queries (ExternalAttention::
    // Prepare), so that a batch's remote work overlaps.
    for (const Segment& sg : segs) {
      ExternalAttention* external = sg.options->external;
      if (external != nullptr && !external->AttendsOnDevice()) {
        STRATA_RETURN_IF_ERROR(external->Prepare(layer, q_host + sg.row0 * hq * d,
                                                 static_cast<int>(sg.n), static_cast<int>(hq),
                                                 sg.start_pos));
      }
    }
    for (size_t si = 0; si < segs.size(); ++si) {
      const Segment& sg = segs[si];
      const int64_t r0 = sg.row0, m = sg.n;
      const int64_t base = sg.options->cache_first_position;
      KvCache* cache = sg.cache;
      AttentionPolicy* policy = sg.policy;
      const TensorView ks(k_rows + r0 * hkv * d, DType::kF32, {m, hkv, d});
      const TensorView vs(v_rows + r0 * hkv * d, DType::kF32, {m, hkv, d});
      STRATA_RETURN_IF_ERROR(cache->Append(layer, ks, vs));
      STRATA_RETURN_IF_ERROR(
          policy->OnAppend(layer, *cache, sg.start_pos - base, sg.start_pos - base + m));
      const float* q_seg = q_host + r0 * hq * d;
      sparse::DevicePolicy* device = sg.options->device_policy;
      if (device != nullptr) {
        STRATA_RETURN_IF_ERROR(device->OnAppend(layer, *cache, sg.start_pos - base,
                                                sg.start_pos - base + m, nullptr));
      }
      if (device != nullptr && m == 1) {
        STRATA_RETURN_IF_ERROR(device->Attend(
            layer, TensorView(q_rows + r0 * hq * d, DType::kF32, {1, hq, d}), *cache,
            TensorView(attn_rows + r0 * hq * d, DType::kF32, {1, hq, d}),
            TensorView(lse_rows + r0 * hq, DType::kF32, {1, hq}), nullptr));
      } else if (device != nullptr && sg.options->device_prefill) {
        STRATA_RETURN_IF_ERROR(device->AttendChunk(
            layer, TensorView(q_rows + r0 * hq * d, DType::kF32, {m, hq, d}), sg.start_pos - base,
            *cache, base, TensorView(attn_rows + r0 * hq * d, DType::kF32, {m, hq, d}),
            TensorView(lse_rows + r0 * hq, DType::kF32, {m, hq}), nullptr));
      } else {
        STRATA_RETURN_IF_ERROR(policy->Select(layer, q_seg, static_cast<int>(m),
                                              static_cast<int>(hq), sg.start_pos - base, *cache,
                                              &selection_));
        if (static_cast<int64_t>(selection_.offsets.size()) != hkv + 1) {
          return absl::InternalError(absl::StrCat("policy ", policy->Name(), " returned ",
                                                  selection_.offsets.size(), " offsets for ", hkv,
                                                  " KV heads"));
        }
        if (base != 0) {
          for (kernels::KvSpan& s : selection_.spans) s.position += static_cast<int32_t>(base);
        }
        kernels::PagedAttentionParams ap;
        ap.q = TensorView(q_rows + r0 * hq * d, DType::kF32, {m, hq, d});
        ap.k_pool = cache->k_pool(layer);
        ap.v_pool = cache->v_pool(layer);
        ap.spans = selection_.spans.data();
        ap.span_offsets = selection_.offsets.data();
        ap.num_kv_heads = static_cast<int>(hkv);
        ap.q_positions = positions_host_.data() + r0;
        ap.causal = true;
        ap.scale = 1.0f / std::sqrt(static_cast<float>(d));
        ap.k_scale = cache->options().k_scale;  // fp8 caches (1 otherwise)
        ap.v_scale = cache->options().v_scale;
        ap.out = TensorView(attn_rows + r0 * hq * d, DType::kF32, {m, hq, d});
        ap.lse = TensorView(lse_rows + r0 * hq, DType::kF32, {m, hq});
        STRATA_RETURN_IF_ERROR(be->PagedAttention(ap, nullptr));
      }
      std::vector<AttentionPartial>& parts = segment_parts_[si];
      parts.clear();
      if (sg.options->external != nullptr && sg.options->external->AttendsOnDevice()) {
        // Device path: q and the partial stay in backend memory.
        if (ext_o_ == nullptr) {
          const int64_t rows = options_.prefill_chunk_size;
          STRATA_ASSIGN_OR_RETURN(ext_o_, be->Allocate(static_cast<size_t>(rows * hq * d) * 4));
          STRATA_ASSIGN_OR_RETURN(ext_lse_, be->Allocate(static_cast<size_t>(rows * hq) * 4));
        }
        STRATA_RETURN_IF_ERROR(sg.options->external->AttendOnDevice(
            layer, TensorView(q_rows + r0 * hq * d, DType::kF32, {m, hq, d}), sg.start_pos,
            TensorView(static_cast<float*>(ext_o_->data()) + r0 * hq * d, DType::kF32,
                       {m, hq, d}),
            TensorView(static_cast<float*>(ext_lse_->data()) + r0 * hq, DType::kF32, {m, hq})));
        segment_device_part_[si] = 1;
        merge = true;
      } else if (sg.options->external != nullptr) {
        STRATA_RETURN_IF_ERROR(sg.options->external->Attend(layer, q_seg, static_cast<int>(m),
                                                            static_cast<int>(hq), sg.start_pos,
                                                            &parts));
        if (!parts.empty()) merge = true;
      }
    }
    TensorView attn_in = attn;
    if (merge) {
      // Every segment goes through the merge (one part: a copy) so the O projection reads one
      // buffer. The previous layer's staged copies are done before this layer's overwrite them.
      if (part_mark_ >= 0) STRATA_RETURN_IF_ERROR(be->WaitMark(std::exchange(part_mark_, -1)));
      bool staged = false;
      for (size_t si = 0; si < segs.size(); ++si) {
        if (segment_device_part_[si]) {
          STRATA_RETURN_IF_ERROR(MergeDevicePartial(segs[si].row0, segs[si].n));
        } else {
          STRATA_RETURN_IF_ERROR(MergeExternal(segs[si].row0, segs[si].n, segment_parts_[si], &staged));
        }
      }
      if (staged) {
        STRATA_ASSIGN_OR_RETURN(part_mark_, be->RecordMark(nullptr));
      }
      attn_in = View2(merged_.get(), n, hq * d);
    }
    STRATA_RETURN_IF_ERROR(MatMul({attn_in, w.o_proj, TensorView(), o}, ws.o));
    STRATA_RETURN_IF_ERROR(Mlp(layer, n));
    // The next layer's input norm adds o to x; after the last layer x is completed here (Logits
    // reads some of its rows).
    if (layer + 1 == num_layers) STRATA_RETURN_IF_ERROR(be->Add({x, o, x}, nullptr));
  }
  return absl::OkStatus();
}

}  // namespace strata::engine
