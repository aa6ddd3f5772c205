// Transformer forward; see engine/transformer.h.
#include "engine/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace strata::engine {

using kernels::DType;
using kernels::TensorView;

absl::Status TransformerOptions::Validate() const {
  if (prefill_chunk_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_chunk_size must be >= 1, got ", prefill_chunk_size));
  }
  return absl::OkStatus();
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

Transformer::~Transformer() = default;

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
  STRATA_RETURN_IF_ERROR(Upload(w.embed_tokens, &embed_tokens_));
  STRATA_RETURN_IF_ERROR(Upload(w.final_norm, &final_norm_));
  if (w.lm_head.data == w.embed_tokens.data) {
    lm_head_ = embed_tokens_;  // tied: upload once
  } else {
    STRATA_RETURN_IF_ERROR(Upload(w.lm_head, &lm_head_));
  }
  layers_.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const model::LayerWeights& s = w.layers[l];
    model::LayerWeights& d = layers_[l];
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
    STRATA_RETURN_IF_ERROR(Upload(s.input_norm, &d.input_norm));
    STRATA_RETURN_IF_ERROR(Upload(s.q_proj, &d.q_proj));
    STRATA_RETURN_IF_ERROR(Upload(s.k_proj, &d.k_proj));
    STRATA_RETURN_IF_ERROR(Upload(s.v_proj, &d.v_proj));
    if (config_.attention_bias) {
      STRATA_RETURN_IF_ERROR(Upload(s.q_bias, &d.q_bias));
      STRATA_RETURN_IF_ERROR(Upload(s.k_bias, &d.k_bias));
      STRATA_RETURN_IF_ERROR(Upload(s.v_bias, &d.v_bias));
    }
    STRATA_RETURN_IF_ERROR(Upload(s.o_proj, &d.o_proj));
    STRATA_RETURN_IF_ERROR(Upload(s.post_attention_norm, &d.post_attention_norm));
    STRATA_RETURN_IF_ERROR(Upload(s.gate_proj, &d.gate_proj));
    STRATA_RETURN_IF_ERROR(Upload(s.up_proj, &d.up_proj));
    STRATA_RETURN_IF_ERROR(Upload(s.down_proj, &d.down_proj));
  }

  // Scratch for one chunk.
  const int64_t c = options_.prefill_chunk_size;
  auto alloc = [&](std::unique_ptr<kernels::Buffer>* b, int64_t elems) -> absl::Status {
    STRATA_ASSIGN_OR_RETURN(*b, backend_->Allocate(static_cast<size_t>(elems) * 4));
    return absl::OkStatus();
  };
  STRATA_RETURN_IF_ERROR(alloc(&x_, c * hidden));
  STRATA_RETURN_IF_ERROR(alloc(&xn_, c * hidden));
  STRATA_RETURN_IF_ERROR(alloc(&q_, c * qdim));
  STRATA_RETURN_IF_ERROR(alloc(&k_, c * kvdim));
  STRATA_RETURN_IF_ERROR(alloc(&v_, c * kvdim));
  STRATA_RETURN_IF_ERROR(alloc(&attn_, c * qdim));
  STRATA_RETURN_IF_ERROR(alloc(&lse_, c * config_.num_heads));
  STRATA_RETURN_IF_ERROR(alloc(&o_, c * hidden));
  STRATA_RETURN_IF_ERROR(alloc(&gate_, c * ffn));
  STRATA_RETURN_IF_ERROR(alloc(&up_, c * ffn));
  STRATA_RETURN_IF_ERROR(alloc(&ids_, c));
  STRATA_RETURN_IF_ERROR(alloc(&pos_, c));
  if (!host_memory_) STRATA_RETURN_IF_ERROR(alloc(&logits_, c * vocab));
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
  if (n < 1 || ids == nullptr || logits_out == nullptr) {
    return absl::InvalidArgumentError("Forward: needs n >= 1 tokens, ids and logits_out");
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
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("Forward: token id ", ids[i], " at ", i,
                                                     " is outside [0, ", config_.vocab_size, ")"));
    }
  }
  if (start_pos + n > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("Forward: positions beyond int32");
  }
  const int64_t chunk = options_.prefill_chunk_size;
  const int64_t vocab = config_.vocab_size;
  for (int64_t b = 0; b < n; b += chunk) {
    const int64_t m = std::min(chunk, n - b);
    const bool last = b + m == n;
    if (!all_logits && !last) {
      STRATA_RETURN_IF_ERROR(
          ForwardChunk(ids + b, m, start_pos + b, cache, policy, nullptr, false, fo));
    } else {
      STRATA_RETURN_IF_ERROR(ForwardChunk(ids + b, m, start_pos + b, cache, policy,
                                          all_logits ? logits_out + b * vocab : logits_out,
                                          all_logits, fo));
    }
  }
  return absl::OkStatus();
}

