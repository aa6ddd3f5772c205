// Client commands of the public API (proto/strata/v1/api.proto); every call sets a deadline.
//
//   strata doc upload (FILE | --token-ids 1,2,3) [--name N] [--pin] [--ttl-seconds S]
//   strata doc get ID | ls [--state S] | rm ID
//   strata job submit (--doc-id ID | --doc FILE) (--prompt TEXT | --prompt-token-ids 1,2) [generation flags]
//   strata job watch ID | cancel ID | ls [--state S] [--doc-id ID]
//   strata ask --doc FILE [--max-tokens N] [generation flags] "question"
//
// --server ADDR (default 127.0.0.1:7070, the address of `strata serve`), --timeout-seconds T
// (deadline of unary calls; streams get --stream-timeout-seconds). Results go to stdout as one
// line per resource (fields "key=value"); streamed answers go to stdout as text, progress and
// usage to stderr. Exit codes: 0 success, 1 the server returned an error (its code is printed),
// 2 usage error.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "grpcpp/grpcpp.h"
#include "strata/v1/api.grpc.pb.h"

namespace strata::cli {
namespace {

struct Common {
  std::string server = "127.0.0.1:7070";
  int64_t timeout_seconds = 30;
  int64_t stream_timeout_seconds = 3600;
};

void AddCommon(FlagSet* flags, Common* c) {
  flags->String("server", &c->server, "server address (host:port)");
  flags->Int("timeout-seconds", &c->timeout_seconds, "deadline of each unary call");
  flags->Int("stream-timeout-seconds", &c->stream_timeout_seconds, "deadline of streaming calls");
}

std::shared_ptr<grpc::Channel> Connect(const Common& c) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  return grpc::CreateCustomChannel(c.server, grpc::InsecureChannelCredentials(), args);
}

void SetDeadline(grpc::ClientContext* ctx, int64_t seconds) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

const char* CodeName(grpc::StatusCode c) {
  switch (c) {
    case grpc::OK: return "OK";
    case grpc::CANCELLED: return "CANCELLED";
    case grpc::UNKNOWN: return "UNKNOWN";
    case grpc::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::NOT_FOUND: return "NOT_FOUND";
    case grpc::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::ABORTED: return "ABORTED";
    case grpc::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::INTERNAL: return "INTERNAL";
    case grpc::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::DATA_LOSS: return "DATA_LOSS";
    case grpc::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

// Prints "strata CMD: CODE: message" and returns 1.
int RpcError(const char* cmd, const grpc::Status& s) {
  std::fprintf(stderr, "strata %s: %s: %s\n", cmd, CodeName(s.error_code()), s.error_message().c_str());
  return 1;
}

int Usage(const char* cmd, const std::string& message) {
  std::fprintf(stderr, "strata %s: %s\n", cmd, message.c_str());
  return 2;
}

bool ParseIds(const std::string& text, std::vector<int32_t>* ids) {
  for (absl::string_view piece : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int32_t id;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(piece), &id)) return false;
    ids->push_back(id);
  }
  return !ids->empty();
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

// "anchor", "exact" or "default" (unspecified).
std::string PrefillModeName(v1::DocumentInfo::PrefillMode mode) {
  switch (mode) {
    case v1::DocumentInfo::ANCHOR: return "anchor";
    case v1::DocumentInfo::EXACT: return "exact";
    default: return "default";
  }
}

// --prefill-mode: "" (the server's default), anchor or exact. False for anything else.
bool ParsePrefillMode(const std::string& text, v1::DocumentInfo::PrefillMode* mode) {
  if (text.empty()) {
    *mode = v1::DocumentInfo::PREFILL_MODE_UNSPECIFIED;
  } else if (text == "anchor") {
    *mode = v1::DocumentInfo::ANCHOR;
  } else if (text == "exact") {
    *mode = v1::DocumentInfo::EXACT;
  } else {
    return false;
  }
  return true;
}

std::string DocLine(const v1::DocumentInfo& d) {
  return absl::StrCat("document_id=", d.document_id(), " state=", v1::DocumentInfo::State_Name(d.state()),
                      " tokens=", d.num_tokens(), " prefilled=", d.progress().tokens_prefilled(),
                      " shards=", d.num_shards(), " prefill_mode=", PrefillModeName(d.prefill_mode()),
                      " pinned=", d.pinned() ? "true" : "false",
                      " name=", d.display_name(), d.error_message().empty() ? "" : " error=", d.error_message());
}

std::string UsageLine(const v1::Usage& u) {
  return absl::StrCat("prompt_tokens=", u.prompt_tokens(), " cached_tokens=", u.cached_tokens(),
                      " completion_tokens=", u.completion_tokens(), " mean_attended_tokens=", u.mean_attended_tokens(),
                      " pages_fetched(gpu/host/disk/remote)=", u.pages_fetched().gpu(), "/", u.pages_fetched().host(),
                      "/", u.pages_fetched().disk(), "/", u.pages_fetched().remote(),
                      " selection_cache(hits/lookups)=", u.selection_cache_hits(), "/", u.selection_cache_lookups());
}

std::string JobLine(const v1::JobInfo& j) {
  return absl::StrCat("job_id=", j.job_id(), " state=", v1::JobInfo::State_Name(j.state()),
                      " document_id=", j.document_id(), " finish=", v1::JobInfo::FinishReason_Name(j.finish_reason()),
                      " output_tokens=", j.output_token_ids_size(), " ", UsageLine(j.usage()),
                      j.error_message().empty() ? "" : " error=", j.error_message());
}

// Uploads `text` or `ids` (one of them non-empty).
grpc::Status Upload(const Common& c, const std::string& text, const std::vector<int32_t>& ids,
                    const v1::DocumentUploadOptions& options, v1::DocumentUploadResponse* response) {
  auto stub = v1::DocumentService::NewStub(Connect(c));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, c.stream_timeout_seconds);
  auto writer = stub->Upload(&ctx, response);
  constexpr size_t kChunk = 1 << 20;
  bool first = true;
  bool ok = true;
  if (!ids.empty()) {
    for (size_t i = 0; i < ids.size() && ok; i += kChunk / 4) {
      v1::DocumentUploadRequest req;
      if (first) *req.mutable_options() = options;
      first = false;
      const size_t end = std::min(ids.size(), i + kChunk / 4);
      req.mutable_tokens()->mutable_ids()->Assign(ids.begin() + i, ids.begin() + end);
      ok = writer->Write(req);
    }
  } else {
    for (size_t i = 0; i < text.size() && ok; i += kChunk) {
      v1::DocumentUploadRequest req;
      if (first) *req.mutable_options() = options;
      first = false;
      req.set_text(text.substr(i, kChunk));
      ok = writer->Write(req);
    }
  }
  writer->WritesDone();
  return writer->Finish();
}

// Watches a document until READY/FAILED, drawing a progress bar on stderr when `bar`.
grpc::Status WaitReady(const Common& c, const std::string& id, bool bar, v1::DocumentInfo* last) {
  auto stub = v1::DocumentService::NewStub(Connect(c));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, c.stream_timeout_seconds);
  v1::DocumentWatchRequest req;
  req.set_document_id(id);
  auto reader = stub->Watch(&ctx, req);
  v1::DocumentInfo info;
  bool drew = false;
  while (reader->Read(&info)) {
    *last = info;
    if (bar && info.num_tokens() > 0 && info.state() != v1::DocumentInfo::READY) {
      const double frac = static_cast<double>(info.progress().tokens_prefilled()) / info.num_tokens();
      const int width = 40;
      const int filled = static_cast<int>(frac * width);
      std::fprintf(stderr, "\rprefill [%s%s] %5.1f%% %llu/%llu tokens", std::string(filled, '#').c_str(),
                   std::string(width - filled, '.').c_str(), frac * 100,
                   static_cast<unsigned long long>(info.progress().tokens_prefilled()),
                   static_cast<unsigned long long>(info.num_tokens()));
      drew = true;
    }
    if (info.state() == v1::DocumentInfo::READY || info.state() == v1::DocumentInfo::FAILED) {
      ctx.TryCancel();
      break;
    }
  }
  if (drew) std::fprintf(stderr, "\rprefill [%s] 100.0%% done%20s\n", std::string(40, '#').c_str(), "");
  grpc::Status s = reader->Finish();
  if (last->state() == v1::DocumentInfo::READY || last->state() == v1::DocumentInfo::FAILED) return grpc::Status::OK;
  return s;
}

