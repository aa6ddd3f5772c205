// Safetensors files: a validating read-only reader backed by mmap, and a streaming writer.
//
// Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N
// bytes of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"k": "v"}}, then the data area; offsets are relative to the data area.
//
// SafetensorsFile::Open validates the whole header before any tensor is exposed: header length
// within the file and below kMaxHeaderBytes, valid JSON, every entry well-formed, a known dtype,
// offsets inside the data area with begin <= end, no two tensors overlapping, and byte length ==
// product(shape) * dtype size. Any violation is a Status, never a crash or an out-of-bounds read.
// Tensors of dtypes Strata does not compute with (I64, U8, ...) may be present; Get() rejects them.
//
// A SafetensorsFile is immutable after Open and safe to use from many threads. Views returned by
// Get() point into a read-only mapping: never write through them; they are valid while the
// SafetensorsFile lives. SafetensorsWriter is thread-compatible.
#ifndef STRATA_MODEL_SAFETENSORS_H_
#define STRATA_MODEL_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace strata::model {

// Largest header accepted (the reference implementation uses the same 100 MB cap).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100u << 20;

// "F32", "BF16", "F16" for the dtypes Strata reads and writes; nullptr otherwise.
const char* SafetensorsDTypeName(kernels::DType t);

class SafetensorsFile {
 public:
  struct TensorInfo {
    std::string name;
    std::string dtype;           // as spelled in the file: "F32", "BF16", "I64", ...
    std::vector<int64_t> shape;  // may be empty (a scalar)
    uint64_t begin = 0;          // byte offsets into the data area, begin <= end
    uint64_t end = 0;
  };

  // Maps `path` read-only and validates its header (see the file comment).
  // NotFound: no such file. DataLoss: truncated file (shorter than 8 bytes, header or data past
  // the end of the file). InvalidArgument: malformed header (bad JSON, missing or mistyped
  // fields, unknown dtype, overlapping tensors, shape/bytes mismatch, header above the cap).
  // Internal: mmap failed. Messages name the file and the tensor.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // A view of tensor `name` into the mapping. NotFound when absent; InvalidArgument when its dtype
  // is not F32/BF16/F16 or its rank is 0 or above kernels::kMaxRank.
  absl::StatusOr<kernels::TensorView> Get(const std::string& name) const;
  // Header entry of `name`, or nullptr.
  const TensorInfo* Find(const std::string& name) const;
  // All tensor names, sorted.
  std::vector<std::string> TensorNames() const;
  size_t num_tensors() const { return tensors_.size(); }
  // The "__metadata__" map (string values only).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }

 private:
  SafetensorsFile() = default;

  std::string path_;
  const uint8_t* map_ = nullptr;
  uint64_t size_ = 0;
  const uint8_t* data_ = nullptr;  // start of the data area
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor of a file to write.
struct SafetensorsEntry {
  std::string name;
  kernels::DType dtype = kernels::DType::kF32;  // F32, BF16 or F16
  std::vector<int64_t> shape;

  uint64_t Bytes() const;
};

// Writes a safetensors file in one pass without holding all tensors in memory: the header (all
// entries known up front, data area starting 8-byte aligned) goes out at Create, then each
// tensor's bytes in entry order through Write(), possibly in several pieces. The file appears
// under `path` only on a successful Close() (written to "<path>.tmp" and renamed).
class SafetensorsWriter {
 public:
  // InvalidArgument: empty or duplicate names, a name "__metadata__", unsupported dtypes,
  // negative dims. Internal: the file cannot be created or written.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<SafetensorsEntry> entries,
      const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();  // removes the temporary file when Close() was not reached

  // Appends the next `bytes` bytes of the data area (tensors in entry order).
  // FailedPrecondition when more bytes are written than the entries hold.
  absl::Status Write(const void* data, size_t bytes);
  // Index of the entry the next Write() continues, entries().size() when all are complete.
  size_t next_entry() const;
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // Flushes, checks every byte was written (FailedPrecondition otherwise) and renames into place.
  absl::Status Close();

 private:
  SafetensorsWriter() = default;

  std::string path_, tmp_path_;
  std::FILE* file_ = nullptr;
  std::vector<SafetensorsEntry> entries_;
  std::vector<uint64_t> ends_;  // cumulative end offset of each entry
  uint64_t written_ = 0;
  bool closed_ = false;
};

// A tensor held in memory, for WriteSafetensors.
struct SafetensorsTensor {
  std::string name;
  kernels::DType dtype = kernels::DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // product(shape) * DTypeSize(dtype) bytes
};

// Writes `tensors` (in this order) and `metadata` to `path`. Errors as SafetensorsWriter.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace strata::model

#endif  // STRATA_MODEL_SAFETENSORS_H_
