#include "kvstore/page_format.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include "xxhash.h"

namespace strata::kvstore {
namespace {

constexpr char kMagic[4] = {'S', 'K', 'V', 'P'};
constexpr size_t kChecksumOffset = 24;
constexpr float kFp8Max = 448.0f;

template <typename T>
void Store(char* p, T v) {
  std::memcpy(p, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
}
template <typename T>
T Load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

uint64_t PageChecksum(absl::string_view bytes) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, bytes.data(), kChecksumOffset);
  XXH3_64bits_update(&state, bytes.data() + kPageHeaderBytes, bytes.size() - kPageHeaderBytes);
  return XXH3_64bits_digest(&state);
}

// Writes the header of a page whose K and V are in place at p + kPageHeaderBytes, then its checksum.
void FinishPage(const PageShape& shape, int num_tokens, float k_scale, float v_scale, char* p) {
  std::memset(p, 0, kPageHeaderBytes);
  std::memcpy(p, kMagic, 4);
  Store<uint16_t>(p + 4, kPageFormatVersion);
  Store<uint8_t>(p + 6, static_cast<uint8_t>(shape.dtype));
  Store<uint16_t>(p + 8, static_cast<uint16_t>(shape.page_size));
  Store<uint16_t>(p + 10, static_cast<uint16_t>(shape.head_dim));
  Store<uint16_t>(p + 12, static_cast<uint16_t>(num_tokens));
  Store<float>(p + 16, k_scale);
  Store<float>(p + 20, v_scale);
  Store<uint64_t>(p + kChecksumOffset, PageChecksum(absl::string_view(p, shape.EncodedBytes())));
}

// Converts rows [n, d] of `src` (f32 or bf16) to f32 in *out, zero-padding to `rows`.
void ToF32(const kernels::TensorView& t, int rows, std::vector<float>* out) {
  const int64_t n = t.dim(0), d = t.dim(1);
  out->assign(static_cast<size_t>(rows) * d, 0.0f);
  kernels::ConvertToF32(t.data, t.dtype, out->data(), n * d);
}

float AbsMax(const std::vector<float>& x) {
  // No early exit, so the loop vectorizes; NaN anywhere gives NaN.
  float m = 0.0f;
  bool nan = false;
  for (float f : x) {
    nan |= std::isnan(f);
    m = std::max(m, std::fabs(f));
  }
  return nan ? NAN : m;
}

absl::Status CheckInput(const PageShape& shape, const kernels::TensorView& t, const char* name) {
  if (t.rank != 2 || t.dim(1) != shape.head_dim || t.dim(0) < 0 || t.dim(0) > shape.page_size) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be [n <= ", shape.page_size, ", ",
                                                   shape.head_dim, "], got ", t.DebugString()));
  }
  if (t.dtype != kernels::DType::kF32 && t.dtype != kernels::DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be f32 or bf16, got ",
                                                   t.DebugString()));
  }
  if (t.data == nullptr && t.dim(0) > 0) return absl::InvalidArgumentError("null page data");
  return absl::OkStatus();
}

}  // namespace

absl::Status PageShape::Validate() const {
  if (dtype != kernels::DType::kBF16 && dtype != kernels::DType::kFP8E4M3) {
    return absl::InvalidArgumentError(
        absl::StrCat("page dtype must be bf16 or fp8_e4m3, got ", kernels::DTypeName(dtype)));
  }
  if (page_size < 1 || page_size > 65535 || head_dim < 1 || head_dim > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size and head_dim must be in [1, 65535], got ", page_size, ", ",
                     head_dim));
  }
  return absl::OkStatus();
}

size_t PageShape::EncodedBytes() const {
  return kPageHeaderBytes + 2 * static_cast<size_t>(page_size) * head_dim * kernels::DTypeSize(dtype);
}

absl::StatusOr<std::string> EncodePage(const PageShape& shape, const kernels::TensorView& k,
                                       const kernels::TensorView& v) {
  if (absl::Status s = shape.Validate(); !s.ok()) return s;
  std::string out(shape.EncodedBytes(), '\0');
  if (absl::Status s = EncodePageTo(shape, k, v, out.data()); !s.ok()) return s;
  return out;
}

