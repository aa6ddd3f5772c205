// The encoding of one KV page and of one summary, as stored and sent over the wire.
//
// A page holds up to P tokens of one layer and one KV head: K [P, d] and V [P, d]. Encoding
// (little-endian):
//
//   offset  size  field
//        0     4  magic "SKVP"
//        4     2  format version (kPageFormatVersion)
//        6     1  dtype (kernels::DType: kBF16 or kFP8E4M3)
//        7     1  reserved, 0
//        8     2  page_size P
//       10     2  head_dim d
//       12     2  num_tokens (valid tokens, <= P; the rest of K and V is zero)
//       14     2  reserved, 0
//       16     4  k_scale (f32; fp8: K = fp8 * k_scale; bf16: 1)
//       20     4  v_scale (f32)
//       24     8  checksum: XXH3-64 of bytes [0, 24) and [32, end)
//       32     -  K [P, d] then V [P, d], elements of dtype
//
// bf16 pages are exact for bf16 inputs; fp8 e4m3 pages use per-page scales amax / 448 (half the
// bytes; lossy). A summary is stored as an 8-byte XXH3-64 checksum followed by its bytes.
// Everything here is stateless and thread-safe.
#ifndef STRATA_KVSTORE_PAGE_FORMAT_H_
#define STRATA_KVSTORE_PAGE_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/tensor.h"

namespace strata::kvstore {

inline constexpr uint16_t kPageFormatVersion = 1;
inline constexpr size_t kPageHeaderBytes = 32;

// The shape of a page: what every page of a document shares.
struct PageShape {
  kernels::DType dtype = kernels::DType::kBF16;  // kBF16 or kFP8E4M3
  int page_size = 64;                            // P, 1..65535
  int head_dim = 128;                            // d, 1..65535

  // InvalidArgument unless dtype is bf16/fp8 and the sizes are in range.
  absl::Status Validate() const;
  // Bytes of an encoded page: header + 2 * P * d * sizeof(dtype).
  size_t EncodedBytes() const;
  bool operator==(const PageShape& o) const {
    return dtype == o.dtype && page_size == o.page_size && head_dim == o.head_dim;
  }
};

// The parsed header of an encoded page.
struct PageHeader {
  PageShape shape;
  int num_tokens = 0;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  uint64_t checksum = 0;
};

// Encodes K and V ([n, d] host views, f32 or bf16, n <= P, d == shape.head_dim) into a page.
// InvalidArgument on shape or dtype mismatch. Non-finite inputs are encoded as the dtype
// conversion does (fp8 saturates; NaN stays NaN; a NaN amax gives scale 1).
absl::StatusOr<std::string> EncodePage(const PageShape& shape, const kernels::TensorView& k,
                                       const kernels::TensorView& v);
// The same bytes written to out[0, shape.EncodedBytes()) (e.g. a page buffer being filled).
absl::Status EncodePageTo(const PageShape& shape, const kernels::TensorView& k,
                          const kernels::TensorView& v, char* out);
// A page whose elements were encoded elsewhere (e.g. by kernels::Backend::EncodeFp8Pages): the
// header, K and V ([P, d] each, elements of shape.dtype) and the checksum written to
// out[0, shape.EncodedBytes()). InvalidArgument for a bad shape or num_tokens.
absl::Status AssemblePage(const PageShape& shape, int num_tokens, float k_scale, float v_scale,
                          const void* k, const void* v, char* out);

// Parses the header of `bytes` and checks its size against it. InvalidArgument: too short, bad
// magic, unknown version or dtype, size mismatch. Does not verify the checksum.
absl::StatusOr<PageHeader> ParsePageHeader(absl::string_view bytes);

// ParsePageHeader + checksum verification. DataLoss when the checksum does not match.
absl::StatusOr<PageHeader> VerifyPage(absl::string_view bytes);

// Decodes a verified page into f32 K and V, each [P, d] (all P rows; rows >= num_tokens are 0).
// Verifies first (InvalidArgument / DataLoss as VerifyPage).
absl::Status DecodePage(absl::string_view bytes, float* k, float* v);

// Raw element bytes of K / V of a page that ParsePageHeader accepted: [P, d] of the page dtype.
absl::string_view PageKBytes(absl::string_view bytes);
absl::string_view PageVBytes(absl::string_view bytes);

// K and V of a page that ParsePageHeader accepted as bf16, each [P, d] (uint16 bf16 bits): bf16
// pages copied, fp8 pages dequantised with their scales (fp8 * scale in f32, rounded to bf16).
// For a bf16 consumer of fp8 pages (the host-managed GPU page cache). Does not verify the checksum.
// InvalidArgument when the header does not parse.
absl::Status PageToBf16(absl::string_view bytes, uint16_t* k, uint16_t* v);

// Summary framing: 8-byte checksum + payload.
std::string EncodeSummary(absl::string_view payload);
// Returns the payload. DataLoss on checksum mismatch or a value shorter than 8 bytes.
absl::StatusOr<absl::string_view> DecodeSummary(absl::string_view stored);

// XXH3-64 of `data`.
uint64_t Checksum64(absl::string_view data);

}  // namespace strata::kvstore

#endif  // STRATA_KVSTORE_PAGE_FORMAT_H_
