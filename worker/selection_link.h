// The selection link: a sharded job's per-layer exchange between its leader and a shard's holder
// (internal.proto ShardSelection: SelectionOpen, then one LayerQuery per layer and step, each
// answered by one SelectionResponse, in order) over a plain TCP connection instead of a gRPC
// stream. The messages, their order, the holder's session (Worker::OpenSelection, ShardSession::
// Answer) and the leader's failover are the same; only the transport differs. A decode layer
// waits for this round trip, and gRPC's costs ~40 us more than the socket's on loopback
// (bench/RESULTS.md, shard_rtt_bench), so the leader takes the link when the shard map offers
// one (ShardAssignment::selection_link_address) and the gRPC stream otherwise.
//
// Wire format (little-endian). A connection starts with the client's 4-byte preface "STL1". Then
// frames, each an 8-byte header (payload length as uint32, kind as uint8, 3 zero bytes) and the
// payload:
//   kind 1, client to server: a serialized SelectionRequest (the first is the stream's open);
//   kind 2, server to client: a serialized SelectionResponse, one per query, in order;
//   kind 3, server to client: the stream's end with an error: the canonical status code as
//          uint32, then the message; the server closes the connection after it.
// A payload above kSelectionLinkMaxFrame bytes, an unknown kind, a bad preface or a payload that
// does not parse ends the connection (the server answers those with a kind 3 frame,
// INVALID_ARGUMENT). The link has no authentication, as the workers' insecure gRPC: it is for the
// cluster's own network.
//
// worker::WorkerServer serves a worker's streams on the link beside its gRPC server; LeaderAttention
// (shard_attention.h) is the client.
//
// Both ends wait for a frame by spinning on the socket for a while before they block, so that
// the thread stays awake and on its core between the layers of a decode step
// (STRATA_SELECTION_LINK_SPIN_US, default kSelectionLinkDefaultSpinUs = 3 ms, 0 to block at once;
// at most half the process's cores spin at once, counted from its CPU affinity and its cgroup's
// CPU quota (a Kubernetes CPU limit); other readers block at once). A holder woken
// from a blocked read takes 2-3x longer to queue its answer; spinning took the 8B 128K sharded
// decode over two GPUs from 107.8-110.4 to 117.4-119.1 tok/s (tokenselect) and 90-91 to 100 (dense)
// (bench/RESULTS.md, session 35).
#ifndef STRATA_WORKER_SELECTION_LINK_H_
#define STRATA_WORKER_SELECTION_LINK_H_

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "strata/v1/internal.pb.h"

namespace strata::worker {

inline constexpr uint32_t kSelectionLinkMaxFrame = 256u << 20;
inline constexpr int64_t kSelectionLinkDefaultSpinUs = 3000;
// Connections a server serves at once (each is a thread); a stream is one job's exchange with one
// holder, so a worker sees about (jobs of its peers) streams.
inline constexpr int kSelectionLinkMaxStreams = 1024;

// One selection stream's serving: reads the requests with `read` (false: the stream ended) and
// writes the answers with `write` (false: the client went away). A non-OK status is sent to the
// client as the stream's end (WorkerServer serves a worker's selection sessions this way, service.h).
using SelectionStreamFn =
    std::function<absl::Status(const std::function<bool(v1::SelectionRequest*)>& read,
                               const std::function<bool(const v1::SelectionResponse&)>& write)>;

// Serves selection streams over TCP: a thread accepts connections and each connection gets a
// thread of its own running `serve` for its stream. Thread-safe.
class SelectionLinkServer {
 public:
  // Listens on `listen_address` ("host:port"; port 0 picks a free one). At most `max_streams`
  // connections are served at once; one past them gets a RESOURCE_EXHAUSTED error frame and is
  // closed. INVALID_ARGUMENT for a malformed address, UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<SelectionLinkServer>> Start(const std::string& listen_address,
                                                                    SelectionStreamFn serve,
                                                                    int max_streams = kSelectionLinkMaxStreams);
  ~SelectionLinkServer();  // Shutdown()

  int port() const { return port_; }
  // The streams being served now: a stream whose serving has returned no longer counts, so a
  // connection made after this falls below the limit is accepted.
  int streams() const;
  // Stops listening (connections are refused from then on), ends every connection (their sessions
  // end as if the leader had closed them) and joins the threads. Idempotent.
  void Shutdown();

 private:
  struct Connection;
  SelectionLinkServer(SelectionStreamFn serve, int listen_fd, int wake_fd, int port, int max_streams);
  void AcceptLoop();
  void Serve(Connection* c);

  const SelectionStreamFn serve_;
  const int listen_fd_;
  const int wake_fd_;  // eventfd: wakes the accept loop at Shutdown
  const int port_;
  const int max_streams_;
  const int64_t spin_us_;
  std::thread accept_thread_;
  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::list<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
};

// The leader's end of one link. Thread-compatible.
class SelectionLink {
 public:
  // Connects to a SelectionLinkServer at `address` ("host:port") within `timeout`.
  // UNAVAILABLE when it cannot, INVALID_ARGUMENT for a malformed address.
  static absl::StatusOr<std::unique_ptr<SelectionLink>> Connect(const std::string& address,
                                                                 absl::Duration timeout);
  ~SelectionLink();

  // Sends one request already serialized (SelectionRequest::SerializeToString), so that a layer's
  // query is serialized once for every peer. False when the connection failed.
  bool Write(const std::string& serialized_request);
  // The next answer. False, with *why, when the server ended the stream (its error), closed the
  // connection, sent something malformed, or nothing came by `deadline`; the link is unusable
  // after that.
  bool Read(absl::Time deadline, v1::SelectionResponse* out, std::string* why);

 private:
  SelectionLink(int fd, int64_t spin_us) : fd_(fd), spin_us_(spin_us) {}
  int fd_;
  const int64_t spin_us_;
  std::string payload_;
};

}  // namespace strata::worker

#endif  // STRATA_WORKER_SELECTION_LINK_H_
