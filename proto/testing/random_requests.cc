#include "proto/testing/random_requests.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "google/protobuf/descriptor.h"
#include "grpcpp/generic/generic_stub.h"

namespace strata::proto::testing {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// A uniform pick from [0, n).
size_t Pick(std::mt19937_64* rng, size_t n) { return static_cast<size_t>((*rng)() % n); }

int64_t RandomSigned(std::mt19937_64* rng, int64_t lo, int64_t hi) {
  switch (Pick(rng, 8)) {
    case 0: return 0;
    case 1: return 1;
    case 2: return -1;
    case 3: return lo;
    case 4: return hi;
    case 5: return static_cast<int64_t>(Pick(rng, 4096)) - 64;
    case 6: return static_cast<int64_t>(Pick(rng, 1u << 20));
    default: return static_cast<int64_t>(Pick(rng, 8));
  }
}

uint64_t RandomUnsigned(std::mt19937_64* rng, uint64_t hi) {
  switch (Pick(rng, 7)) {
    case 0: return 0;
    case 1: return 1;
    case 2: return hi;
    case 3: return hi - 1;
    case 4: return Pick(rng, 4096);
    case 5: return Pick(rng, 1u << 20);
    default: return Pick(rng, 8);
  }
}

double RandomReal(std::mt19937_64* rng) {
  switch (Pick(rng, 9)) {
    case 0: return 0.0;
    case 1: return 1.0;
    case 2: return -1.0;
    case 3: return 1e30;
    case 4: return -1e30;
    case 5: return std::numeric_limits<double>::quiet_NaN();
    case 6: return std::numeric_limits<double>::infinity();
    case 7: return 1e-30;
    default: return std::uniform_real_distribution<double>(-2.0, 2.0)(*rng);
  }
}

std::string RandomText(std::mt19937_64* rng, const RandomRequestOptions& o) {
  static const char kHex[] = "0123456789abcdef";
  switch (Pick(rng, 6)) {
    case 0: return "";
    case 1:
      if (!o.known_strings.empty()) return o.known_strings[Pick(rng, o.known_strings.size())];
      [[fallthrough]];
    case 2: {  // an id's shape: 32 hex digits
      std::string s(32, '0');
      for (char& c : s) c = kHex[Pick(rng, 16)];
      return s;
    }
    case 3: {  // printable ASCII with a multi-byte character now and then
      std::string s;
      const size_t n = Pick(rng, static_cast<size_t>(o.max_string) + 1);
      for (size_t i = 0; i < n; ++i) {
        if (Pick(rng, 16) == 0) {
          s += "\xc3\xa9";  // U+00E9
        } else {
          s += static_cast<char>(' ' + Pick(rng, 95));
        }
      }
      return s;
    }
    case 4: return "127.0.0.1:1";
    default: return std::string(Pick(rng, 4) + 1, 'a' + static_cast<char>(Pick(rng, 26)));
  }
}

std::string RandomBytes(std::mt19937_64* rng, const RandomRequestOptions& o) {
  std::string s(Pick(rng, static_cast<size_t>(o.max_string) + 1), '\0');
  for (char& c : s) c = static_cast<char>((*rng)());
  return s;
}

void FillMessage(Message* m, std::mt19937_64* rng, const RandomRequestOptions& o, int depth);

// Sets (or, repeated, adds) one value of `f` in *m.
void SetOne(Message* m, const FieldDescriptor* f, std::mt19937_64* rng, const RandomRequestOptions& o, int depth) {
  const Reflection* r = m->GetReflection();
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: {
      const auto v = static_cast<int32_t>(RandomSigned(rng, std::numeric_limits<int32_t>::min(),
                                                       std::numeric_limits<int32_t>::max()));
      rep ? r->AddInt32(m, f, v) : r->SetInt32(m, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_INT64: {
      const int64_t v = RandomSigned(rng, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
      rep ? r->AddInt64(m, f, v) : r->SetInt64(m, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT32: {
      const auto v = static_cast<uint32_t>(RandomUnsigned(rng, std::numeric_limits<uint32_t>::max()));
      rep ? r->AddUInt32(m, f, v) : r->SetUInt32(m, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT64: {
      const uint64_t v = RandomUnsigned(rng, std::numeric_limits<uint64_t>::max());
      rep ? r->AddUInt64(m, f, v) : r->SetUInt64(m, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_FLOAT: {
      const auto v = static_cast<float>(RandomReal(rng));
      rep ? r->AddFloat(m, f, v) : r->SetFloat(m, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      const double v = RandomReal(rng);
      rep ? r->AddDouble(m, f, v) : r->SetDouble(m, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_BOOL: {
      const bool v = Pick(rng, 2) == 1;
      rep ? r->AddBool(m, f, v) : r->SetBool(m, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_ENUM: {
      // A declared value mostly; an undeclared number now and then (proto3 enums are open).
      const auto* e = f->enum_type();
      int v = e->value(static_cast<int>(Pick(rng, static_cast<size_t>(e->value_count()))))->number();
      const bool open = f->file()->syntax() == google::protobuf::FileDescriptor::SYNTAX_PROTO3;
      if (open && Pick(rng, 5) == 0) v = 1000 + static_cast<int>(Pick(rng, 1000));
      rep ? r->AddEnumValue(m, f, v) : r->SetEnumValue(m, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string v = f->type() == FieldDescriptor::TYPE_BYTES && Pick(rng, 2) == 0 ? RandomBytes(rng, o)
                                                                                          : RandomText(rng, o);
      rep ? r->AddString(m, f, v) : r->SetString(m, f, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE: {
      if (depth >= o.max_depth) break;
      Message* sub = rep ? r->AddMessage(m, f) : r->MutableMessage(m, f);
      FillMessage(sub, rng, o, depth + 1);
      break;
    }
  }
}

void FillMessage(Message* m, std::mt19937_64* rng, const RandomRequestOptions& o, int depth) {
  const Descriptor* d = m->GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->real_containing_oneof() != nullptr) continue;  // below: one field per oneof
    if (Pick(rng, 2) == 0) continue;
    if (f->is_repeated()) {
      const size_t n = Pick(rng, static_cast<size_t>(o.max_repeated) + 1);
      for (size_t k = 0; k < n; ++k) SetOne(m, f, rng, o, depth);
    } else {
      SetOne(m, f, rng, o, depth);
    }
  }
  for (int i = 0; i < d->oneof_decl_count(); ++i) {
    const auto* oneof = d->oneof_decl(i);
    if (oneof->is_synthetic() || Pick(rng, 2) == 0) continue;
    SetOne(m, oneof->field(static_cast<int>(Pick(rng, static_cast<size_t>(oneof->field_count())))), rng, o, depth);
  }
}

// One call of `method` with `requests`, every response read (and counted) until the end.
RandomCall CallOnce(grpc::GenericStub* stub, const std::string& method, const std::vector<std::string>& requests,
                    double call_seconds) {
  RandomCall out;
  out.method = method;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::microseconds(static_cast<int64_t>(call_seconds * 1e6)));
  grpc::CompletionQueue cq;
  void* tag = nullptr;
  bool ok = false;
  auto call = stub->PrepareCall(&ctx, method, &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  bool writing = ok;
  for (const std::string& bytes : requests) {
    if (!writing) break;
    grpc::Slice slice(bytes);
    grpc::ByteBuffer buffer(&slice, 1);
    call->Write(buffer, reinterpret_cast<void*>(2));
    cq.Next(&tag, &ok);
    writing = ok;
  }
  if (writing) {
    call->WritesDone(reinterpret_cast<void*>(3));
    cq.Next(&tag, &ok);
  }
  while (true) {
    grpc::ByteBuffer response;
    call->Read(&response, reinterpret_cast<void*>(4));
    cq.Next(&tag, &ok);
    if (!ok) break;
    ++out.responses;
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  out.code = status.error_code();
  out.message = status.error_message();
  return out;
}

// One mutation of *m (see MutateRandom).
void MutateOnce(Message* m, std::mt19937_64* rng, const RandomRequestOptions& o, int depth) {
  const Descriptor* d = m->GetDescriptor();
  if (d->field_count() == 0) return;
  const FieldDescriptor* f = d->field(static_cast<int>(Pick(rng, static_cast<size_t>(d->field_count()))));
  const Reflection* r = m->GetReflection();
  const bool set = f->is_repeated() ? r->FieldSize(*m, f) > 0 : r->HasField(*m, f);
  if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && set && depth < o.max_depth && Pick(rng, 3) != 0) {
    Message* sub = f->is_repeated()
                       ? r->MutableRepeatedMessage(m, f, static_cast<int>(Pick(rng, static_cast<size_t>(r->FieldSize(*m, f)))))
                       : r->MutableMessage(m, f);
    MutateOnce(sub, rng, o, depth + 1);
    return;
  }
  if (set && Pick(rng, 4) == 0) {
    r->ClearField(m, f);
    return;
  }
  if (f->is_repeated() && f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE && set && Pick(rng, 2) == 0) {
    r->ClearField(m, f);  // a new list of one random element
  }
  SetOne(m, f, rng, o, depth);
}

}  // namespace

void MutateRandom(Message* m, std::mt19937_64* rng, const RandomRequestOptions& options) {
  const size_t n = 1 + Pick(rng, 3);
  for (size_t i = 0; i < n; ++i) MutateOnce(m, rng, options, 0);
}

void FillRandom(Message* m, std::mt19937_64* rng, const RandomRequestOptions& options) {
  FillMessage(m, rng, options, 0);
}

std::vector<RandomCall> CallWithRandomRequests(const std::shared_ptr<grpc::Channel>& channel,
                                               const std::string& service_full_name, int rounds, uint64_t seed,
                                               const RandomRequestOptions& options, double call_seconds) {
  std::vector<RandomCall> calls;
  const auto* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(service_full_name);
  if (service == nullptr) {
    RandomCall missing;
    missing.method = service_full_name;
    missing.code = grpc::StatusCode::NOT_FOUND;
    missing.message = "no such service in the generated pool";
    calls.push_back(missing);
    return calls;
  }
  grpc::GenericStub stub(channel);
  // STRATA_RANDOM_REQUESTS_SEED: another seed, for fuzzing longer by hand (a loop over seeds).
  if (const char* env = std::getenv("STRATA_RANDOM_REQUESTS_SEED"); env != nullptr && *env != '\0') {
    seed = std::strtoull(env, nullptr, 10);
  }
  std::mt19937_64 rng(seed);
  const Message* prototype = nullptr;
  for (int round = 0; round < rounds; ++round) {
    for (int i = 0; i < service->method_count(); ++i) {
      const auto* method = service->method(i);
      prototype = google::protobuf::MessageFactory::generated_factory()->GetPrototype(method->input_type());
      std::vector<std::string> requests;
      const auto seeded = options.seeds.find(method->name());
      if (seeded != options.seeds.end() && !seeded->second.empty() && Pick(&rng, 2) == 0) {
        for (const std::string& bytes : seeded->second[Pick(&rng, seeded->second.size())]) {
          std::unique_ptr<Message> m(prototype->New());
          if (!m->ParseFromString(bytes)) continue;
          MutateRandom(m.get(), &rng, options);
          requests.push_back(m->SerializeAsString());
        }
      } else {
        const size_t n = method->client_streaming() ? Pick(&rng, 4) : 1;
        for (size_t k = 0; k < n; ++k) {
          std::unique_ptr<Message> m(prototype->New());
          FillRandom(m.get(), &rng, options);
          requests.push_back(m->SerializeAsString());
        }
      }
      calls.push_back(CallOnce(&stub, "/" + service->full_name() + "/" + method->name(), requests, call_seconds));
    }
  }
  return calls;
}

std::vector<RandomCall> CallServicesWithRandomRequests(const std::shared_ptr<grpc::Channel>& channel,
                                                       const std::vector<std::string>& services, int rounds,
                                                       uint64_t seed, const RandomRequestOptions& options,
                                                       double call_seconds) {
  std::vector<RandomCall> calls;
  for (const std::string& service : services) {
    for (RandomCall& c : CallWithRandomRequests(channel, service, rounds, seed, options, call_seconds)) {
      calls.push_back(std::move(c));
    }
  }
  return calls;
}

std::vector<RandomCall> UnexpectedCodes(const std::vector<RandomCall>& calls) {
  std::vector<RandomCall> out;
  for (const RandomCall& c : calls) {
    if (c.code == grpc::StatusCode::UNKNOWN || c.code == grpc::StatusCode::INTERNAL ||
        c.code == grpc::StatusCode::UNIMPLEMENTED) {
      out.push_back(c);
    }
  }
  return out;
}

int CountAnswered(const std::vector<RandomCall>& calls) {
  int n = 0;
  for (const RandomCall& c : calls) n += c.code == grpc::StatusCode::OK ? 1 : 0;
  return n;
}

std::string Describe(const std::vector<RandomCall>& calls) {
  std::string out;
  for (const RandomCall& c : calls) {
    out += c.method + " " + std::to_string(static_cast<int>(c.code)) + ": " + c.message + "\n";
  }
  return out;
}

}  // namespace strata::proto::testing
