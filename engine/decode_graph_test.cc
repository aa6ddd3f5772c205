// TransformerOptions::decode_graph (issue #6): one-token steps replayed as a CUDA graph must give
// the normal path's greedy tokens and logits over 32 steps of small random models with head_dim
// 64 and 128, f32 and bf16 KV, across a change of cache (a second sequence captures again); on
// the CPU backend the option changes nothing (no graph, bit-identical logits). The GPU tests skip
// with "no CUDA GPU" without one.
// Tolerance: the attention runs through another kernel (SelectedAttention instead of the
// PagedAttention decode kernel), so outputs differ by float rounding: 1e-4 absolute on the logits
// with f32 KV (measured on the H100: at most 5e-6). With bf16 KV such a difference in a layer's
// output can flip the bf16 rounding of a K/V element stored for the next layer (one bf16 ulp,
// 0.4%), which moved one logit of 3.96 by 1.2e-4 in the H100 run; bf16 KV gets 1e-3.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "engine/attention_policy.h"
#include "engine/internal/test_model.h"
#include "engine/kv_cache.h"
#include "engine/transformer.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/testing/capturing_backend.h"
#include "kernels/testing/cuda_plugin_backend.h"

namespace strata::engine {
namespace {

using kernels::DType;
using test_model::TestModel;
using ::strata::testing::StatusIs;

// A random Llama-shaped model with the given head_dim (4 query heads, 2 KV heads, 2 layers).
std::unique_ptr<TestModel> MakeWideModel(int head_dim, DType dtype) {
  auto m = std::make_unique<TestModel>();
  model::ModelConfig& c = m->config;
  c.arch = model::Architecture::kLlama;
  c.vocab_size = 301;
  c.hidden_size = 128;
  c.intermediate_size = 192;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = head_dim;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 4096;
  c.tie_word_embeddings = false;
  c.attention_bias = false;
  c.eos_token_ids = {1};
  c.torch_dtype = dtype;
  m->storage.reserve(64);
  m->values.reserve(64);
  std::mt19937 rng(4242 + head_dim);
  const int64_t h = c.hidden_size, qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  const int64_t f = c.intermediate_size;
  const std::vector<float>* unused = nullptr;
  model::ModelWeights& w = m->weights;
  w.embed_tokens = m->Make(rng, dtype, {c.vocab_size, h}, 1.0f, false, &unused);
  for (int l = 0; l < c.num_layers; ++l) {
    model::LayerWeights lw;
    lw.input_norm = m->Make(rng, dtype, {h}, 0, true, &unused);
    lw.q_proj = m->Make(rng, dtype, {qd, h}, 0.15f, false, &unused);
    lw.k_proj = m->Make(rng, dtype, {kvd, h}, 0.15f, false, &unused);
    lw.v_proj = m->Make(rng, dtype, {kvd, h}, 0.15f, false, &unused);
    lw.o_proj = m->Make(rng, dtype, {h, qd}, 0.1f, false, &unused);
    lw.post_attention_norm = m->Make(rng, dtype, {h}, 0, true, &unused);
    lw.gate_proj = m->Make(rng, dtype, {f, h}, 0.15f, false, &unused);
    lw.up_proj = m->Make(rng, dtype, {f, h}, 0.15f, false, &unused);
    lw.down_proj = m->Make(rng, dtype, {h, f}, 0.1f, false, &unused);
    w.layers.push_back(lw);
  }
  w.final_norm = m->Make(rng, dtype, {h}, 0, true, &unused);
  w.lm_head = m->Make(rng, dtype, {c.vocab_size, h}, 0.5f, false, &unused);
  return m;
}

int32_t Argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// Runs a prompt and `steps` greedy steps on `plain` and `graph` (decode_graph) side by side, each
// with its own cache; compares every step's logits and tokens.
void CompareSequences(Transformer* plain, Transformer* graph, DType kv_dtype, int prompt_len,
                      int steps, uint32_t seed, double tol) {
  const model::ModelConfig& c = plain->config();
  std::mt19937 rng(seed);
  std::vector<int32_t> prompt(prompt_len);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % c.vocab_size);
  const int64_t max_tokens = prompt_len + steps + 5;  // not a multiple of the page size
  auto cache_a = KvCache::Create(plain->MakeCacheOptions(max_tokens, 16, kv_dtype), plain->backend());
  auto cache_b = KvCache::Create(graph->MakeCacheOptions(max_tokens, 16, kv_dtype), graph->backend());
  ASSERT_TRUE(cache_a.ok() && cache_b.ok());
  std::unique_ptr<AttentionPolicy> pol_a = MakeDensePolicy(), pol_b = MakeDensePolicy();
  std::vector<float> la(c.vocab_size), lb(c.vocab_size);
  STRATA_ASSERT_OK(plain->Forward(prompt.data(), prompt_len, 0, cache_a->get(), pol_a.get(),
                                  la.data(), false));
  STRATA_ASSERT_OK(graph->Forward(prompt.data(), prompt_len, 0, cache_b->get(), pol_b.get(),
                                  lb.data(), false));
  int32_t ta = Argmax(la), tb = Argmax(lb);
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    ASSERT_EQ(ta, tb) << "step " << s;
    const int64_t pos = prompt_len + s;
    STRATA_ASSERT_OK(plain->Forward(&ta, 1, pos, cache_a->get(), pol_a.get(), la.data(), false));
    STRATA_ASSERT_OK(graph->Forward(&tb, 1, pos, cache_b->get(), pol_b.get(), lb.data(), false));
    for (int i = 0; i < c.vocab_size; ++i) {
      const double d = std::fabs(static_cast<double>(la[i]) - lb[i]);
      worst = std::max(worst, d);
      ASSERT_LE(d, tol) << "step " << s << " logit " << i << ": " << la[i] << " vs " << lb[i];
    }
    ta = Argmax(la);
    tb = Argmax(lb);
  }
  EXPECT_EQ(ta, tb);
  EXPECT_EQ((*cache_b)->length(0), prompt_len + steps);
  std::printf("  head_dim %d kv %s: %d steps, max |logit diff| %.3g\n",
              static_cast<int>(c.head_dim), kernels::DTypeName(kv_dtype), steps, worst);
}