// Streams job events: text to stdout; returns the final snapshot in *final.
grpc::Status StreamEvents(grpc::ClientReader<v1::JobEvent>* reader, bool print_ids, v1::JobInfo* final) {
  v1::JobEvent e;
  while (reader->Read(&e)) {
    if (e.has_tokens()) {
      const std::string& t = e.tokens().text();
      std::fwrite(t.data(), 1, t.size(), stdout);
      std::fflush(stdout);
    } else if (e.has_snapshot()) {
      *final = e.snapshot();
    }
  }
  grpc::Status s = reader->Finish();
  if (!final->output_text().empty() && final->output_text().back() != '\n') std::fputc('\n', stdout);
  if (print_ids) {
    std::vector<int32_t> ids(final->output_token_ids().begin(), final->output_token_ids().end());
    std::fprintf(stderr, "output_token_ids=%s\n", absl::StrJoin(ids, ",").c_str());
  }
  return s;
}

struct GenFlags {
  int64_t max_tokens = 0;
  double temperature = 0;
  double top_p = 0;
  int64_t top_k = 0;
  int64_t seed = -1;
  std::string policy;
  int64_t budget = 0;
  int64_t candidate_factor = 0;
  int64_t partitions = 0;
  bool ignore_eos = false;
  bool print_ids = false;
};

