// Host-side entry points of kernels/cuda/sampling.cu (private to kernels/cuda): token sampling
// (kernels/backend.h SampleParams) on device-resident logits. Plain pointers only, as launch.h.
#ifndef STRATA_KERNELS_CUDA_INTERNAL_SAMPLING_H_
#define STRATA_KERNELS_CUDA_INTERNAL_SAMPLING_H_

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace strata::kernels::cuda_internal {

// Layout of kernels::SampleRow (checked with static_assert in sampling_backend.cc).
struct DeviceSampleRow {
  double temperature;
  double top_p;
  double u;
  int64_t top_k;
};

// Scratch bytes LaunchSample needs for `rows` x `vocab`: per-row state, double probabilities and
// the rows' key histograms (12 bytes per bin, up to 2^16 bins per row, and 12 per run of 64).
size_t SampleScratchBytes(int rows, int vocab);

// tokens[r] = the sampled token of row r (see kernels/backend.h), -1 when every logit of the row
// is NaN / -inf. A memset of the histograms and three launches (argmax and candidate count;
// probabilities and histograms; the cuts from the histograms),
// no host synchronisation, so it can be captured in a CUDA graph. rows <= 65535, vocab >= 1;
// `scratch` holds SampleScratchBytes(rows, vocab) bytes of device memory, 256-byte aligned.
cudaError_t LaunchSample(const float* logits, int rows, int vocab, const DeviceSampleRow* opts,
                         int32_t* tokens, void* scratch, cudaStream_t stream);

}  // namespace strata::kernels::cuda_internal

#endif  // STRATA_KERNELS_CUDA_INTERNAL_SAMPLING_H_