// ForwardOptions::device_token: `piped` runs the prompt and `steps` greedy steps with each pick
// made on the device (Backend::Sample over device_logits) and read by the next step there, the
// next step queued before the host has the pick (picks copied back behind marks, read one step
// late); `plain` runs them fed with host ids. The same tokens.
void CompareDeviceTokens(Transformer* plain, Transformer* piped, DType kv_dtype, int prompt_len,
                         int steps, uint32_t seed) {
  const model::ModelConfig& c = plain->config();
  kernels::Backend* be = piped->backend();
  std::mt19937 rng(seed);
  std::vector<int32_t> prompt(prompt_len);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % c.vocab_size);
  const int64_t max_tokens = prompt_len + steps + 5;
  auto cache_a = KvCache::Create(plain->MakeCacheOptions(max_tokens, 16, kv_dtype), plain->backend());
  auto cache_b = KvCache::Create(piped->MakeCacheOptions(max_tokens, 16, kv_dtype), be);
  ASSERT_TRUE(cache_a.ok() && cache_b.ok());
  std::unique_ptr<AttentionPolicy> pol_a = MakeDensePolicy(), pol_b = MakeDensePolicy();
  // The host-fed sequence: the prompt's pick, then each step's.
  std::vector<float> la(c.vocab_size);
  STRATA_ASSERT_OK(plain->Forward(prompt.data(), prompt_len, 0, cache_a->get(), pol_a.get(),
                                  la.data(), false));
  std::vector<int32_t> want;
  int32_t ta = Argmax(la);
  for (int s = 0; s < steps; ++s) {
    want.push_back(ta);
    STRATA_ASSERT_OK(
        plain->Forward(&ta, 1, prompt_len + s, cache_a->get(), pol_a.get(), la.data(), false));
    ta = Argmax(la);
  }
  want.push_back(ta);
  // The piped sequence.
  STRATA_ASSERT_OK_AND_ASSIGN(auto row, be->Allocate(sizeof(kernels::SampleRow)));
  STRATA_ASSERT_OK_AND_ASSIGN(auto token, be->Allocate(sizeof(int32_t)));
  STRATA_ASSERT_OK_AND_ASSIGN(auto host, be->AllocateHost(2 * sizeof(int32_t)));
  const kernels::SampleRow greedy;
  STRATA_ASSERT_OK(be->CopyToDevice(row->data(), &greedy, sizeof(greedy), nullptr));
  int32_t* slots = static_cast<int32_t*>(host->data());
  int64_t marks[2] = {-1, -1};
  std::vector<int32_t> got;
  auto pick = [&](int i) -> absl::Status {  // pick i into the device token and host slot i % 2
    kernels::SampleParams sp;
    sp.logits = piped->device_logits();
    sp.rows = static_cast<const kernels::SampleRow*>(row->data());
    sp.tokens = token->View(DType::kI32, {1});
    STRATA_RETURN_IF_ERROR(be->Sample(sp, nullptr));
    STRATA_RETURN_IF_ERROR(
        be->CopyToHostAsync(&slots[i % 2], token->data(), sizeof(int32_t), nullptr));
    STRATA_ASSIGN_OR_RETURN(marks[i % 2], be->RecordMark(nullptr));
    return absl::OkStatus();
  };
  auto take = [&](int i) -> absl::Status {
    STRATA_RETURN_IF_ERROR(be->WaitMark(marks[i % 2]));
    got.push_back(slots[i % 2]);
    return absl::OkStatus();
  };
  ForwardOptions fo;
  fo.logits_on_device = true;
  STRATA_ASSERT_OK(piped->Forward(prompt.data(), prompt_len, 0, cache_b->get(), pol_b.get(),
                                  nullptr, false, fo));
  STRATA_ASSERT_OK(pick(0));
  fo.device_token = static_cast<const int32_t*>(token->data());
  for (int s = 0; s < steps; ++s) {
    STRATA_ASSERT_OK(piped->Forward(nullptr, 1, prompt_len + s, cache_b->get(), pol_b.get(),
                                    nullptr, false, fo));
    STRATA_ASSERT_OK(pick(s + 1));
    STRATA_ASSERT_OK(take(s));  // the pick before this step's, while this step may still run
  }
  STRATA_ASSERT_OK(take(steps));
  EXPECT_EQ(got, want);
  EXPECT_EQ((*cache_b)->length(0), prompt_len + steps);
  // device_token is for one-token calls.
  int32_t two[2] = {1, 2};
  EXPECT_THAT(piped->Forward(two, 2, prompt_len + steps, cache_b->get(), pol_b.get(), nullptr,
                             false, fo),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

std::unique_ptr<kernels::Backend> CudaBackendOrNull(std::string* why) {
  return kernels::testing::CudaPluginBackendOrNull(STRATA_CUDA_PLUGIN_PATH, why);
}

// A CUDA backend, a head_dim-128 model with bf16 weights and two Transformers over it, without
// and with decode_graph. False (the reason in *why) without a GPU or when something fails.
struct GraphPair {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<TestModel> model;
  std::unique_ptr<Transformer> plain, graph;
};
bool MakeGraphPair(GraphPair* p, std::string* why,
                   WeightFormat format = WeightFormat::kCheckpoint) {
  p->backend = CudaBackendOrNull(why);
  if (p->backend == nullptr) return false;
  p->model = MakeWideModel(128, DType::kBF16);
  TransformerOptions plain_o, graph_o;
  plain_o.weight_format = graph_o.weight_format = format;
  graph_o.decode_graph = true;
  auto plain = Transformer::Create(p->model->config, p->model->weights, p->backend.get(), plain_o);
  auto graph = Transformer::Create(p->model->config, p->model->weights, p->backend.get(), graph_o);
  if (!plain.ok() || !graph.ok()) {
    *why = (plain.ok() ? graph.status() : plain.status()).ToString();
    return false;
  }
  p->plain = *std::move(plain);
  p->graph = *std::move(graph);
  return true;
}

TEST(DecodeGraphTest, ReplayMatchesNormalPathOnGpu) {
  std::string why;
  std::unique_ptr<kernels::Backend> backend = CudaBackendOrNull(&why);
  if (backend == nullptr) GTEST_SKIP() << "no CUDA GPU: skipped (" << why << ")";
  for (int head_dim : {64, 128}) {
    for (DType kv : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim << " kv " << DTypeName(kv));
      std::unique_ptr<TestModel> m = MakeWideModel(head_dim, DType::kBF16);
      TransformerOptions plain_o, graph_o;
      graph_o.decode_graph = true;
      STRATA_ASSERT_OK_AND_ASSIGN(auto plain,
                                  Transformer::Create(m->config, m->weights, backend.get(), plain_o));
      STRATA_ASSERT_OK_AND_ASSIGN(auto graph,
                                  Transformer::Create(m->config, m->weights, backend.get(), graph_o));
      const double tol = kv == DType::kF32 ? 1e-4 : 1e-3;
      CompareSequences(plain.get(), graph.get(), kv, 37, 32, 11u + head_dim, tol);
      EXPECT_EQ(graph->graph_steps(), 32);
      EXPECT_EQ(plain->graph_steps(), 0);
      // A second sequence (another cache): captured again, still the normal path's results.
      CompareSequences(plain.get(), graph.get(), kv, 70, 6, 99u, tol);
      EXPECT_EQ(graph->graph_steps(), 38);
    }
  }
}

