#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace strata::model {
namespace {

using Json = nlohmann::json;

// Element size of every dtype the safetensors format defines; 0 for unknown names.
uint64_t DTypeBytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

bool ToStrataDType(const std::string& d, kernels::DType* out) {
  if (d == "F32") {
    *out = kernels::DType::kF32;
  } else if (d == "BF16") {
    *out = kernels::DType::kBF16;
  } else if (d == "F16") {
    *out = kernels::DType::kF16;
  } else {
    return false;
  }
  return true;
}

// a * b, false on overflow of uint64.
bool MulOverflow(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

bool GetU64(const Json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer()) {
    int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    *out = static_cast<uint64_t>(s);
    return true;
  }
  return false;
}

absl::Status Malformed(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": malformed safetensors header: ", what));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

}  // namespace

const char* SafetensorsDTypeName(kernels::DType t) {
  switch (t) {
    case kernels::DType::kF32:
      return "F32";
    case kernels::DType::kBF16:
      return "BF16";
    case kernels::DType::kF16:
      return "F16";
    default:
      return nullptr;
  }
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::ErrnoToStatus(err, absl::StrCat("open ", path));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("fstat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, ": truncated safetensors file (", size,
                                            " bytes, header length needs 8)"));
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("mmap ", path, ": ", std::strerror(map_err)));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_ = static_cast<const uint8_t*>(map);
  f->size_ = size;

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | f->map_[i];
  if (header_len > kMaxSafetensorsHeaderBytes) {
    if (header_len > size - 8) {
      return absl::DataLossError(absl::StrCat(path, ": header length ", header_len,
                                              " runs past the end of the file (", size, " bytes)"));
    }
    return Malformed(path, absl::StrCat("header length ", header_len, " exceeds the cap of ",
                                        kMaxSafetensorsHeaderBytes));
  }
  if (header_len > size - 8) {
    return absl::DataLossError(absl::StrCat(path, ": header length ", header_len,
                                            " runs past the end of the file (", size, " bytes)"));
  }
  if (header_len < 2) return Malformed(path, "header shorter than \"{}\"");
  const char* hbegin = reinterpret_cast<const char*>(f->map_ + 8);
  Json header = Json::parse(hbegin, hbegin + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return Malformed(path, "not valid JSON");
  if (!header.is_object()) return Malformed(path, "top level is not an object");

  const uint64_t data_size = size - 8 - header_len;
  f->data_ = f->map_ + 8 + header_len;

  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // (begin, end) of non-empty tensors
  std::vector<const TensorInfo*> range_owner;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    if (name == "__metadata__") {
      if (v.is_null()) continue;
      if (!v.is_object()) return Malformed(path, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return Malformed(path, absl::StrCat("__metadata__.", m.key(), " is not a string"));
        }
        f->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (name.empty()) return Malformed(path, "empty tensor name");
    if (!v.is_object()) return Malformed(path, absl::StrCat("entry '", name, "' is not an object"));
    TensorInfo info;
    info.name = name;
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) {
      return Malformed(path, absl::StrCat("tensor '", name, "' has no string \"dtype\""));
    }
    info.dtype = dt->get<std::string>();
    const uint64_t elem = DTypeBytes(info.dtype);
    if (elem == 0) {
      return Malformed(path,
                       absl::StrCat("tensor '", name, "' has unknown dtype '", info.dtype, "'"));
    }
    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) {
      return Malformed(path, absl::StrCat("tensor '", name, "' has no \"shape\" list"));
    }
    uint64_t count = 1;
    for (const Json& d : *sh) {
      uint64_t dim;
      if (!GetU64(d, &dim) || dim > static_cast<uint64_t>(INT64_MAX)) {
        return Malformed(path,
                         absl::StrCat("tensor '", name, "' has a bad dimension in \"shape\""));
      }
      if (MulOverflow(count, dim, &count)) {
        return Malformed(path, absl::StrCat("tensor '", name, "' shape overflows"));
      }
      info.shape.push_back(static_cast<int64_t>(dim));
    }
    uint64_t nbytes;
    if (MulOverflow(count, elem, &nbytes)) {
      return Malformed(path, absl::StrCat("tensor '", name, "' byte size overflows"));
    }
    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 || !GetU64((*off)[0], &info.begin) ||
        !GetU64((*off)[1], &info.end)) {
      return Malformed(path, absl::StrCat("tensor '", name,
                                          "' needs \"data_offsets\": [begin, end] (non-negative)"));
    }
    if (info.begin > info.end) {
      return Malformed(
          path, absl::StrCat("tensor '", name, "' has begin ", info.begin, " > end ", info.end));
    }
    if (info.end > data_size) {
      return absl::DataLossError(absl::StrCat(path, ": tensor '", name, "' ends at data offset ",
                                              info.end, " past the data area (", data_size,
                                              " bytes): truncated file?"));
    }
    if (info.end - info.begin != nbytes) {
      return Malformed(
          path, absl::StrCat("tensor '", name, "' ", info.dtype, ShapeString(info.shape), " needs ",
                             nbytes, " bytes but data_offsets span ", info.end - info.begin));
    }
    auto [slot, inserted] = f->tensors_.emplace(name, std::move(info));
    if (!inserted) return Malformed(path, absl::StrCat("duplicate tensor '", name, "'"));
    if (slot->second.end > slot->second.begin) {
      ranges.emplace_back(slot->second.begin, slot->second.end);
      range_owner.push_back(&slot->second);
    }
  }
  // No two tensors may share bytes.
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranges[a] < ranges[b]; });
  for (size_t k = 1; k < order.size(); ++k) {
    const auto& prev = ranges[order[k - 1]];
    const auto& cur = ranges[order[k]];
    if (cur.first < prev.second) {
      return Malformed(path, absl::StrCat("tensors '", range_owner[order[k - 1]]->name, "' and '",
                                          range_owner[order[k]]->name, "' overlap"));
    }
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), size_);
}