void AddGen(FlagSet* flags, GenFlags* g) {
  flags->Int("max-tokens", &g->max_tokens, "tokens to generate at most (0: server default)");
  flags->Double("temperature", &g->temperature, "sampling temperature; 0 = greedy");
  flags->Double("top-p", &g->top_p, "nucleus mass (0: off)");
  flags->Int("top-k", &g->top_k, "keep the k most likely tokens (0: off)");
  flags->Int("seed", &g->seed, "sampler seed (-1: the server picks)");
  flags->String("policy", &g->policy, "selection policy: dense, streaming, quest, radar, tokenselect, hip, subgen");
  flags->Int("budget", &g->budget, "selection token budget (0: server default)");
  flags->Int("candidate-factor", &g->candidate_factor,
             "tokenselect: candidate tokens per budget token, 1-16 (0: server default, 4)");
  flags->Int("partitions", &g->partitions,
             "tokenselect: independent selection parts, a power of two 1-64; a budget they do not divide "
             "is rounded up (0: server default, by the budget: 16 at 2048)");
  flags->Bool("ignore-eos", &g->ignore_eos, "keep generating past end-of-sequence tokens");
  flags->Bool("print-token-ids", &g->print_ids, "print the generated token ids to stderr at the end");
}

// A generation flag the server cannot be sent as typed (a negative count), or "".
std::string GenFlagsError(const GenFlags& g) {
  if (g.candidate_factor < 0) return "--candidate-factor is 1-16 (0: the server's default)";
  if (g.partitions < 0) return "--partitions is a power of two in 1-64 (0: the server's default)";
  return "";
}

void FillGen(const GenFlags& g, v1::JobSubmitRequest* req) {
  v1::GenerationParams* p = req->mutable_params();
  p->set_max_tokens(static_cast<uint32_t>(g.max_tokens));
  p->set_temperature(static_cast<float>(g.temperature));
  p->set_top_p(static_cast<float>(g.top_p));
  p->set_top_k(static_cast<uint32_t>(g.top_k));
  if (g.seed >= 0) p->set_seed(static_cast<uint64_t>(g.seed));
  p->set_ignore_eos(g.ignore_eos);
  req->mutable_policy()->set_name(g.policy);
  req->mutable_policy()->set_budget_tokens(static_cast<uint32_t>(g.budget));
  // Checked by GenFlagsError for negatives; the server checks the range.
  if (g.candidate_factor > 0) {
    req->mutable_policy()->set_candidate_factor(
        static_cast<uint32_t>(std::min<int64_t>(g.candidate_factor, 1 << 20)));
  }
  if (g.partitions > 0) {
    req->mutable_policy()->set_partitions(static_cast<uint32_t>(std::min<int64_t>(g.partitions, 1 << 20)));
  }
}

v1::DocumentInfo::State ParseDocState(const std::string& s) {
  v1::DocumentInfo::State st = v1::DocumentInfo::STATE_UNSPECIFIED;
  v1::DocumentInfo::State_Parse(s, &st);
  return st;
}

