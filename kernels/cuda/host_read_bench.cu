// How fast the GPU can gather scattered pages from pinned host memory into device memory (the GPU
// page cache's fills), by each way the hardware offers (a micro-benchmark on the CUDA runtime and
// the backend's device helpers):
//   memcpy      one cudaMemcpyAsync of all the bytes from one contiguous host range (the link's
//               DMA ceiling)
//   batch       cudaMemcpyBatchAsync, one entry per page (DMA, addresses known to the host)
//   ldg         a kernel of 528 blocks x 256 threads, 16-byte loads of mapped host memory, 4 in
//               flight per thread (the page cache's ResolveCopyKernel)
//   bulk        a kernel whose blocks each keep `stages` pages in flight as single bulk copies
//               (cp.async.bulk host -> shared memory, completed on an mbarrier, then
//               cp.async.bulk shared -> device memory)
// Every rep copies `pages` pages of `page_bytes`, picked at random from the first `window_mib` MiB
// (0: all) of a 2 GiB pinned buffer, and checks one page of the destination. The figure is GB/s
// (1e9 bytes) over the median rep. The buffer comes from
//   hostalloc   cudaHostAlloc (mapped; what CudaBackend::AllocateHost does)
//   thp         mmap + madvise(MADV_HUGEPAGE) (transparent 2 MiB pages), then cudaHostRegister
//   hugetlb     mmap(MAP_HUGETLB) (reserved 2 MiB pages), then cudaHostRegister
// Usage: cuda_host_read_bench [pages=448] [page_bytes=8192] [reps=40] [host=hostalloc]
//                             [window_mib=0]
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <string>
#include <random>
#include <vector>

#include "kernels/cuda/internal/bench_check.h"
#include "kernels/cuda/internal/common.cuh"


namespace {

constexpr int kLdgThreads = 256;
constexpr int kLdgUnroll = 4;

// Item w: page w / chunks, chunk w % chunks of kLdgThreads * kLdgUnroll vectors.
__global__ void __launch_bounds__(kLdgThreads)
    LdgGather(const uint4* __restrict__ host, const int64_t* __restrict__ offsets, int pages,
              int64_t page_vecs, uint4* __restrict__ dst) {
  const int64_t per_chunk = static_cast<int64_t>(kLdgThreads) * kLdgUnroll;
  const int64_t chunks = (page_vecs + per_chunk - 1) / per_chunk;
  const int64_t items = pages * chunks;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const int64_t k = w / chunks;
    const int64_t base = (w % chunks) * per_chunk;
    const uint4* src = host + offsets[k] / 16;
    uint4* d = dst + k * page_vecs;
    strata::kernels::cuda_internal::CopyChunk<kLdgThreads, kLdgUnroll>(d, src, base, page_vecs);
  }
}

using strata::kernels::cuda_internal::BulkCopyToShared;
using strata::kernels::cuda_internal::MbarExpect;
using strata::kernels::cuda_internal::MbarInit;
using strata::kernels::cuda_internal::MbarWait;
using strata::kernels::cuda_internal::SharedAddr;