absl::Status EncodePageTo(const PageShape& shape, const kernels::TensorView& k,
                          const kernels::TensorView& v, char* out) {
  if (absl::Status s = shape.Validate(); !s.ok()) return s;
  if (absl::Status s = CheckInput(shape, k, "K"); !s.ok()) return s;
  if (absl::Status s = CheckInput(shape, v, "V"); !s.ok()) return s;
  if (k.dim(0) != v.dim(0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("K and V token counts differ: ", k.dim(0), " vs ", v.dim(0)));
  }
  const int n = static_cast<int>(k.dim(0));
  const size_t elems = static_cast<size_t>(shape.page_size) * shape.head_dim;
  const size_t esize = kernels::DTypeSize(shape.dtype);
  char* p = out;
  std::memset(p, 0, shape.EncodedBytes());
  char* kdst = p + kPageHeaderBytes;
  char* vdst = kdst + elems * esize;
  float scales[2] = {1.0f, 1.0f};
  const kernels::TensorView* srcs[2] = {&k, &v};
  char* dsts[2] = {kdst, vdst};
  for (int i = 0; i < 2; ++i) {
    const kernels::TensorView& src = *srcs[i];
    if (shape.dtype == kernels::DType::kBF16 && src.dtype == kernels::DType::kBF16) {
      std::memcpy(dsts[i], src.data, static_cast<size_t>(n) * shape.head_dim * esize);
      continue;
    }
    thread_local std::vector<float> f;  // scratch: pages are encoded one after another
    ToF32(src, shape.page_size, &f);
    if (shape.dtype == kernels::DType::kFP8E4M3) {
      const float amax = AbsMax(f);
      const float scale = (std::isfinite(amax) && amax > 0.0f) ? amax / kFp8Max : 1.0f;
      scales[i] = scale;
      for (float& x : f) x /= scale;
    }
    kernels::ConvertFromF32(f.data(), dsts[i], shape.dtype, static_cast<int64_t>(elems));
  }
  FinishPage(shape, n, scales[0], scales[1], p);
  return absl::OkStatus();
}

absl::Status AssemblePage(const PageShape& shape, int num_tokens, float k_scale, float v_scale,
                          const void* k, const void* v, char* out) {
  if (absl::Status s = shape.Validate(); !s.ok()) return s;
  if (num_tokens < 0 || num_tokens > shape.page_size) {
    return absl::InvalidArgumentError(absl::StrCat("page: num_tokens ", num_tokens, " not in [0, ", shape.page_size, "]"));
  }
  const size_t half = static_cast<size_t>(shape.page_size) * shape.head_dim * kernels::DTypeSize(shape.dtype);
  std::memcpy(out + kPageHeaderBytes, k, half);
  std::memcpy(out + kPageHeaderBytes + half, v, half);
  FinishPage(shape, num_tokens, k_scale, v_scale, out);
  return absl::OkStatus();
}

absl::StatusOr<PageHeader> ParsePageHeader(absl::string_view bytes) {
  if (bytes.size() < kPageHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("page too short: ", bytes.size(), " bytes, header is ", kPageHeaderBytes));
  }
  const char* p = bytes.data();
  if (std::memcmp(p, kMagic, 4) != 0) return absl::InvalidArgumentError("page: bad magic");
  const uint16_t version = Load<uint16_t>(p + 4);
  if (version != kPageFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat("page: unknown format version ", version));
  }
  PageHeader h;
  const uint8_t dtype = Load<uint8_t>(p + 6);
  if (dtype != static_cast<uint8_t>(kernels::DType::kBF16) &&
      dtype != static_cast<uint8_t>(kernels::DType::kFP8E4M3)) {
    return absl::InvalidArgumentError(absl::StrCat("page: unsupported dtype ", int{dtype}));
  }
  h.shape.dtype = static_cast<kernels::DType>(dtype);
  h.shape.page_size = Load<uint16_t>(p + 8);
  h.shape.head_dim = Load<uint16_t>(p + 10);
  h.num_tokens = Load<uint16_t>(p + 12);
  h.k_scale = Load<float>(p + 16);
  h.v_scale = Load<float>(p + 20);
  h.checksum = Load<uint64_t>(p + kChecksumOffset);
  if (absl::Status s = h.shape.Validate(); !s.ok()) return s;
  if (h.num_tokens > h.shape.page_size) {
    return absl::InvalidArgumentError(absl::StrCat("page: num_tokens ", h.num_tokens,
                                                   " > page_size ", h.shape.page_size));
  }
  if (bytes.size() != h.shape.EncodedBytes()) {
    return absl::InvalidArgumentError(absl::StrCat("page: ", bytes.size(), " bytes, expected ",
                                                   h.shape.EncodedBytes(), " for its header"));
  }
  return h;
}