int Doc(int argc, char** argv) {
  if (argc < 1) return Usage("doc", "usage: strata doc upload|get|ls|rm ...");
  const std::string verb = argv[0];
  Common c;
  std::string token_ids, name, state, prefill_mode;
  bool pin = false;
  int64_t ttl = 0;
  FlagSet flags("doc " + verb, "strata doc upload (FILE | --token-ids 1,2,3) | get ID | ls | rm ID");
  AddCommon(&flags, &c);
  flags.String("token-ids", &token_ids, "upload: token ids instead of a text file");
  flags.String("name", &name, "upload: display name");
  flags.Bool("pin", &pin, "upload: pin the document");
  flags.Int("ttl-seconds", &ttl, "upload: expire after this many seconds (0: never)");
  flags.String("prefill-mode", &prefill_mode,
               "upload: anchor (shards in parallel) or exact (shard by shard); default: the server's");
  flags.String("state", &state, "ls: only this state (PENDING, PREFILLING, READY, FAILED)");
  std::vector<std::string> args;
  const absl::Status parse = flags.Parse(argc - 1, argv + 1, &args);
  if (!parse.ok() || flags.help_requested()) return ReportAndExit(flags, parse);
  auto stub = v1::DocumentService::NewStub(Connect(c));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, c.timeout_seconds);
  if (verb == "upload") {
    std::string text;
    std::vector<int32_t> ids;
    if (!token_ids.empty()) {
      if (!args.empty() || !ParseIds(token_ids, &ids)) return Usage("doc upload", "give FILE or --token-ids");
    } else {
      if (args.size() != 1) return Usage("doc upload", "give one FILE or --token-ids");
      if (!ReadFile(args[0], &text)) return Usage("doc upload", "cannot read " + args[0]);
      if (name.empty()) name = args[0];
    }
    v1::DocumentInfo::PrefillMode mode;
    if (!ParsePrefillMode(prefill_mode, &mode)) return Usage("doc upload", "--prefill-mode is anchor or exact");
    v1::DocumentUploadOptions options;
    options.set_prefill_mode(mode);
    options.set_display_name(name);
    options.set_pin(pin);
    options.set_ttl_seconds(ttl);
    v1::DocumentUploadResponse resp;
    grpc::Status s = Upload(c, text, ids, options, &resp);
    if (!s.ok()) return RpcError("doc upload", s);
    std::printf("%s created=%s\n", DocLine(resp.document()).c_str(), resp.created() ? "true" : "false");
    return 0;
  }
  if (verb == "get" || verb == "rm") {
    if (args.size() != 1) return Usage(("doc " + verb).c_str(), "give one document id");
    if (verb == "get") {
      v1::DocumentGetRequest req;
      req.set_document_id(args[0]);
      v1::DocumentInfo info;
      grpc::Status s = stub->Get(&ctx, req, &info);
      if (!s.ok()) return RpcError("doc get", s);
      std::printf("%s\n", DocLine(info).c_str());
      return 0;
    }
    v1::DocumentDeleteRequest req;
    req.set_document_id(args[0]);
    v1::DocumentDeleteResponse resp;
    grpc::Status s = stub->Delete(&ctx, req, &resp);
    if (!s.ok()) return RpcError("doc rm", s);
    std::printf("deleted %s\n", args[0].c_str());
    return 0;
  }
  if (verb == "ls") {
    v1::DocumentListRequest req;
    req.set_state(ParseDocState(state));
    while (true) {
      grpc::ClientContext page_ctx;
      SetDeadline(&page_ctx, c.timeout_seconds);
      v1::DocumentListResponse resp;
      grpc::Status s = stub->List(&page_ctx, req, &resp);
      if (!s.ok()) return RpcError("doc ls", s);
      for (const v1::DocumentInfo& d : resp.documents()) std::printf("%s\n", DocLine(d).c_str());
      if (resp.next_page_token().empty()) break;
      req.set_page_token(resp.next_page_token());
    }
    return 0;
  }
  return Usage("doc", "unknown verb '" + verb + "' (upload, get, ls, rm)");
}

