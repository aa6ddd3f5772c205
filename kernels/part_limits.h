// The shape of a selection in independent parts (VoteTopKParams::partitions,
// SelectStagesParams::partitions; kernels/backend.h) that every backend runs. The CUDA backend
// selects a part in one thread block (kernels/cuda/selection.cu: PartStagesKernel,
// PartVoteTopKKernel), which holds at most kMaxPartGroup query heads' scores per candidate and
// kMaxPartCandidates candidates of a stage; past that its VoteTopK and SelectStages with
// partitions > 1 are Unimplemented (the CPU backend runs any shape). The policies' default part
// count (engine/sparse/policy.h PolicyOptions::EffectivePartitions) stays inside it.
//
// Included by .cc and .cu files.
#ifndef STRATA_KERNELS_PART_LIMITS_H_
#define STRATA_KERNELS_PART_LIMITS_H_

#include <cstdint>

namespace strata::kernels {

inline constexpr int kMaxPartGroup = 4;
inline constexpr int64_t kMaxPartCandidates = 4096;

}  // namespace strata::kernels

#endif  // STRATA_KERNELS_PART_LIMITS_H_
