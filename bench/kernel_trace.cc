// kernel_trace: a CUDA injection library that records every kernel's GPU start and end time with
// CUPTI's activity API (no Nsight Systems on the GPU machines), for "where does a decode step's
// time go" questions about any Strata binary, CUDA graphs included.
//
// Use: CUDA_INJECTION64_PATH=/path/libstrata_kernel_trace.so STRATA_KERNEL_TRACE_OUT=trace.tsv
// <any CUDA program>. The CUDA driver loads the library and calls InitializeInjection at the
// program's first CUDA call; at exit the library flushes CUPTI's buffers and writes one line per
// kernel (tab-separated): start_ns, end_ns, correlation id, graph id, graph node id, stream id,
// grid size, block size, name (demangled, cut at 160 characters). Kernels of one CUDA graph launch
// share the launch's correlation id. scripts/kernel_trace_summary.py groups a trace's graph
// launches and says where their time goes. With STRATA_KERNEL_TRACE_SKIP_NONGRAPH=1 kernels outside
// graphs are not written. With STRATA_KERNEL_TRACE_API=1 copies (in graphs or not) ("memcpy kind K, N bytes") and
// runtime API calls ("api NAME", host start and end on the same clock; graph 0; the stream
// column holds the calling thread's id) are written too.
// Without STRATA_KERNEL_TRACE_OUT the library only prints a count.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8u << 20;
constexpr size_t kNameChars = 160;

struct Record {
  uint64_t start, end, graph_node;
  uint32_t correlation, graph, stream;
  int64_t grid, block;
  uint32_t name;  // index into Names()
};

// Never destroyed: the trace is written by an atexit handler, which may run after the
// destructors of statics made later than its registration.
std::mutex& Mu() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::vector<Record>& Records() {
  static auto* r = new std::vector<Record>;
  return *r;
}
std::vector<std::string>& Names() {
  static auto* n = new std::vector<std::string>;
  return *n;
}
std::unordered_map<const char*, uint32_t>& NameIndex() {
  static auto* m = new std::unordered_map<const char*, uint32_t>;
  return *m;
}
bool g_skip_nongraph = false;
uint64_t g_dropped = 0;

// A record's name as an index into Names(), one entry per distinct text.
uint32_t InternText(const std::string& text) {
  static auto* idx = new std::unordered_map<std::string, uint32_t>;
  auto it = idx->find(text);
  if (it != idx->end()) return it->second;
  const uint32_t i = static_cast<uint32_t>(Names().size());
  Names().push_back(text);
  idx->emplace(text, i);
  return i;
}

// A kernel's mangled name, demangled and cut once per pointer (CUPTI keeps one string per
// function).
uint32_t Intern(const char* mangled) {
  auto& idx = NameIndex();
  auto it = idx.find(mangled);
  if (it != idx.end()) return it->second;
  std::string name = mangled != nullptr ? mangled : "?";
  int status = 0;
  char* d = mangled != nullptr ? abi::__cxa_demangle(mangled, nullptr, nullptr, &status) : nullptr;
  if (d != nullptr && status == 0) name = d;
  std::free(d);
  if (name.size() > kNameChars) name.resize(kNameChars);
  for (char& c : name) {
    if (c == '\t' || c == '\n') c = ' ';
  }
  const uint32_t i = InternText(name);
  idx.emplace(mangled, i);
  return i;
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(Mu());
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      char name[64];
      std::snprintf(name, sizeof(name), "memcpy kind %u, %llu bytes", m->copyKind,
                    static_cast<unsigned long long>(m->bytes));
      Records().push_back({m->start, m->end, m->graphNodeId, m->correlationId, m->graphId,
                           m->streamId, 0, 0, InternText(name)});
      continue;
    }
    if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
      const auto* api = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
      const char* name = nullptr;
      cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, api->cbid, &name);
      // The stream column holds the calling thread's id for API records.
      Records().push_back({api->start, api->end, 0, api->correlationId, 0, api->threadId, 0, 0,
                           InternText(std::string("api ") + (name != nullptr ? name : "?"))});
      continue;
    }
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    if (g_skip_nongraph && k->graphId == 0) continue;
    Record r;
    r.start = k->start;
    r.end = k->end;
    r.graph_node = k->graphNodeId;
    r.correlation = k->correlationId;
    r.graph = k->graphId;
    r.stream = k->streamId;
    r.grid = static_cast<int64_t>(k->gridX) * k->gridY * k->gridZ;
    r.block = static_cast<int64_t>(k->blockX) * k->blockY * k->blockZ;
    r.name = Intern(k->name);
    Records().push_back(r);
  }
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped) == CUPTI_SUCCESS) {
    g_dropped += dropped;
  }
  std::free(buffer);
}

void WriteTrace() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard<std::mutex> lock(Mu());
  const char* path = std::getenv("STRATA_KERNEL_TRACE_OUT");
  std::fprintf(stderr, "kernel_trace: %zu kernels recorded, %llu dropped%s%s\n",
               Records().size(), static_cast<unsigned long long>(g_dropped),
               path != nullptr ? ", written to " : "", path != nullptr ? path : "");
  if (path == nullptr) return;
  FILE* f = std::fopen(path, "w");
  if (f == nullptr) {
    std::fprintf(stderr, "kernel_trace: cannot open %s: %s\n", path, std::strerror(errno));
    return;
  }
  std::fprintf(f, "start_ns\tend_ns\tcorrelation\tgraph\tgraph_node\tstream\tgrid\tblock\tname\n");
  for (const Record& r : Records()) {
    std::fprintf(f, "%llu\t%llu\t%u\t%u\t%llu\t%u\t%lld\t%lld\t%s\n",
                 static_cast<unsigned long long>(r.start), static_cast<unsigned long long>(r.end),
                 r.correlation, r.graph, static_cast<unsigned long long>(r.graph_node), r.stream,
                 static_cast<long long>(r.grid), static_cast<long long>(r.block),
                 Names()[r.name].c_str());
  }
  std::fclose(f);
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" __attribute__((visibility("default"))) int InitializeInjection() {
  const char* skip = std::getenv("STRATA_KERNEL_TRACE_SKIP_NONGRAPH");
  g_skip_nongraph = skip != nullptr && std::strcmp(skip, "1") == 0;
  if (cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "kernel_trace: CUPTI activity tracing could not be enabled\n");
    return 0;
  }
  // Copies and runtime API calls (host time, same clock) with STRATA_KERNEL_TRACE_API=1.
  const char* api = std::getenv("STRATA_KERNEL_TRACE_API");
  if (api != nullptr && std::strcmp(api, "1") == 0) {
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME) != CUPTI_SUCCESS) {
      std::fprintf(stderr, "kernel_trace: copies and API calls cannot be traced\n");
    }
  }
  std::atexit(WriteTrace);
  return 1;
}