absl::StatusOr<PageHeader> VerifyPage(absl::string_view bytes) {
  absl::StatusOr<PageHeader> h = ParsePageHeader(bytes);
  if (!h.ok()) return h.status();
  const uint64_t actual = PageChecksum(bytes);
  if (actual != h->checksum) {
    return absl::DataLossError(absl::StrCat("page checksum mismatch: stored ", h->checksum,
                                            ", computed ", actual));
  }
  return h;
}

absl::Status DecodePage(absl::string_view bytes, float* k, float* v) {
  absl::StatusOr<PageHeader> h = VerifyPage(bytes);
  if (!h.ok()) return h.status();
  const int64_t elems = static_cast<int64_t>(h->shape.page_size) * h->shape.head_dim;
  kernels::ConvertToF32(PageKBytes(bytes).data(), h->shape.dtype, k, elems);
  kernels::ConvertToF32(PageVBytes(bytes).data(), h->shape.dtype, v, elems);
  if (h->shape.dtype == kernels::DType::kFP8E4M3) {
    for (int64_t i = 0; i < elems; ++i) {
      k[i] *= h->k_scale;
      v[i] *= h->v_scale;
    }
  }
  return absl::OkStatus();
}

absl::Status PageToBf16(absl::string_view bytes, uint16_t* k, uint16_t* v) {
  absl::StatusOr<PageHeader> h = ParsePageHeader(bytes);
  if (!h.ok()) return h.status();
  const size_t elems = static_cast<size_t>(h->shape.page_size) * h->shape.head_dim;
  const absl::string_view kb = PageKBytes(bytes), vb = PageVBytes(bytes);
  if (h->shape.dtype == kernels::DType::kBF16) {
    std::memcpy(k, kb.data(), elems * sizeof(uint16_t));
    std::memcpy(v, vb.data(), elems * sizeof(uint16_t));
    return absl::OkStatus();
  }
  // fp8 -> f32 (the table), * scale, -> bf16 through the array conversions (vectorized; the same
  // values as the element functions).
  thread_local std::vector<float> f;
  f.resize(elems);
  const absl::string_view halves[2] = {kb, vb};
  uint16_t* outs[2] = {k, v};
  const float scales[2] = {h->k_scale, h->v_scale};
  for (int i = 0; i < 2; ++i) {
    kernels::ConvertToF32(halves[i].data(), kernels::DType::kFP8E4M3, f.data(), static_cast<int64_t>(elems));
    for (float& x : f) x *= scales[i];
    kernels::ConvertFromF32(f.data(), outs[i], kernels::DType::kBF16, static_cast<int64_t>(elems));
  }
  return absl::OkStatus();
}

absl::string_view PageKBytes(absl::string_view bytes) {
  const size_t half = (bytes.size() - kPageHeaderBytes) / 2;
  return bytes.substr(kPageHeaderBytes, half);
}

absl::string_view PageVBytes(absl::string_view bytes) {
  const size_t half = (bytes.size() - kPageHeaderBytes) / 2;
  return bytes.substr(kPageHeaderBytes + half, half);
}

std::string EncodeSummary(absl::string_view payload) {
  std::string out(8 + payload.size(), '\0');
  Store<uint64_t>(out.data(), Checksum64(payload));
  std::memcpy(out.data() + 8, payload.data(), payload.size());
  return out;
}

absl::StatusOr<absl::string_view> DecodeSummary(absl::string_view stored) {
  if (stored.size() < 8) return absl::DataLossError("summary shorter than its checksum");
  absl::string_view payload = stored.substr(8);
  if (Load<uint64_t>(stored.data()) != Checksum64(payload)) {
    return absl::DataLossError("summary checksum mismatch");
  }
  return payload;
}

uint64_t Checksum64(absl::string_view data) { return XXH3_64bits(data.data(), data.size()); }

}  // namespace strata::kvstore