// One thread per block issues everything: page j of the block goes to stage j % stages; the load
// of page j + stages waits until the store of page j has read its stage.
__global__ void BulkGather(const uint8_t* __restrict__ host, const int64_t* __restrict__ offsets,
                           int pages, int page_bytes, int stages, uint8_t* __restrict__ dst) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[16];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) MbarInit(SharedAddr(&bars[s]), 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const int mine = pages > static_cast<int>(blockIdx.x)
                       ? (pages - 1 - static_cast<int>(blockIdx.x)) / gridDim.x + 1
                       : 0;
  auto stage = [&](int s) { return SharedAddr(smem + static_cast<int64_t>(s) * page_bytes); };
  auto issue_load = [&](int j) {
    const int s = j % stages;
    const uint32_t bar = SharedAddr(&bars[s]);
    MbarExpect(bar, page_bytes);
    BulkCopyToShared(stage(s), host + offsets[blockIdx.x + j * gridDim.x], page_bytes, bar);
  };
  for (int j = 0; j < mine && j < stages; ++j) issue_load(j);
  for (int j = 0; j < mine; ++j) {
    const int s = j % stages;
    MbarWait(SharedAddr(&bars[s]), (j / stages) & 1);
    const int k = blockIdx.x + j * gridDim.x;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                     dst + static_cast<int64_t>(k) * page_bytes),
                 "r"(stage(s)), "r"(page_bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (j + stages < mine) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      issue_load(j + stages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int pages = argc > 1 ? std::atoi(argv[1]) : 448;
  const int page_bytes = argc > 2 ? std::atoi(argv[2]) : 8192;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 40;
  const std::string mode = argc > 4 ? argv[4] : "hostalloc";
  const int64_t window_mib = argc > 5 ? std::atoll(argv[5]) : 0;
  if (pages < 1 || page_bytes < 16 || page_bytes % 16 != 0 || reps < 1 || window_mib < 0 ||
      (mode != "hostalloc" && mode != "thp" && mode != "hugetlb")) {
    std::fprintf(stderr,
                 "usage: cuda_host_read_bench [pages>=1] [page_bytes%%16==0] [reps>=1] "
                 "[hostalloc|thp|hugetlb] [window_mib>=0]\n");
    return 2;
  }
  const int64_t host_bytes = int64_t{2} << 30;
  const int64_t window = window_mib > 0 ? std::min(host_bytes, window_mib << 20) : host_bytes;
  const int64_t host_pages = window / page_bytes;
  if (host_pages < 1) {
    std::fprintf(stderr, "window smaller than a page\n");
    return 2;
  }
  uint8_t* host = nullptr;
  if (mode == "hostalloc") {
    CUDA_BENCH_CHECK(cudaHostAlloc(&host, host_bytes, cudaHostAllocMapped));
  } else {
    const int flags = MAP_PRIVATE | MAP_ANONYMOUS | (mode == "hugetlb" ? MAP_HUGETLB : 0);
    void* p = mmap(nullptr, host_bytes, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "mmap(%s) failed: %s\n", mode.c_str(), std::strerror(errno));
      return 3;
    }
    if (mode == "thp" && madvise(p, host_bytes, MADV_HUGEPAGE) != 0) {
      std::fprintf(stderr, "madvise(MADV_HUGEPAGE) failed: %s\n", std::strerror(errno));
    }
    host = static_cast<uint8_t*>(p);
    std::memset(host, 0, host_bytes);
    CUDA_BENCH_CHECK(
        cudaHostRegister(host, host_bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  }
  for (int64_t i = 0; i < host_bytes; i += 4096) host[i] = static_cast<uint8_t>(i / 4096 * 7 + 1);
  std::memset(host, 0x5a, 1 << 20);
  const int64_t total = static_cast<int64_t>(pages) * page_bytes;
  uint8_t* dst = nullptr;
  int64_t* d_offsets = nullptr;
  CUDA_BENCH_CHECK(cudaMalloc(&dst, total));
  CUDA_BENCH_CHECK(cudaMalloc(&d_offsets, sizeof(int64_t) * pages));
  uint8_t* host_dev = nullptr;
  CUDA_BENCH_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0));
  cudaStream_t stream;
  CUDA_BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CUDA_BENCH_CHECK(cudaEventCreate(&e0));
  CUDA_BENCH_CHECK(cudaEventCreate(&e1));
  int sms = 0;
  CUDA_BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::mt19937_64 rng(7);
  std::vector<int64_t> offsets(pages);
  std::vector<uint8_t> check(page_bytes);
  int bad = 0;

  auto new_offsets = [&]() {
    std::vector<int64_t> pick(pages);
    for (int i = 0; i < pages; ++i) pick[i] = static_cast<int64_t>(rng() % host_pages) * page_bytes;
    offsets = pick;
    CUDA_BENCH_CHECK(cudaMemcpy(d_offsets, offsets.data(), sizeof(int64_t) * pages,
                                cudaMemcpyHostToDevice));
  };
  auto verify = [&]() {
    const int k = static_cast<int>(rng() % pages);
    CUDA_BENCH_CHECK(cudaMemcpy(check.data(), dst + static_cast<int64_t>(k) * page_bytes,
                                page_bytes, cudaMemcpyDeviceToHost));
    if (std::memcmp(check.data(), host + offsets[k], page_bytes) != 0) ++bad;
    CUDA_BENCH_CHECK(cudaMemset(dst, 0, total));
  };
  auto timed = [&](const char* name, auto&& launch, bool gathered) {
    std::vector<double> us;
    for (int r = 0; r < reps + 3; ++r) {
      new_offsets();
      CUDA_BENCH_CHECK(cudaEventRecord(e0, stream));
      launch();
      CUDA_BENCH_CHECK(cudaEventRecord(e1, stream));
      CUDA_BENCH_CHECK(cudaEventSynchronize(e1));
      CUDA_BENCH_CHECK(cudaGetLastError());
      float ms = 0;
      CUDA_BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 3) us.push_back(ms * 1000.0);
      if (gathered) verify();
    }
    const double m = Median(us);
    std::printf("%-28s %10.1f us %8.1f GB/s\n", name, m, total / (m * 1e3));
  };

  std::printf("pages %d x %d bytes = %.2f MiB per rep from %s, window %lld MiB, %d reps, %d SMs\n",
              pages, page_bytes, total / 1048576.0, mode.c_str(),
              static_cast<long long>(window >> 20), reps, sms);
  timed("memcpy (contiguous)", [&] {
    CUDA_BENCH_CHECK(cudaMemcpyAsync(dst, host, total, cudaMemcpyHostToDevice,
                          stream));
  }, false);
  {
    std::vector<void*> dsts(pages);
    std::vector<const void*> srcs(pages);
    std::vector<size_t> sizes(pages, page_bytes);
    timed("batch (DMA per page)", [&] {
      for (int i = 0; i < pages; ++i) {
        dsts[i] = dst + static_cast<int64_t>(i) * page_bytes;
        srcs[i] = host + offsets[i];
      }
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      size_t attr_index = 0;
      CUDA_BENCH_CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), pages, &attr,
                                 &attr_index, 1, stream));
    }, true);
  }
  for (int blocks : {528, 8 * sms}) {
    char name[64];
    std::snprintf(name, sizeof(name), "ldg %d blocks", blocks);
    timed(name, [&] {
      LdgGather<<<blocks, kLdgThreads, 0, stream>>>(reinterpret_cast<const uint4*>(host_dev),
                                                    d_offsets, pages, page_bytes / 16,
                                                    reinterpret_cast<uint4*>(dst));
    }, true);
  }
  for (int stages : {2}) {
    for (int per_sm : {2}) {
      const int smem = stages * page_bytes;
      if (smem > 200 * 1024 / per_sm) continue;
      CUDA_BENCH_CHECK(
          cudaFuncSetAttribute(BulkGather, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const int blocks = std::min(per_sm * sms, pages);
      char name[64];
      std::snprintf(name, sizeof(name), "bulk %d stages %d blocks", stages, blocks);
      timed(name, [&] {
        BulkGather<<<blocks, 32, smem, stream>>>(host_dev, d_offsets, pages, page_bytes, stages,
                                                 dst);
      }, true);
    }
  }
  std::printf("verify: %d bad pages\n", bad);
  return bad == 0 ? 0 : 1;
}