const SafetensorsFile::TensorInfo* SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::vector<std::string> SafetensorsFile::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& kv : tensors_) names.push_back(kv.first);
  return names;
}

absl::StatusOr<kernels::TensorView> SafetensorsFile::Get(const std::string& name) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", name, "'"));
  kernels::DType dtype;
  if (!ToStrataDType(info->dtype, &dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '", name, "' has dtype ",
                                                   info->dtype,
                                                   " (only F32, BF16, F16 are supported)"));
  }
  const int rank = static_cast<int>(info->shape.size());
  if (rank == 0 || rank > kernels::kMaxRank) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '", name, "' has rank ", rank,
                                                   " (1 to ", kernels::kMaxRank, " supported)"));
  }
  kernels::TensorView v;
  v.data = const_cast<uint8_t*>(data_ + info->begin);
  v.dtype = dtype;
  v.rank = rank;
  for (int i = 0; i < rank; ++i) v.shape[i] = info->shape[i];
  return v;
}

uint64_t SafetensorsEntry::Bytes() const {
  uint64_t n = kernels::DTypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<SafetensorsEntry> entries,
    const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  std::set<std::string> names;
  std::vector<uint64_t> ends;
  uint64_t offset = 0;
  for (const SafetensorsEntry& e : entries) {
    if (e.name.empty() || e.name == "__metadata__") {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors writer: bad tensor name '", e.name, "'"));
    }
    if (!names.insert(e.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors writer: duplicate tensor '", e.name, "'"));
    }
    const char* dt = SafetensorsDTypeName(e.dtype);
    if (dt == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors writer: tensor '", e.name,
                                                     "' has unsupported dtype ",
                                                     kernels::DTypeName(e.dtype)));
    }
    Json shape = Json::array();
    for (int64_t d : e.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("safetensors writer: tensor '", e.name, "' has a negative dimension"));
      }
      shape.push_back(d);
    }
    const uint64_t end = offset + e.Bytes();
    header[e.name] = {{"dtype", dt}, {"shape", shape}, {"data_offsets", {offset, end}}};
    offset = end;
    ends.push_back(end);
  }
  if (!metadata.empty()) {
    Json m = Json::object();
    for (const auto& kv : metadata) m[kv.first] = kv.second;
    header["__metadata__"] = m;
  }
  std::string text = header.dump();
  // The data area starts 8-byte aligned: pad the header with spaces (allowed by the format).
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');

  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->path_ = path;
  w->tmp_path_ = path + ".tmp";
  w->entries_ = std::move(entries);
  w->ends_ = std::move(ends);
  w->file_ = std::fopen(w->tmp_path_.c_str(), "wb");
  if (w->file_ == nullptr) {
    return absl::InternalError(
        absl::StrCat("cannot create ", w->tmp_path_, ": ", std::strerror(errno)));
  }
  std::setvbuf(w->file_, nullptr, _IOFBF, 1 << 20);
  uint8_t len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  if (std::fwrite(len, 1, 8, w->file_) != 8 ||
      std::fwrite(text.data(), 1, text.size(), w->file_) != text.size()) {
    return absl::InternalError(absl::StrCat("write ", w->tmp_path_, ": ", std::strerror(errno)));
  }
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (file_ != nullptr) std::fclose(file_);
  if (!closed_ && !tmp_path_.empty()) std::remove(tmp_path_.c_str());
}

size_t SafetensorsWriter::next_entry() const {
  size_t i = 0;
  while (i < ends_.size() && ends_[i] <= written_) ++i;
  return i;
}

absl::Status SafetensorsWriter::Write(const void* data, size_t bytes) {
  if (file_ == nullptr) return absl::FailedPreconditionError("safetensors writer is closed");
  const uint64_t total = ends_.empty() ? 0 : ends_.back();
  if (bytes > total - written_) {
    return absl::FailedPreconditionError(absl::StrCat("safetensors writer: ", written_ + bytes,
                                                      " bytes written, entries hold ", total));
  }
  if (bytes > 0 && std::fwrite(data, 1, bytes, file_) != bytes) {
    return absl::InternalError(absl::StrCat("write ", tmp_path_, ": ", std::strerror(errno)));
  }
  written_ += bytes;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Close() {
  if (file_ == nullptr) return absl::FailedPreconditionError("safetensors writer is closed");
  const uint64_t total = ends_.empty() ? 0 : ends_.back();
  if (written_ != total) {
    return absl::FailedPreconditionError(
        absl::StrCat("safetensors writer: only ", written_, " of ", total, " data bytes written"));
  }
  bool ok = std::fflush(file_) == 0;
  ok = (::fsync(fileno(file_)) == 0) && ok;
  ok = (std::fclose(file_) == 0) && ok;
  file_ = nullptr;
  if (!ok)
    return absl::InternalError(absl::StrCat("write ", tmp_path_, ": ", std::strerror(errno)));
  if (std::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("rename ", tmp_path_, " -> ", path_, ": ", std::strerror(errno)));
  }
  closed_ = true;
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(tensors.size());
  for (const SafetensorsTensor& t : tensors) entries.push_back({t.name, t.dtype, t.shape});
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> w,
                          SafetensorsWriter::Create(path, std::move(entries), metadata));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t bytes = w->entries()[i].Bytes();
    if (bytes > 0 && tensors[i].data == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors writer: tensor '", tensors[i].name, "' has no data"));
    }
    STRATA_RETURN_IF_ERROR(w->Write(tensors[i].data, bytes));
  }
  return w->Close();
}

}  // namespace strata::model