int Job(int argc, char** argv) {
  if (argc < 1) return Usage("job", "usage: strata job submit|watch|cancel|ls ...");
  const std::string verb = argv[0];
  Common c;
  GenFlags g;
  std::string doc_id, doc_file, prompt, prompt_ids, state, prefill_mode;
  FlagSet flags("job " + verb, "strata job submit ... | watch ID | cancel ID | ls");
  AddCommon(&flags, &c);
  AddGen(&flags, &g);
  flags.String("doc-id", &doc_id, "submit: the document id; ls: only jobs on it");
  flags.String("doc", &doc_file, "submit: a text file sent inline as the document");
  flags.String("prefill-mode", &prefill_mode, "submit --doc: anchor or exact (default: the server's)");
  flags.String("prompt", &prompt, "submit: prompt text");
  flags.String("prompt-token-ids", &prompt_ids, "submit: prompt as token ids");
  flags.String("state", &state, "ls: only this state (QUEUED, PREFILLING, DECODING, DONE, FAILED, CANCELLED)");
  std::vector<std::string> args;
  const absl::Status parse = flags.Parse(argc - 1, argv + 1, &args);
  if (!parse.ok() || flags.help_requested()) return ReportAndExit(flags, parse);
  auto stub = v1::JobService::NewStub(Connect(c));
  grpc::ClientContext ctx;
  if (verb == "submit") {
    if (const std::string e = GenFlagsError(g); !e.empty()) return Usage("job submit", e);
    v1::JobSubmitRequest req;
    if (!doc_id.empty()) {
      req.set_document_id(doc_id);
    } else if (!doc_file.empty()) {
      std::string text;
      if (!ReadFile(doc_file, &text)) return Usage("job submit", "cannot read " + doc_file);
      req.mutable_inline_document()->set_text(text);
      req.mutable_inline_document()->set_display_name(doc_file);
      v1::DocumentInfo::PrefillMode mode;
      if (!ParsePrefillMode(prefill_mode, &mode)) return Usage("job submit", "--prefill-mode is anchor or exact");
      req.mutable_inline_document()->set_prefill_mode(mode);
    }
    if (!prompt_ids.empty()) {
      std::vector<int32_t> ids;
      if (!ParseIds(prompt_ids, &ids)) return Usage("job submit", "bad --prompt-token-ids");
      req.mutable_prompt_tokens()->mutable_ids()->Assign(ids.begin(), ids.end());
    } else {
      req.set_prompt_text(prompt);
    }
    FillGen(g, &req);
    SetDeadline(&ctx, c.timeout_seconds);
    v1::JobInfo info;
    grpc::Status s = stub->Submit(&ctx, req, &info);
    if (!s.ok()) return RpcError("job submit", s);
    std::printf("%s\n", JobLine(info).c_str());
    return 0;
  }
  if (verb == "watch" || verb == "cancel") {
    if (args.size() != 1) return Usage(("job " + verb).c_str(), "give one job id");
    if (verb == "cancel") {
      SetDeadline(&ctx, c.timeout_seconds);
      v1::JobCancelRequest req;
      req.set_job_id(args[0]);
      v1::JobInfo info;
      grpc::Status s = stub->Cancel(&ctx, req, &info);
      if (!s.ok()) return RpcError("job cancel", s);
      std::printf("%s\n", JobLine(info).c_str());
      return 0;
    }
    SetDeadline(&ctx, c.stream_timeout_seconds);
    v1::JobWatchRequest req;
    req.set_job_id(args[0]);
    auto reader = stub->Watch(&ctx, req);
    v1::JobInfo final;
    grpc::Status s = StreamEvents(reader.get(), g.print_ids, &final);
    if (!s.ok()) return RpcError("job watch", s);
    std::fprintf(stderr, "%s\n", JobLine(final).c_str());
    return final.state() == v1::JobInfo::DONE ? 0 : 1;
  }
  if (verb == "ls") {
    v1::JobListRequest req;
    v1::JobInfo::State st = v1::JobInfo::STATE_UNSPECIFIED;
    v1::JobInfo::State_Parse(state, &st);
    req.set_state(st);
    req.set_document_id(doc_id);
    while (true) {
      grpc::ClientContext page_ctx;
      SetDeadline(&page_ctx, c.timeout_seconds);
      v1::JobListResponse resp;
      grpc::Status s = stub->List(&page_ctx, req, &resp);
      if (!s.ok()) return RpcError("job ls", s);
      for (const v1::JobInfo& j : resp.jobs()) std::printf("%s\n", JobLine(j).c_str());
      if (resp.next_page_token().empty()) break;
      req.set_page_token(resp.next_page_token());
    }
    return 0;
  }
  return Usage("job", "unknown verb '" + verb + "' (submit, watch, cancel, ls)");
}

}  // namespace

