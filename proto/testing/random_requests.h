// Random requests for the services' "no crash on any input" tests: messages filled through
// reflection with values that are mostly near the valid ones (small numbers, the edges of each
// type, known ids, unknown enum numbers), and every method of a gRPC service called with them
// through the generic stub, whatever its kind (unary or streaming either way).
#ifndef STRATA_PROTO_TESTING_RANDOM_REQUESTS_H_
#define STRATA_PROTO_TESTING_RANDOM_REQUESTS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"

namespace strata::proto::testing {

struct RandomRequestOptions {
  int max_depth = 4;      // nested messages deeper than this are left unset
  int max_repeated = 4;   // elements of a repeated field, at most
  int max_string = 40;    // bytes of a random string or bytes field, at most
  // Strings a string field takes now and then (ids the server knows, names it accepts), so that
  // requests reach past the first lookup.
  std::vector<std::string> known_strings;
  // Valid requests to start from, by method name ("Submit"): each a call's messages, serialized
  // (a unary call's one). Half of a seeded method's calls send one of them with each message
  // mutated (MutateRandom), reaching past the validation that most random requests stop at.
  std::map<std::string, std::vector<std::vector<std::string>>> seeds;
};

// Sets each field of *m with probability 1/2 (a oneof: one of its fields) to a random value.
// String fields get valid UTF-8 (proto3 refuses anything else before the service sees it).
void FillRandom(google::protobuf::Message* m, std::mt19937_64* rng, const RandomRequestOptions& options = {});

// Changes 1 to 3 random fields of *m, at any depth: a new random value, one more element of a
// repeated field, or the field cleared.
void MutateRandom(google::protobuf::Message* m, std::mt19937_64* rng, const RandomRequestOptions& options = {});

// One call's outcome.
struct RandomCall {
  std::string method;  // "/strata.v1.Service/Method"
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;
  int responses = 0;  // messages the server sent
};

// Calls each method of `service_full_name` (e.g. "strata.v1.JobService") `rounds` times over
// `channel`, each time with a random request (a client stream: 0 to 3 of them; or a mutated seed,
// RandomRequestOptions::seeds), reading every
// response until the server ends the call or `call_seconds` pass (then the call is cancelled).
// The environment variable STRATA_RANDOM_REQUESTS_SEED, when set, replaces `seed`.
std::vector<RandomCall> CallWithRandomRequests(const std::shared_ptr<grpc::Channel>& channel,
                                               const std::string& service_full_name, int rounds, uint64_t seed,
                                               const RandomRequestOptions& options = {}, double call_seconds = 2.0);

// The same for each of `services` in turn (each from `seed`), the calls of all of them.
std::vector<RandomCall> CallServicesWithRandomRequests(const std::shared_ptr<grpc::Channel>& channel,
                                                       const std::vector<std::string>& services, int rounds,
                                                       uint64_t seed, const RandomRequestOptions& options = {},
                                                       double call_seconds = 2.0);

// The calls of `calls` that ended with a code no request should cause: UNKNOWN (a failure the
// service did not turn into a status), INTERNAL or UNIMPLEMENTED (every method called exists).
std::vector<RandomCall> UnexpectedCodes(const std::vector<RandomCall>& calls);

// The calls that the server answered OK.
int CountAnswered(const std::vector<RandomCall>& calls);

// One line per call, "method CODE: message", for a test's failure message.
std::string Describe(const std::vector<RandomCall>& calls);

}  // namespace strata::proto::testing

#endif  // STRATA_PROTO_TESTING_RANDOM_REQUESTS_H_