absl::Status Transformer::MergeExternal(int64_t n, const std::vector<AttentionPartial>& parts) {
  kernels::Backend* be = backend_;
  const int64_t hq = config_.num_heads, d = config_.head_dim;
  const size_t o_elems = static_cast<size_t>(n * hq * d), l_elems = static_cast<size_t>(n * hq);
  const size_t max_o = static_cast<size_t>(options_.prefill_chunk_size * hq * d);
  const size_t max_l = static_cast<size_t>(options_.prefill_chunk_size * hq);
  std::vector<TensorView> outs, lses;
  outs.emplace_back(attn_->data(), DType::kF32, std::initializer_list<int64_t>{n, hq, d});
  lses.emplace_back(lse_->data(), DType::kF32, std::initializer_list<int64_t>{n, hq});
  for (size_t i = 0; i < parts.size(); ++i) {
    const AttentionPartial& p = parts[i];
    if (p.o.size() != o_elems || p.lse.size() != l_elems) {
      return absl::InvalidArgumentError(absl::StrCat("Forward: external partial ", i, " has ",
                                                     p.o.size(), "/", p.lse.size(),
                                                     " values, expected ", o_elems, "/", l_elems));
    }
    const float* o = p.o.data();
    const float* l = p.lse.data();
    if (!host_memory_) {
      while (part_o_.size() <= i) {
        STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> bo, be->Allocate(max_o * 4));
        STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> bl, be->Allocate(max_l * 4));
        part_o_.push_back(std::move(bo));
        part_lse_.push_back(std::move(bl));
      }
      STRATA_RETURN_IF_ERROR(be->CopyToDevice(part_o_[i]->data(), o, o_elems * 4, nullptr));
      STRATA_RETURN_IF_ERROR(be->CopyToDevice(part_lse_[i]->data(), l, l_elems * 4, nullptr));
      o = static_cast<const float*>(part_o_[i]->data());
      l = static_cast<const float*>(part_lse_[i]->data());
    }
    outs.emplace_back(const_cast<float*>(o), DType::kF32, std::initializer_list<int64_t>{n, hq, d});
    lses.emplace_back(const_cast<float*>(l), DType::kF32, std::initializer_list<int64_t>{n, hq});
  }
  if (merged_ == nullptr) {
    STRATA_ASSIGN_OR_RETURN(merged_, be->Allocate(max_o * 4));
    STRATA_ASSIGN_OR_RETURN(merged_lse_, be->Allocate(max_l * 4));
  }
  kernels::MergeAttentionParams mp;
  mp.outs = outs.data();
  mp.lses = lses.data();
  mp.num_parts = static_cast<int>(outs.size());
  mp.out = TensorView(merged_->data(), DType::kF32, {n, hq, d});
  mp.lse = TensorView(merged_lse_->data(), DType::kF32, {n, hq});
  STRATA_RETURN_IF_ERROR(be->MergeAttention(mp, nullptr));
  return absl::OkStatus();
}