int RunDoc(int argc, char** argv) { return Doc(argc, argv); }
int RunJob(int argc, char** argv) { return Job(argc, argv); }

int RunAsk(int argc, char** argv) {
  Common c;
  GenFlags g;
  std::string doc_file, doc_ids, prefill_mode;
  FlagSet flags("ask", "strata ask --doc FILE [--max-tokens N] \"question\"");
  AddCommon(&flags, &c);
  AddGen(&flags, &g);
  flags.String("doc", &doc_file, "the document (text file)");
  flags.String("doc-token-ids", &doc_ids, "the document as token ids (instead of --doc)");
  flags.String("prefill-mode", &prefill_mode, "a new document's prefill: anchor or exact (default: the server's)");
  std::vector<std::string> args;
  const absl::Status parse = flags.Parse(argc, argv, &args);
  if (!parse.ok() || flags.help_requested()) return ReportAndExit(flags, parse);
  if (args.size() != 1 || args[0].empty()) return Usage("ask", "give the question as one argument");
  if (const std::string e = GenFlagsError(g); !e.empty()) return Usage("ask", e);
  if (doc_file.empty() == doc_ids.empty()) return Usage("ask", "give --doc FILE or --doc-token-ids");
  std::string text;
  std::vector<int32_t> ids;
  if (!doc_file.empty() && !ReadFile(doc_file, &text)) return Usage("ask", "cannot read " + doc_file);
  if (!doc_ids.empty() && !ParseIds(doc_ids, &ids)) return Usage("ask", "bad --doc-token-ids");
  v1::DocumentInfo::PrefillMode mode;
  if (!ParsePrefillMode(prefill_mode, &mode)) return Usage("ask", "--prefill-mode is anchor or exact");
  // Upload (content-addressed: an existing document comes back unchanged).
  v1::DocumentUploadOptions options;
  options.set_display_name(doc_file);
  options.set_prefill_mode(mode);
  v1::DocumentUploadResponse up;
  grpc::Status s = Upload(c, text, ids, options, &up);
  if (!s.ok()) return RpcError("ask", s);
  const std::string doc_id = up.document().document_id();
  std::fprintf(stderr, "document %s (%s, %llu tokens)\n", doc_id.c_str(), up.created() ? "uploaded" : "already stored",
               static_cast<unsigned long long>(up.document().num_tokens()));
  v1::DocumentInfo last = up.document();
  if (last.state() != v1::DocumentInfo::READY) {
    s = WaitReady(c, doc_id, /*bar=*/true, &last);
    if (!s.ok()) return RpcError("ask", s);
    if (last.state() == v1::DocumentInfo::FAILED) {
      std::fprintf(stderr, "strata ask: document prefill failed: %s\n", last.error_message().c_str());
      return 1;
    }
  }
  v1::JobSubmitRequest req;
  req.set_document_id(doc_id);
  req.set_prompt_text(args[0]);
  FillGen(g, &req);
  auto stub = v1::JobService::NewStub(Connect(c));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, c.stream_timeout_seconds);
  const auto start = std::chrono::steady_clock::now();
  auto reader = stub->Generate(&ctx, req);
  v1::JobInfo final;
  s = StreamEvents(reader.get(), g.print_ids, &final);
  if (!s.ok()) return RpcError("ask", s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "usage: %s state=%s seconds=%.3f\n", UsageLine(final.usage()).c_str(),
               v1::JobInfo::State_Name(final.state()).c_str(), seconds);
  if (final.state() != v1::JobInfo::DONE) {
    std::fprintf(stderr, "strata ask: job %s ended %s: %s\n", final.job_id().c_str(),
                 v1::JobInfo::State_Name(final.state()).c_str(), final.error_message().c_str());
    return 1;
  }
  return 0;
}

}  // namespace strata::cli