// Sequences decoding in turn on one Transformer (as a worker's concurrent jobs do) each replay
// their own graph: two caches alternating step by step capture twice in all and follow the normal
// path; a cache made after one of them is destroyed (its pools may reuse the freed addresses)
// captures again instead of replaying the dead cache's graph.
TEST(DecodeGraphTest, CachesDecodingInTurnKeepTheirGraphs) {
  std::string why;
  GraphPair pair;
  if (!MakeGraphPair(&pair, &why)) GTEST_SKIP() << "no CUDA GPU: skipped (" << why << ")";
  kernels::Backend* backend = pair.backend.get();
  const model::ModelConfig& c = pair.model->config;
  Transformer* plain = pair.plain.get();
  Transformer* graph = pair.graph.get();
  constexpr int kPrompt = 29, kSteps = 12;
  const DType kv = DType::kF32;
  struct Seq {
    std::unique_ptr<KvCache> a, b;  // plain's and graph's
    std::unique_ptr<AttentionPolicy> pa = MakeDensePolicy(), pb = MakeDensePolicy();
    std::vector<float> la, lb;
    int32_t ta = 0, tb = 0;
  };
  auto start = [&](Seq* s, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> prompt(kPrompt);
    for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % c.vocab_size);
    auto a = KvCache::Create(plain->MakeCacheOptions(kPrompt + kSteps + 4, 16, kv), backend);
    auto b = KvCache::Create(graph->MakeCacheOptions(kPrompt + kSteps + 4, 16, kv), backend);
    ASSERT_TRUE(a.ok() && b.ok());
    s->a = *std::move(a);
    s->b = *std::move(b);
    s->la.resize(c.vocab_size);
    s->lb.resize(c.vocab_size);
    STRATA_ASSERT_OK(plain->Forward(prompt.data(), kPrompt, 0, s->a.get(), s->pa.get(), s->la.data(), false));
    STRATA_ASSERT_OK(graph->Forward(prompt.data(), kPrompt, 0, s->b.get(), s->pb.get(), s->lb.data(), false));
    s->ta = Argmax(s->la);
    s->tb = Argmax(s->lb);
  };
  auto step = [&](Seq* s, int i) {
    ASSERT_EQ(s->ta, s->tb) << "step " << i;
    STRATA_ASSERT_OK(plain->Forward(&s->ta, 1, kPrompt + i, s->a.get(), s->pa.get(), s->la.data(), false));
    STRATA_ASSERT_OK(graph->Forward(&s->tb, 1, kPrompt + i, s->b.get(), s->pb.get(), s->lb.data(), false));
    for (int v = 0; v < c.vocab_size; ++v) {
      ASSERT_LE(std::fabs(static_cast<double>(s->la[v]) - s->lb[v]), 1e-4) << "step " << i << " logit " << v;
    }
    s->ta = Argmax(s->la);
    s->tb = Argmax(s->lb);
  };
  Seq x, y;
  start(&x, 5u);
  start(&y, 6u);
  for (int i = 0; i < kSteps; ++i) {
    step(&x, i);
    step(&y, i);
  }
  EXPECT_EQ(graph->graph_steps(), 2 * kSteps);
  EXPECT_EQ(graph->graph_captures(), 2);
  // x's caches go; z's may land on their addresses: z must capture its own graph.
  x = Seq();
  Seq z;
  start(&z, 7u);
  for (int i = 0; i < 3; ++i) {
    step(&z, i);
    step(&y, kSteps + i);  // y still replays its graph
  }
  EXPECT_EQ(graph->graph_steps(), 2 * kSteps + 6);
  EXPECT_EQ(graph->graph_captures(), 3);
}

