// Model fingerprint: the identity of a model's math, used to namespace documents and KV pages.
//
// ModelFingerprint hashes (XXH3-128) a canonical description of everything that changes the
// computation: the architecture hyper-parameters of the config (not bos/eos, max positions or the
// declared torch_dtype), then for each tensor in canonical order its HF name, dtype and shape,
// then the bytes of every tensor. Tied embeddings are recorded as such and hashed once. The result
// is deterministic across processes and machines and changes when any weight byte changes.
// Pure function; thread-safe.
#ifndef STRATA_MODEL_FINGERPRINT_H_
#define STRATA_MODEL_FINGERPRINT_H_

#include <string>

#include "model/config.h"
#include "model/weights.h"

namespace strata::model {

// 32 lowercase hex characters (the 128-bit XXH3 digest, big-endian canonical form).
// Reads every weight byte: O(model size).
std::string ModelFingerprint(const ModelConfig& config, const ModelWeights& weights);

// The canonical config description that is hashed (exposed for tests and logs).
std::string CanonicalConfigString(const ModelConfig& config);

}  // namespace strata::model

#endif  // STRATA_MODEL_FINGERPRINT_H_
