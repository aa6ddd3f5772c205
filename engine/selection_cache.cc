#include "engine/selection_cache.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace strata::engine {

using kernels::DType;
using kernels::TensorView;

absl::StatusOr<std::unique_ptr<DeviceSelectionCache>> DeviceSelectionCache::Create(
    kernels::Backend* backend, int num_layers, int num_kv_heads, int group, int head_dim,
    int64_t kept, double theta) {
  if (backend == nullptr || num_layers <= 0 || num_kv_heads <= 0 || group <= 0 || head_dim <= 0 ||
      kept <= 0) {
    return absl::InvalidArgumentError("DeviceSelectionCache: non-positive sizes");
  }
  if (!(theta > 0.0 && theta <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceSelectionCache: theta ", theta, " outside (0, 1]"));
  }
  auto c = std::unique_ptr<DeviceSelectionCache>(new DeviceSelectionCache);
  c->backend_ = backend;
  c->num_kv_heads_ = num_kv_heads;
  c->group_ = group;
  c->head_dim_ = head_dim;
  c->kept_ = kept;
  c->theta_ = theta;
  c->layers_.resize(static_cast<size_t>(num_layers));
  const size_t heads = static_cast<size_t>(num_kv_heads);
  for (Layer& l : c->layers_) {
    STRATA_ASSIGN_OR_RETURN(
        l.cached_q, backend->Allocate(sizeof(float) * heads * group * static_cast<size_t>(head_dim)));
    STRATA_ASSIGN_OR_RETURN(l.valid, backend->Allocate(sizeof(int32_t) * heads));
    STRATA_ASSIGN_OR_RETURN(l.reuse, backend->Allocate(sizeof(int32_t) * heads));
    STRATA_ASSIGN_OR_RETURN(l.kept,
                            backend->Allocate(sizeof(int32_t) * heads * static_cast<size_t>(kept)));
  }
  for (int l = 0; l < num_layers; ++l) STRATA_RETURN_IF_ERROR(c->Invalidate(l, nullptr));
  STRATA_ASSIGN_OR_RETURN(c->hit_count_, backend->Allocate(sizeof(int64_t)));
  const int64_t zero = 0;
  STRATA_RETURN_IF_ERROR(backend->CopyToDevice(c->hit_count_->data(), &zero, sizeof(zero), nullptr));
  STRATA_RETURN_IF_ERROR(backend->Synchronize(nullptr));
  return c;
}

absl::StatusOr<kernels::SelectionCacheCheckParams> DeviceSelectionCache::CheckParams(
    int layer, const TensorView& q) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceSelectionCache: layer ", layer));
  }
  Layer& l = layers_[static_cast<size_t>(layer)];
  kernels::SelectionCacheCheckParams cc;
  cc.q = q;
  cc.cached_q = l.cached_q->View(DType::kF32, {num_kv_heads_, int64_t{group_} * head_dim_});
  cc.valid = l.valid->View(DType::kI32, {num_kv_heads_});
  cc.theta = static_cast<float>(theta_);
  cc.reuse = l.reuse->View(DType::kI32, {num_kv_heads_});
  cc.hit_count = static_cast<int64_t*>(hit_count_->data());
  return cc;
}

absl::StatusOr<const int32_t*> DeviceSelectionCache::Check(int layer, const TensorView& q,
                                                           kernels::Stream stream) {
  STRATA_ASSIGN_OR_RETURN(const kernels::SelectionCacheCheckParams cc, CheckParams(layer, q));
  STRATA_RETURN_IF_ERROR(backend_->SelectionCacheCheck(cc, stream));
  CountChecks(1);
  return static_cast<const int32_t*>(cc.reuse.data);
}

TensorView DeviceSelectionCache::kept(int layer) const {
  return layers_[static_cast<size_t>(layer)].kept->View(DType::kI32, {num_kv_heads_, kept_});
}

absl::Status DeviceSelectionCache::Invalidate(int layer, kernels::Stream stream) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceSelectionCache: layer ", layer));
  }
  const std::vector<int32_t> zeros(static_cast<size_t>(num_kv_heads_), 0);
  return backend_->CopyToDevice(layers_[static_cast<size_t>(layer)].valid->data(), zeros.data(),
                                zeros.size() * sizeof(int32_t), stream);
}

absl::StatusOr<int64_t> DeviceSelectionCache::ReadHits(kernels::Stream stream) {
  int64_t hits = 0;
  STRATA_RETURN_IF_ERROR(backend_->CopyToHost(&hits, hit_count_->data(), sizeof(hits), stream));
  STRATA_RETURN_IF_ERROR(backend_->Synchronize(stream));
  return hits;
}

absl::Status DeviceSelectionCache::QueueHitsRead(kernels::Stream stream) {
  if (hits_host_ == nullptr) {
    STRATA_ASSIGN_OR_RETURN(hits_host_, backend_->AllocateHost(sizeof(int64_t)));
    *static_cast<int64_t*>(hits_host_->data()) = 0;
  }
  return backend_->CopyToHostAsync(hits_host_->data(), hit_count_->data(), sizeof(int64_t), stream);
}

int64_t DeviceSelectionCache::QueuedHits() const {
  return hits_host_ == nullptr ? 0 : *static_cast<const int64_t*>(hits_host_->data());
}

}  // namespace strata::engine