// A document attended on the device by a capturable hook: SelectedAttention over every token of
// a KvCache prefilled with the document (its page table in backend memory), as a device-managed
// GpuCacheAttention does through its cache's table.
class DocumentHook : public ExternalAttention {
 public:
  static absl::StatusOr<std::unique_ptr<DocumentHook>> Create(kernels::Backend* be, KvCache* doc,
                                                              int64_t doc_len) {
    auto h = std::unique_ptr<DocumentHook>(new DocumentHook);
    h->be_ = be;
    h->doc_ = doc;
    h->doc_len_ = doc_len;
    const KvCacheOptions& o = doc->options();
    for (int l = 0; l < o.num_layers; ++l) {
      std::vector<int32_t> t;
      for (int g = 0; g < o.num_kv_heads; ++g) {
        for (int64_t p = 0; p < doc->pages_per_head(); ++p) t.push_back(doc->SlotOf(l, g, p));
      }
      STRATA_ASSIGN_OR_RETURN(auto buf, be->Allocate(t.size() * 4));
      STRATA_RETURN_IF_ERROR(be->CopyToDevice(buf->data(), t.data(), t.size() * 4, nullptr));
      h->tables_.push_back(std::move(buf));
    }
    return h;
  }
  absl::Status Attend(int, const float*, int, int, int64_t,
                      std::vector<AttentionPartial>*) override {
    return absl::UnimplementedError("device only");
  }
  bool AttendsOnDevice() const override { return true; }
  bool CapturableOnDevice() const override { return true; }
  absl::Status AttendOnDevice(int layer, const kernels::TensorView& q, int64_t,
                              const kernels::TensorView& out,
                              const kernels::TensorView& lse) override {
    ++calls;
    const KvCacheOptions& o = doc_->options();
    for (int64_t t = 0; t < q.dim(0); ++t) {  // rows are independent: the document precedes
      const int64_t hq = q.dim(1), d = q.dim(2);
      kernels::SelectedAttentionParams p;
      p.q = kernels::TensorView(static_cast<float*>(q.data) + t * hq * d, DType::kF32, {1, hq, d});
      p.k_pool = doc_->k_pool(layer);
      p.v_pool = doc_->v_pool(layer);
      p.page_table = tables_[layer]->View(DType::kI32, {o.num_kv_heads, doc_->pages_per_head()});
      p.prefix_end = doc_len_;
      p.scale = 1.0f / std::sqrt(static_cast<float>(d));
      p.out = kernels::TensorView(static_cast<float*>(out.data) + t * hq * d, DType::kF32,
                                  {1, hq, d});
      p.lse = kernels::TensorView(static_cast<float*>(lse.data) + t * hq, DType::kF32, {1, hq});
      STRATA_RETURN_IF_ERROR(be_->SelectedAttention(p, nullptr));
    }
    return absl::OkStatus();
  }
  int calls = 0;

 private:
  DocumentHook() = default;
  kernels::Backend* be_ = nullptr;
  KvCache* doc_ = nullptr;
  int64_t doc_len_ = 0;
  std::vector<std::unique_ptr<kernels::Buffer>> tables_;
};

// decode_graph with a capturable ExternalAttention: the hook is recorded in the step graph (one
// AttendOnDevice per layer at capture, none after), and the logits and greedy tokens follow the
// normal path with the same hook; both also follow one cache holding document and prompt.
TEST(DecodeGraphTest, ReplayWithACapturableDocumentHookMatchesNormalPath) {
  std::string why;
  GraphPair pair;
  if (!MakeGraphPair(&pair, &why)) GTEST_SKIP() << "no CUDA GPU: skipped (" << why << ")";
  std::unique_ptr<kernels::Backend>& backend = pair.backend;
  const model::ModelConfig& c = pair.model->config;
  std::unique_ptr<Transformer>& plain = pair.plain;
  std::unique_ptr<Transformer>& graph = pair.graph;
  const int doc_len = 83, prompt_len = 5, steps = 24;
  std::mt19937 rng(17);
  std::vector<int32_t> tokens(doc_len + prompt_len);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % c.vocab_size);
  std::vector<float> la(c.vocab_size), lb(c.vocab_size), lw(c.vocab_size);
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto doc, KvCache::Create(plain->MakeCacheOptions(doc_len, 16, DType::kF32), backend.get()));
  auto dense = MakeDensePolicy();
  STRATA_ASSERT_OK(plain->Forward(tokens.data(), doc_len, 0, doc.get(), dense.get(), la.data(),
                                  false));
  STRATA_ASSERT_OK_AND_ASSIGN(auto hook_a, DocumentHook::Create(backend.get(), doc.get(), doc_len));
  STRATA_ASSERT_OK_AND_ASSIGN(auto hook_b, DocumentHook::Create(backend.get(), doc.get(), doc_len));
  const int64_t local_tokens = prompt_len + steps + 3;
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto ca, KvCache::Create(plain->MakeCacheOptions(local_tokens, 16, DType::kF32), backend.get()));
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto cb, KvCache::Create(graph->MakeCacheOptions(local_tokens, 16, DType::kF32), backend.get()));
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto cw, KvCache::Create(plain->MakeCacheOptions(doc_len + local_tokens, 16, DType::kF32),
                               backend.get()));
  auto pa = MakeDensePolicy(), pb = MakeDensePolicy(), pw = MakeDensePolicy();
  ForwardOptions fa, fb;
  fa.cache_first_position = fb.cache_first_position = doc_len;
  fa.external = hook_a.get();
  fb.external = hook_b.get();
  const int32_t* prompt = tokens.data() + doc_len;
  STRATA_ASSERT_OK(plain->Forward(prompt, prompt_len, doc_len, ca.get(), pa.get(), la.data(),
                                  false, fa));
  STRATA_ASSERT_OK(graph->Forward(prompt, prompt_len, doc_len, cb.get(), pb.get(), lb.data(),
                                  false, fb));
  STRATA_ASSERT_OK(plain->Forward(tokens.data(), doc_len + prompt_len, 0, cw.get(), pw.get(),
                                  lw.data(), false));
  int32_t ta = Argmax(la), tb = Argmax(lb), tw = Argmax(lw);
  const int calls_before = hook_b->calls;
  double worst = 0, worst_whole = 0;
  for (int s = 0; s < steps; ++s) {
    ASSERT_EQ(ta, tb) << "step " << s;
    ASSERT_EQ(ta, tw) << "step " << s;
    const int64_t pos = doc_len + prompt_len + s;
    STRATA_ASSERT_OK(plain->Forward(&ta, 1, pos, ca.get(), pa.get(), la.data(), false, fa));
    STRATA_ASSERT_OK(graph->Forward(&tb, 1, pos, cb.get(), pb.get(), lb.data(), false, fb));
    STRATA_ASSERT_OK(plain->Forward(&tw, 1, pos, cw.get(), pw.get(), lw.data(), false));
    for (int i = 0; i < c.vocab_size; ++i) {
      worst = std::max(worst, std::fabs(static_cast<double>(la[i]) - lb[i]));
      worst_whole = std::max(worst_whole, std::fabs(static_cast<double>(la[i]) - lw[i]));
    }
    ta = Argmax(la);
    tb = Argmax(lb);
    tw = Argmax(lw);
  }
  EXPECT_LE(worst, 1e-4);
  EXPECT_LE(worst_whole, 1e-3);
  EXPECT_EQ(graph->graph_steps(), steps);
  // Recorded once per layer at the capture, never called again.
  EXPECT_EQ(hook_b->calls - calls_before, c.num_layers);
  std::printf("  document hook in the graph: %d steps, max |logit diff| %.3g (whole cache %.3g)\n",
              steps, worst, worst_whole);
}