absl::Status Transformer::ForwardChunk(const int32_t* ids, int64_t n, int64_t start_pos,
                                       KvCache* cache, AttentionPolicy* policy,
                                       float* logits_out, bool all_logits,
                                       const ForwardOptions& fo) {
  kernels::Backend* be = backend_;
  const int64_t hidden = config_.hidden_size, vocab = config_.vocab_size;
  const int64_t hq = config_.num_heads, hkv = config_.num_kv_heads, d = config_.head_dim;
  const int64_t ffn = config_.intermediate_size;
  const float eps = static_cast<float>(config_.rms_norm_eps);

  positions_host_.resize(n);
  for (int64_t i = 0; i < n; ++i) positions_host_[i] = static_cast<int32_t>(start_pos + i);
  STRATA_RETURN_IF_ERROR(be->CopyToDevice(ids_->data(), ids, n * 4, nullptr));
  STRATA_RETURN_IF_ERROR(be->CopyToDevice(pos_->data(), positions_host_.data(), n * 4, nullptr));
  const int32_t* ids_dev = static_cast<const int32_t*>(ids_->data());
  const int32_t* pos_dev = static_cast<const int32_t*>(pos_->data());

  const TensorView x = View2(x_.get(), n, hidden);
  const TensorView xn = View2(xn_.get(), n, hidden);
  const TensorView q = View2(q_.get(), n, hq * d);
  const TensorView k = View2(k_.get(), n, hkv * d);
  const TensorView v = View2(v_.get(), n, hkv * d);
  const TensorView attn = View2(attn_.get(), n, hq * d);
  const TensorView o = View2(o_.get(), n, hidden);
  const TensorView gate = View2(gate_.get(), n, ffn);
  const TensorView up = View2(up_.get(), n, ffn);
  const TensorView q3(q_->data(), DType::kF32, {n, hq, d});
  const TensorView k3(k_->data(), DType::kF32, {n, hkv, d});
  const TensorView v3(v_->data(), DType::kF32, {n, hkv, d});
  const TensorView attn3(attn_->data(), DType::kF32, {n, hq, d});
  const TensorView lse(lse_->data(), DType::kF32, {n, hq});

  STRATA_RETURN_IF_ERROR(be->Embedding({ids_dev, embed_tokens_, x}, nullptr));
  for (int layer = 0; layer < static_cast<int>(layers_.size()); ++layer) {
    const model::LayerWeights& w = layers_[layer];
    STRATA_RETURN_IF_ERROR(be->RmsNorm({x, w.input_norm, xn, eps}, nullptr));
    STRATA_RETURN_IF_ERROR(be->MatMul({xn, w.q_proj, w.q_bias, q}, nullptr));
    STRATA_RETURN_IF_ERROR(be->MatMul({xn, w.k_proj, w.k_bias, k}, nullptr));
    STRATA_RETURN_IF_ERROR(be->MatMul({xn, w.v_proj, w.v_bias, v}, nullptr));
    STRATA_RETURN_IF_ERROR(be->Rope({q3, pos_dev, inv_freq_, 1.0f}, nullptr));
    STRATA_RETURN_IF_ERROR(be->Rope({k3, pos_dev, inv_freq_, 1.0f}, nullptr));
    STRATA_RETURN_IF_ERROR(cache->Append(layer, k3, v3));
    STRATA_RETURN_IF_ERROR(policy->OnAppend(layer, *cache, start_pos, start_pos + n));
    const float* q_host = static_cast<const float*>(q_->data());
    if (!host_memory_) {
      q_host_.resize(n * hq * d);
      STRATA_RETURN_IF_ERROR(be->CopyToHost(q_host_.data(), q_->data(), n * hq * d * 4, nullptr));
      q_host = q_host_.data();
    }
    const int64_t base = fo.cache_first_position;
    STRATA_RETURN_IF_ERROR(policy->Select(layer, q_host, static_cast<int>(n), static_cast<int>(hq),
                                          start_pos - base, *cache, &selection_));
    if (base != 0) {
      for (kernels::KvSpan& s : selection_.spans) s.position += static_cast<int32_t>(base);
    }
    if (static_cast<int64_t>(selection_.offsets.size()) != hkv + 1) {
      return absl::InternalError(absl::StrCat("policy ", policy->Name(), " returned ",
                                              selection_.offsets.size(), " offsets for ", hkv,
                                              " KV heads"));
    }
    kernels::PagedAttentionParams ap;
    ap.q = q3;
    ap.k_pool = cache->k_pool(layer);
    ap.v_pool = cache->v_pool(layer);
    ap.spans = selection_.spans.data();
    ap.span_offsets = selection_.offsets.data();
    ap.num_kv_heads = static_cast<int>(hkv);
    ap.q_positions = positions_host_.data();
    ap.causal = true;
    ap.scale = 1.0f / std::sqrt(static_cast<float>(d));
    ap.out = attn3;
    ap.lse = lse;
    STRATA_RETURN_IF_ERROR(be->PagedAttention(ap, nullptr));
    TensorView attn_in = attn;
    if (fo.external != nullptr) {
      STRATA_RETURN_IF_ERROR(fo.external->Attend(layer, q_host, static_cast<int>(n),
                                                 static_cast<int>(hq), start_pos,
                                                 &external_parts_));
      if (!external_parts_.empty()) {
        STRATA_RETURN_IF_ERROR(MergeExternal(n, external_parts_));
        attn_in = View2(merged_.get(), n, hq * d);
      }
    }
    STRATA_RETURN_IF_ERROR(be->MatMul({attn_in, w.o_proj, TensorView(), o}, nullptr));
    STRATA_RETURN_IF_ERROR(be->Add({x, o, x}, nullptr));
    STRATA_RETURN_IF_ERROR(be->RmsNorm({x, w.post_attention_norm, xn, eps}, nullptr));
    STRATA_RETURN_IF_ERROR(be->MatMul({xn, w.gate_proj, TensorView(), gate}, nullptr));
    STRATA_RETURN_IF_ERROR(be->MatMul({xn, w.up_proj, TensorView(), up}, nullptr));
    STRATA_RETURN_IF_ERROR(be->SwiGlu({gate, up, gate}, nullptr));
    STRATA_RETURN_IF_ERROR(be->MatMul({gate, w.down_proj, TensorView(), o}, nullptr));
    STRATA_RETURN_IF_ERROR(be->Add({x, o, x}, nullptr));
  }
  if (logits_out == nullptr) return absl::OkStatus();

  // Final norm and LM head: every row, or only the last one.
  const int64_t rows = all_logits ? n : 1;
  const int64_t first = n - rows;
  float* x_rows = static_cast<float*>(x_->data()) + first * hidden;
  const TensorView xr(x_rows, DType::kF32, {rows, hidden});
  const TensorView xnr(xn_->data(), DType::kF32, {rows, hidden});
  STRATA_RETURN_IF_ERROR(be->RmsNorm({xr, final_norm_, xnr, eps}, nullptr));
  if (host_memory_) {
    const TensorView lo(logits_out, DType::kF32, {rows, vocab});
    STRATA_RETURN_IF_ERROR(be->MatMul({xnr, lm_head_, TensorView(), lo}, nullptr));
  } else {
    const TensorView lo(logits_->data(), DType::kF32, {rows, vocab});
    STRATA_RETURN_IF_ERROR(be->MatMul({xnr, lm_head_, TensorView(), lo}, nullptr));
    STRATA_RETURN_IF_ERROR(be->CopyToHost(logits_out, logits_->data(), rows * vocab * 4, nullptr));
  }
  return be->Synchronize(nullptr);
}

}  // namespace strata::engine