// ForwardBatch with decode_graph: the batch's rows replay one graph, recorded for its set of
// caches and hooks (in the order of the caches' ids, so steps that come in another order replay
// the same graph), and every row follows the same sequence decoded alone on the normal path:
// two plain sequences (one drawn on the device through BatchItem::sample, temperature 0) and one
// with a capturable document hook, so the graph merges one row's partial and copies the others.
// A batch of two of them is another set: a second capture.
// `tol`: the largest logit difference allowed against the normal path.
void CheckBatchedSteps(GraphPair& pair, double tol = 1e-3) {
  kernels::Backend* backend = pair.backend.get();
  const model::ModelConfig& c = pair.model->config;
  Transformer* plain = pair.plain.get();
  Transformer* graph = pair.graph.get();
  const int doc_len = 83, prompt_len = 11, steps = 16;
  std::mt19937 rng(23);
  std::vector<int32_t> doc_tokens(doc_len);
  for (int32_t& t : doc_tokens) t = static_cast<int32_t>(rng() % c.vocab_size);
  std::vector<float> scratch(c.vocab_size);
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto doc, KvCache::Create(plain->MakeCacheOptions(doc_len, 16, DType::kF32), backend));
  auto doc_policy = MakeDensePolicy();
  STRATA_ASSERT_OK(plain->Forward(doc_tokens.data(), doc_len, 0, doc.get(), doc_policy.get(),
                                  scratch.data(), false));
  struct Seq {
    std::unique_ptr<KvCache> a, b;  // plain's (alone) and graph's (batched)
    std::unique_ptr<AttentionPolicy> pa = MakeDensePolicy(), pb = MakeDensePolicy();
    std::unique_ptr<DocumentHook> ha, hb;
    ForwardOptions fa, fb;
    std::vector<float> la, lb;
    int32_t ta = 0, tb = 0;
    int64_t first = 0;  // position of the caches' first token
  };
  constexpr int kSeqs = 3;
  Seq seqs[kSeqs];
  for (int i = 0; i < kSeqs; ++i) {
    Seq& q = seqs[i];
    if (i == 2) {
      STRATA_ASSERT_OK_AND_ASSIGN(q.ha, DocumentHook::Create(backend, doc.get(), doc_len));
      STRATA_ASSERT_OK_AND_ASSIGN(q.hb, DocumentHook::Create(backend, doc.get(), doc_len));
      q.fa.external = q.ha.get();
      q.fb.external = q.hb.get();
      q.first = doc_len;
    }
    q.fa.cache_first_position = q.fb.cache_first_position = q.first;
    const int64_t max_tokens = prompt_len + steps + 3;
    STRATA_ASSERT_OK_AND_ASSIGN(
        q.a, KvCache::Create(plain->MakeCacheOptions(max_tokens, 16, DType::kF32), backend));
    STRATA_ASSERT_OK_AND_ASSIGN(
        q.b, KvCache::Create(graph->MakeCacheOptions(max_tokens, 16, DType::kF32), backend));
    std::vector<int32_t> prompt(prompt_len);
    for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % c.vocab_size);
    q.la.resize(c.vocab_size);
    q.lb.resize(c.vocab_size);
    STRATA_ASSERT_OK(plain->Forward(prompt.data(), prompt_len, q.first, q.a.get(), q.pa.get(),
                                    q.la.data(), false, q.fa));
    STRATA_ASSERT_OK(graph->Forward(prompt.data(), prompt_len, q.first, q.b.get(), q.pb.get(),
                                    q.lb.data(), false, q.fb));
    q.ta = Argmax(q.la);
    q.tb = Argmax(q.lb);
  }
  const int64_t steps_before = graph->graph_steps(), captures_before = graph->graph_captures();
  const int hook_calls_before = seqs[2].hb->calls;
  kernels::SampleRow greedy;  // temperature 0: the argmax, drawn on the device
  double worst = 0;
  auto run = [&](const std::vector<int>& which, int s) {
    std::vector<Transformer::BatchItem> items;
    for (int i : which) {
      Seq& q = seqs[i];
      ASSERT_EQ(q.ta, q.tb) << "sequence " << i << " step " << s;
      const int64_t pos = q.first + prompt_len + s;
      STRATA_ASSERT_OK(plain->Forward(&q.ta, 1, pos, q.a.get(), q.pa.get(), q.la.data(), false, q.fa));
      q.ta = Argmax(q.la);
      Transformer::BatchItem it;
      it.id = q.tb;
      it.pos = pos;
      it.cache = q.b.get();
      it.policy = q.pb.get();
      it.options = q.fb;
      if (i == 1) {
        it.sample = &greedy;
        it.token = &q.tb;
      } else {
        it.logits_out = q.lb.data();
      }
      items.push_back(it);
    }
    STRATA_ASSERT_OK(graph->ForwardBatch(items));
    for (int i : which) {
      Seq& q = seqs[i];
      if (i == 1) continue;  // its token was drawn on the device
      for (int v = 0; v < c.vocab_size; ++v) {
        const double d = std::fabs(static_cast<double>(q.la[v]) - q.lb[v]);
        worst = std::max(worst, d);
        ASSERT_LE(d, tol) << "sequence " << i << " step " << s << " logit " << v;
      }
      q.tb = Argmax(q.lb);
    }
  };
  for (int s = 0; s < steps; ++s) {
    // The rows come in a different order each step.
    std::vector<int> which = {0, 1, 2};
    std::rotate(which.begin(), which.begin() + s % kSeqs, which.end());
    if (s % 2 == 1) std::reverse(which.begin(), which.end());
    run(which, s);
    if (::testing::Test::HasFatalFailure()) return;
  }
  for (int i = 0; i < kSeqs; ++i) EXPECT_EQ(seqs[i].ta, seqs[i].tb) << "sequence " << i;
  EXPECT_EQ(graph->graph_steps() - steps_before, kSeqs * steps);
  EXPECT_EQ(graph->graph_captures() - captures_before, 1);
  // The hook was recorded once per layer at the capture, never called again.
  EXPECT_EQ(seqs[2].hb->calls - hook_calls_before, c.num_layers);
  // Two of the sequences: another set of caches, another graph.
  for (int s = steps; s < steps + 3; ++s) {
    run({2, 0}, s);
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_EQ(seqs[0].ta, seqs[0].tb);
  EXPECT_EQ(seqs[2].ta, seqs[2].tb);
  EXPECT_EQ(graph->graph_captures() - captures_before, 2);
  EXPECT_EQ(graph->graph_steps() - steps_before, kSeqs * steps + 6);
  EXPECT_EQ(seqs[0].b->length(0), prompt_len + steps + 3);
  std::printf("  batched graph: %d steps of %d rows, max |logit diff| %.3g\n", steps, kSeqs, worst);
}

TEST(DecodeGraphTest, BatchedStepsReplayOneGraphOnGpu) {
  std::string why;
  GraphPair pair;
  if (!MakeGraphPair(&pair, &why)) GTEST_SKIP() << "no CUDA GPU: skipped (" << why << ")";
  CheckBatchedSteps(pair);
}

// fp8 projections (TransformerOptions::weight_format): the one-token and batched graph steps
// (the tensor-core fp8 GEMVs of 1 and 3 rows recorded in them) follow the normal path. Every
// MatMul rounds its activations to f16, so the attention kernels' float differences between the
// two paths can move an activation by an f16 step: 2e-2 instead of 1e-3 (the logits are ~2;
// the batched CPU run differs by up to 0.0065).
TEST(DecodeGraphTest, Fp8WeightStepsReplayOnGpu) {
  std::string why;
  GraphPair pair;
  if (!MakeGraphPair(&pair, &why, WeightFormat::kFP8)) {
    GTEST_SKIP() << "no CUDA GPU: skipped (" << why << ")";
  }
  CompareSequences(pair.plain.get(), pair.graph.get(), DType::kBF16, 37, 12, 11u, 2e-2);
  EXPECT_EQ(pair.graph->graph_steps(), 12);
  CheckBatchedSteps(pair, 2e-2);
}

TEST(DecodeGraphTest, DeviceTokenStepsMatchHostIdsOnGpu) {
  std::string why;
  GraphPair p;
  if (!MakeGraphPair(&p, &why)) GTEST_SKIP() << "no CUDA GPU: skipped (" << why << ")";
  CompareDeviceTokens(p.plain.get(), p.graph.get(), DType::kBF16, 21, 24, 7u);
  EXPECT_EQ(p.graph->graph_steps(), 24);  // every step replayed, reading the id on the device
  // Without decode_graph the id is read back to the host first: the same tokens.
  CompareDeviceTokens(p.plain.get(), p.plain.get(), DType::kBF16, 21, 8, 8u);
  EXPECT_EQ(p.plain->graph_steps(), 0);
}

// The same checks without a GPU: kernels::testing::CapturingBackend runs the CPU backend's ops
// under a device backend's name and records and replays graphs, so the engine's graph steps (one
// row and batched, hooks recorded in them, the step values read from backend memory at replay)
// run in CI. Its arithmetic is the CPU backend's: the graph path's SelectedAttention against the
// normal path's PagedAttention differ by float rounding only.
bool MakeCapturingPair(GraphPair* p, WeightFormat format = WeightFormat::kCheckpoint) {
  p->backend = std::make_unique<kernels::testing::CapturingBackend>(1);
  p->model = MakeWideModel(128, DType::kBF16);
  TransformerOptions plain_o, graph_o;
  plain_o.weight_format = graph_o.weight_format = format;
  graph_o.decode_graph = true;
  auto plain = Transformer::Create(p->model->config, p->model->weights, p->backend.get(), plain_o);
  auto graph = Transformer::Create(p->model->config, p->model->weights, p->backend.get(), graph_o);
  if (!plain.ok() || !graph.ok()) return false;
  p->plain = *std::move(plain);
  p->graph = *std::move(graph);
  return true;
}

TEST(DecodeGraphTest, CapturingCpuBackendReplaysOneTokenSteps) {
  GraphPair pair;
  ASSERT_TRUE(MakeCapturingPair(&pair));
  auto* capturing = static_cast<kernels::testing::CapturingBackend*>(pair.backend.get());
  for (DType kv : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(kv));
    const int64_t steps0 = pair.graph->graph_steps();
    CompareSequences(pair.plain.get(), pair.graph.get(), kv, 37, 12, 11u, kv == DType::kF32 ? 1e-4 : 1e-3);
    EXPECT_EQ(pair.graph->graph_steps() - steps0, 12);
  }
  EXPECT_EQ(pair.plain->graph_steps(), 0);
  EXPECT_EQ(pair.graph->graph_captures(), 2);  // one per cache
  EXPECT_GT(capturing->recorded_ops(), 0);
  // The id read on the device from the previous step's draw.
  CompareDeviceTokens(pair.plain.get(), pair.graph.get(), DType::kF32, 21, 8, 7u);
}

TEST(DecodeGraphTest, CapturingCpuBackendReplaysBatchedSteps) {
  GraphPair pair;
  ASSERT_TRUE(MakeCapturingPair(&pair));
  CheckBatchedSteps(pair);
}

TEST(DecodeGraphTest, CapturingCpuBackendReplaysFp8WeightSteps) {
  GraphPair pair;
  ASSERT_TRUE(MakeCapturingPair(&pair, WeightFormat::kFP8));
  CompareSequences(pair.plain.get(), pair.graph.get(), DType::kBF16, 37, 12, 11u, 2e-2);
  EXPECT_EQ(pair.graph->graph_steps(), 12);
  CheckBatchedSteps(pair, 2e-2);
}

// The logits buffer holds the rows asked for so far (not a whole chunk's): a Forward that asks
// for every row of a 9-token chunk grows it, which drops the graphs that recorded the old buffer;
// the next one-token step captures again and still follows the normal path, and the grown
// chunk's logits equal the normal path's row for row.
TEST(DecodeGraphTest, CapturingCpuBackendGrowsTheLogitsBetweenGraphSteps) {
  GraphPair pair;
  ASSERT_TRUE(MakeCapturingPair(&pair));
  Transformer* plain = pair.plain.get();
  Transformer* graph = pair.graph.get();
  kernels::Backend* be = pair.backend.get();
  const model::ModelConfig& c = plain->config();
  const int64_t vocab = c.vocab_size;
  std::mt19937 rng(99u);
  const int prompt_len = 13, chunk = 9;
  std::vector<int32_t> prompt(prompt_len), other(chunk);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
  for (int32_t& t : other) t = static_cast<int32_t>(rng() % vocab);
  auto make = [&](Transformer* tf) {
    return *KvCache::Create(tf->MakeCacheOptions(64, 16, DType::kF32), be);
  };
  std::unique_ptr<KvCache> a = make(plain), b = make(graph), a2 = make(plain), b2 = make(graph);
  std::unique_ptr<AttentionPolicy> pol = MakeDensePolicy();
  std::vector<float> la(vocab), lb(vocab);
  STRATA_ASSERT_OK(plain->Forward(prompt.data(), prompt_len, 0, a.get(), pol.get(), la.data(), false));
  STRATA_ASSERT_OK(graph->Forward(prompt.data(), prompt_len, 0, b.get(), pol.get(), lb.data(), false));
  int32_t ta = Argmax(la), tb = Argmax(lb);
  int64_t pos = prompt_len;
  auto step = [&](int n_steps) {
    for (int s = 0; s < n_steps; ++s, ++pos) {
      ASSERT_EQ(ta, tb) << "position " << pos;
      STRATA_ASSERT_OK(plain->Forward(&ta, 1, pos, a.get(), pol.get(), la.data(), false));
      STRATA_ASSERT_OK(graph->Forward(&tb, 1, pos, b.get(), pol.get(), lb.data(), false));
      for (int64_t i = 0; i < vocab; ++i) {
        ASSERT_NEAR(la[i], lb[i], 1e-4) << "position " << pos << " logit " << i;
      }
      ta = Argmax(la);
      tb = Argmax(lb);
    }
  };
  step(4);
  ASSERT_EQ(graph->graph_captures(), 1);
  const int64_t replayed = graph->graph_steps();
  // Every row of a chunk on another cache: the buffer grows from 1 row to 9.
  std::vector<float> all_a(chunk * vocab), all_b(chunk * vocab, NAN);
  STRATA_ASSERT_OK(plain->Forward(other.data(), chunk, 0, a2.get(), pol.get(), all_a.data(), true));
  STRATA_ASSERT_OK(graph->Forward(other.data(), chunk, 0, b2.get(), pol.get(), all_b.data(), true));
  for (int64_t i = 0; i < chunk * vocab; ++i) {
    ASSERT_NEAR(all_a[i], all_b[i], 1e-5) << "row " << i / vocab << " logit " << i % vocab;
  }
  step(4);
  EXPECT_EQ(graph->graph_captures(), 2);  // the first graph went with the old buffer
  EXPECT_EQ(graph->graph_steps() - replayed, 4);
}

// A hook that claims to be capturable but waits on the backend in AttendOnDevice: its steps
// cannot be recorded.
class WaitingHook : public ExternalAttention {
 public:
  explicit WaitingHook(kernels::Backend* be) : be_(be) {}
  absl::Status Attend(int, const float*, int, int, int64_t, std::vector<AttentionPartial>*) override {
    return absl::UnimplementedError("device only");
  }
  bool AttendsOnDevice() const override { return true; }
  bool CapturableOnDevice() const override { return true; }
  absl::Status AttendOnDevice(int, const kernels::TensorView& q, int64_t, const kernels::TensorView& out,
                              const kernels::TensorView& lse) override {
    STRATA_RETURN_IF_ERROR(be_->Synchronize(nullptr));  // refused while capturing
    // Nothing attended: lse -inf, out 0.
    std::vector<float> o(static_cast<size_t>(out.NumElements()), 0.0f);
    std::vector<float> l(static_cast<size_t>(lse.NumElements()), -INFINITY);
    STRATA_RETURN_IF_ERROR(be_->CopyToDevice(out.data, o.data(), o.size() * 4, nullptr));
    return be_->CopyToDevice(lse.data, l.data(), l.size() * 4, nullptr);
  }

 private:
  kernels::Backend* be_;
};

// ForwardBatch under decode_graph: a batch whose step cannot be recorded (a hook that waits)
// takes the normal path, with the same logits as the same batch on a Transformer without graphs,
// and leaves later batches on the normal path while a lone step still replays a graph; before
// that, a batch whose caches are full fails with ResourceExhausted before anything runs.
TEST(DecodeGraphTest, CapturingCpuBackendBatchesThatCannotBeRecordedTakeTheNormalPath) {
  GraphPair pair;
  ASSERT_TRUE(MakeCapturingPair(&pair));
  kernels::Backend* be = pair.backend.get();
  const model::ModelConfig& c = pair.model->config;
  WaitingHook hook_a(be), hook_b(be);
  const int prompt_len = 6;
  auto make = [&](Transformer* tf, int64_t max_tokens) {
    return *KvCache::Create(tf->MakeCacheOptions(max_tokens, 16, DType::kF32), be);
  };
  // Caches: [0] plain with the hook, [1] plain without; the same for the graph Transformer.
  std::unique_ptr<KvCache> pa[2] = {make(pair.plain.get(), 32), make(pair.plain.get(), 32)};
  std::unique_ptr<KvCache> ga[2] = {make(pair.graph.get(), 32), make(pair.graph.get(), 32)};
  auto dense = MakeDensePolicy();
  ForwardOptions with_a, with_b, none;
  with_a.external = &hook_a;
  with_b.external = &hook_b;
  std::vector<int32_t> prompt(prompt_len);
  for (int i = 0; i < prompt_len; ++i) prompt[i] = 3 + 7 * i;
  std::vector<float> scratch(c.vocab_size);
  for (int i = 0; i < 2; ++i) {
    STRATA_ASSERT_OK(pair.plain->Forward(prompt.data(), prompt_len, 0, pa[i].get(), dense.get(), scratch.data(),
                                         false, i == 0 ? with_a : none));
    STRATA_ASSERT_OK(pair.graph->Forward(prompt.data(), prompt_len, 0, ga[i].get(), dense.get(), scratch.data(),
                                         false, i == 0 ? with_b : none));
  }
  std::vector<std::vector<float>> lp(2, std::vector<float>(c.vocab_size)), lg = lp;
  auto batch = [&](std::unique_ptr<KvCache>* caches, const ForwardOptions& hooked,
                   std::vector<std::vector<float>>* logits, int64_t pos) {
    std::vector<Transformer::BatchItem> items(2);
    for (int i = 0; i < 2; ++i) {
      items[i].id = 17 + i;
      items[i].pos = pos;
      items[i].cache = caches[i].get();
      items[i].policy = dense.get();
      items[i].options = i == 0 ? hooked : none;
      items[i].logits_out = (*logits)[i].data();
    }
    return items;
  };
  // Full caches (graph path, before any capture): ResourceExhausted, nothing appended.
  {
    std::unique_ptr<KvCache> full[2] = {make(pair.graph.get(), prompt_len), make(pair.graph.get(), prompt_len)};
    for (int i = 0; i < 2; ++i) {
      STRATA_ASSERT_OK(pair.graph->Forward(prompt.data(), prompt_len, 0, full[i].get(), dense.get(),
                                           scratch.data(), false));
    }
    auto items = batch(full, none, &lg, prompt_len);
    EXPECT_THAT(pair.graph->ForwardBatch(items), StatusIs(absl::StatusCode::kResourceExhausted));
    EXPECT_EQ(full[0]->length(0), prompt_len);
    EXPECT_EQ(full[1]->length(0), prompt_len);
    EXPECT_EQ(pair.graph->graph_captures(), 0);
  }
  for (int64_t pos = prompt_len; pos < prompt_len + 2; ++pos) {
    auto ip = batch(pa, with_a, &lp, pos);
    auto ig = batch(ga, with_b, &lg, pos);
    STRATA_ASSERT_OK(pair.plain->ForwardBatch(ip));
    STRATA_ASSERT_OK(pair.graph->ForwardBatch(ig));
    for (int i = 0; i < 2; ++i) EXPECT_EQ(lg[i], lp[i]) << "row " << i << " at " << pos;
  }
  EXPECT_EQ(pair.graph->graph_steps(), 0);
  EXPECT_EQ(pair.graph->graph_captures(), 0);
  // A lone step without the hook still replays a graph.
  int32_t id = 5;
  STRATA_ASSERT_OK(pair.graph->Forward(&id, 1, prompt_len + 2, ga[1].get(), dense.get(), scratch.data(), false));
  EXPECT_EQ(pair.graph->graph_steps(), 1);
}

TEST(DecodeGraphTest, CapturingCpuBackendRefusesCopiesWhileCapturing) {
  kernels::testing::CapturingBackend be(1);
  STRATA_ASSERT_OK_AND_ASSIGN(auto buf, be.Allocate(64));
  float x[16] = {};
  STRATA_ASSERT_OK(be.BeginCapture(nullptr));
  EXPECT_THAT(be.CopyToDevice(buf->data(), x, sizeof(x), nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(be.EndCapture(nullptr).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  // A capture of ops only replays them, reading the memory as it is then.
  const kernels::TensorView v(buf->data(), DType::kF32, {16});
  STRATA_ASSERT_OK(be.BeginCapture(nullptr));
  STRATA_ASSERT_OK(be.Add({v, v, v}, nullptr));  // v += v
  STRATA_ASSERT_OK_AND_ASSIGN(auto graph, be.EndCapture(nullptr));
  for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(i);
  STRATA_ASSERT_OK(be.CopyToDevice(buf->data(), x, sizeof(x), nullptr));
  STRATA_ASSERT_OK(graph->Replay(nullptr));
  STRATA_ASSERT_OK(graph->Replay(nullptr));
  STRATA_ASSERT_OK(be.CopyToHost(x, buf->data(), sizeof(x), nullptr));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(x[i], 4.0f * i);
}

TEST(DecodeGraphTest, CpuBackendIgnoresTheOption) {
  std::unique_ptr<kernels::Backend> backend = kernels::MakeCpuBackend(1);
  std::unique_ptr<TestModel> m = MakeWideModel(64, DType::kF32);
  TransformerOptions plain_o, graph_o;
  graph_o.decode_graph = true;
  STRATA_ASSERT_OK_AND_ASSIGN(auto plain,
                              Transformer::Create(m->config, m->weights, backend.get(), plain_o));
  STRATA_ASSERT_OK_AND_ASSIGN(auto graph,
                              Transformer::Create(m->config, m->weights, backend.get(), graph_o));
  CompareSequences(plain.get(), graph.get(), DType::kF32, 9, 4, 5u, 0.0);
  EXPECT_EQ(graph->graph_steps(), 0);
  // ForwardOptions::device_token there: the id is read back to the host, the same tokens.
  CompareDeviceTokens(plain.get(), graph.get(), DType::kF32, 9, 5, 6u);
  EXPECT_EQ(graph->graph_steps(), 0);
}

}  // namespace
}  // namespace strata::engine
