#include "worker/selection_link.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/cpu_limit.h"
#include "base/logging.h"
#include "base/status_macros.h"

namespace strata::worker {
namespace {

constexpr char kPreface[4] = {'S', 'T', 'L', '1'};
constexpr uint8_t kRequestFrame = 1, kResponseFrame = 2, kErrorFrame = 3;
constexpr size_t kHeaderBytes = 8;

int64_t SpinUsFromEnv() {
  const char* v = std::getenv("STRATA_SELECTION_LINK_SPIN_US");
  int64_t us = kSelectionLinkDefaultSpinUs;
  if (v != nullptr && *v != '\0' && (!absl::SimpleAtoi(v, &us) || us < 0)) us = kSelectionLinkDefaultSpinUs;
  return us;
}

// "host:port" or "[v6]:port" into its parts. False when malformed.
bool SplitHostPort(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 >= address.size()) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  int port_number = 0;
  return absl::SimpleAtoi(*port, &port_number) && port_number >= 0 && port_number <= 65535;
}

void SetNoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// A peer that stops reading fails the other end's writes after 60 s instead of blocking it.
void SetSendTimeout(int fd) {
  const timeval send_timeout{60, 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
}

// Sends every byte of the iovecs (a frame's header and payload in one call where the socket takes them).
bool SendAll(int fd, struct iovec* iov, int iovcnt) {
  while (iovcnt > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    const ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    size_t left = static_cast<size_t>(r);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return true;
}

bool WriteFrame(int fd, uint8_t kind, const char* payload, size_t n) {
  if (n > kSelectionLinkMaxFrame) return false;
  unsigned char header[kHeaderBytes] = {0};
  const uint32_t len = static_cast<uint32_t>(n);
  for (int i = 0; i < 4; ++i) header[i] = static_cast<unsigned char>(len >> (8 * i));
  header[4] = kind;
  struct iovec iov[2] = {{header, kHeaderBytes}, {const_cast<char*>(payload), n}};
  return SendAll(fd, iov, n > 0 ? 2 : 1);
}

enum class ReadResult { kOk, kClosed, kTimeout, kError };

// The threads of this process spinning on a socket at once (RecvAll) and their limit: half the
// cores the process may use (UsableCores: its CPU affinity and its cgroup's CPU quota, as a
// Kubernetes CPU limit sets it), at least one, so that spinning readers never take every core.
std::atomic<int> g_spinners{0};

int MaxSpinners() { return std::max(1, UsableCores() / 2); }

// One of those places, taken when wanted and one is free; given back by Release or the destructor.
class SpinSlot {
 public:
  explicit SpinSlot(bool want) {
    int c = g_spinners.load(std::memory_order_relaxed);
    while (want && c < MaxSpinners()) {
      if (g_spinners.compare_exchange_weak(c, c + 1, std::memory_order_relaxed)) {
        held_ = true;
        return;
      }
    }
  }
  ~SpinSlot() { Release(); }
  SpinSlot(const SpinSlot&) = delete;
  SpinSlot& operator=(const SpinSlot&) = delete;
  bool held() const { return held_; }
  void Release() {
    if (held_) g_spinners.fetch_sub(1, std::memory_order_relaxed);
    held_ = false;
  }

 private:
  bool held_ = false;
};

// Reads exactly n bytes by `deadline`, spinning on the socket for up to spin_us (never past the
// deadline; only while a spinning place is free) before blocking.
ReadResult RecvAll(int fd, char* p, size_t n, absl::Time deadline, int64_t spin_us) {
  size_t got = 0;
  auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  if (spin_us > 0 && deadline != absl::InfiniteFuture()) {
    const int64_t left_us = std::max<int64_t>(0, absl::ToInt64Microseconds(deadline - absl::Now()));
    spin_until = std::min(spin_until, std::chrono::steady_clock::now() + std::chrono::microseconds(left_us));
  }
  SpinSlot slot(spin_us > 0);
  bool spinning = slot.held();
  while (got < n) {
    const ssize_t r = recv(fd, p + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return ReadResult::kClosed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return ReadResult::kError;
    if (spinning) {
      if (std::chrono::steady_clock::now() < spin_until) continue;
      spinning = false;
      slot.Release();
    }
    int timeout_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return ReadResult::kTimeout;
      const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)));
      timeout_ms = static_cast<int>(std::min<int64_t>(ms, INT32_MAX));
    }
    pollfd pfd{fd, POLLIN, 0};
    const int ready = poll(&pfd, 1, timeout_ms);
    if (ready < 0 && errno != EINTR) return ReadResult::kError;
    if (ready == 0) return ReadResult::kTimeout;
  }
  return ReadResult::kOk;
}

// A frame's payload is read into memory at most this far ahead of the bytes that have come, so
// that a header announcing a large frame costs memory only as its bytes arrive (a peer that sends
// headers of 256 MiB frames and stops does not make the server hold 256 MiB per connection).
constexpr size_t kFrameReadStep = size_t{1} << 20;

// A frame's header and payload into *kind / *payload. kError for a frame above the limit or a
// malformed header, and for a connection closed mid-frame.
ReadResult ReadFrame(int fd, absl::Time deadline, int64_t spin_us, uint8_t* kind, std::string* payload) {
  unsigned char header[kHeaderBytes];
  ReadResult r = RecvAll(fd, reinterpret_cast<char*>(header), kHeaderBytes, deadline, spin_us);
  if (r != ReadResult::kOk) return r;
  uint32_t len = 0;
  for (int i = 0; i < 4; ++i) len |= static_cast<uint32_t>(header[i]) << (8 * i);
  if (len > kSelectionLinkMaxFrame || header[5] != 0 || header[6] != 0 || header[7] != 0) return ReadResult::kError;
  *kind = header[4];
  payload->clear();
  for (size_t got = 0; got < len;) {
    const size_t step = std::min<size_t>(len - got, kFrameReadStep);
    payload->resize(got + step);
    r = RecvAll(fd, payload->data() + got, step, deadline, spin_us);
    if (r != ReadResult::kOk) return r == ReadResult::kClosed ? ReadResult::kError : r;  // closed mid-frame
    got += step;
  }
  return ReadResult::kOk;
}

// The stream's end with `status` (a kind 3 frame: the code, then the message).
void WriteError(int fd, const absl::Status& status) {
  std::string body(4, '\0');
  const uint32_t code = static_cast<uint32_t>(status.code());
  for (int i = 0; i < 4; ++i) body[i] = static_cast<char>(code >> (8 * i));
  body.append(status.message().data(), status.message().size());
  WriteFrame(fd, kErrorFrame, body.data(), body.size());
}

// A listening socket on `address`, or the reason it could not be made.
absl::StatusOr<int> Listen(const std::string& address) {
  std::string host, port;
  if (!SplitHostPort(address, &host, &port)) {
    return absl::InvalidArgumentError(absl::StrCat("selection link: malformed listen address '", address, "'"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) {
    return absl::UnavailableError(absl::StrCat("selection link: cannot resolve '", address, "'"));
  }
  int fd = -1;
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("selection link: cannot listen on '", address, "'"));
  return fd;
}

int BoundPort(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return 0;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SelectionLinkServer
// ---------------------------------------------------------------------------------------------

struct SelectionLinkServer::Connection {
  int fd = -1;
  std::thread thread;
  std::atomic<bool> done{false};
};

absl::StatusOr<std::unique_ptr<SelectionLinkServer>> SelectionLinkServer::Start(const std::string& listen_address,
                                                                                SelectionStreamFn serve,
                                                                                int max_streams) {
  if (max_streams < 1) return absl::InvalidArgumentError("selection link: max_streams must be >= 1");
  STRATA_ASSIGN_OR_RETURN(const int fd, Listen(listen_address));
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(fd);
    return absl::UnavailableError("selection link: eventfd failed");
  }
  std::unique_ptr<SelectionLinkServer> s(new SelectionLinkServer(std::move(serve), fd, wake, BoundPort(fd), max_streams));
  s->accept_thread_ = std::thread([raw = s.get()] { raw->AcceptLoop(); });
  return s;
}

SelectionLinkServer::SelectionLinkServer(SelectionStreamFn serve, int listen_fd, int wake_fd, int port,
                                         int max_streams)
    : serve_(std::move(serve)),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      port_(port),
      max_streams_(max_streams),
      spin_us_(SpinUsFromEnv()) {}

SelectionLinkServer::~SelectionLinkServer() {
  Shutdown();
  close(wake_fd_);
}

void SelectionLinkServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    // Every stream's read returns: its session ends as if the leader had closed the connection.
    for (auto& c : connections_) ::shutdown(c->fd, SHUT_RDWR);
  }
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t w = write(wake_fd_, &one, sizeof(one));
  if (accept_thread_.joinable()) accept_thread_.join();
  close(listen_fd_);  // new connections are refused from here on
  std::list<std::unique_ptr<Connection>> left;
  {
    absl::MutexLock lock(&mu_);
    left.swap(connections_);
  }
  for (auto& c : left) {
    c->thread.join();
    close(c->fd);
  }
}

int SelectionLinkServer::streams() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& c : connections_) n += c->done.load() ? 0 : 1;
  return n;
}

void SelectionLinkServer::AcceptLoop() {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0 && errno != EINTR) {
      STRATA_LOG(ERROR) << "selection link: poll failed (" << std::strerror(errno) << "); no more connections";
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;  // the client went away, or out of descriptors for now
    SetNoDelay(fd);
    SetSendTimeout(fd);
    absl::MutexLock lock(&mu_);
    // Joins the connections that ended.
    for (auto it = connections_.begin(); it != connections_.end();) {
      if ((*it)->done.load()) {
        (*it)->thread.join();
        close((*it)->fd);
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
    if (shut_down_) {
      close(fd);
      return;
    }
    if (static_cast<int>(connections_.size()) >= max_streams_) {
      WriteError(fd, absl::ResourceExhaustedError(
                         absl::StrCat("selection link: ", max_streams_, " streams are served already")));
      ::shutdown(fd, SHUT_RDWR);
      close(fd);
      continue;
    }
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    Connection* raw = c.get();
    connections_.push_back(std::move(c));
    raw->thread = std::thread([this, raw] { Serve(raw); });
  }
}

void SelectionLinkServer::Serve(Connection* c) {
  const int fd = c->fd;
  absl::Status bad;  // a malformed frame from the client
  char preface[sizeof(kPreface)];
  // A connection that does not speak the protocol within 10 s is dropped.
  if (RecvAll(fd, preface, sizeof(preface), absl::Now() + absl::Seconds(10), 0) != ReadResult::kOk) {
    ::shutdown(fd, SHUT_RDWR);
    c->done.store(true);
    return;
  }
  if (std::memcmp(preface, kPreface, sizeof(kPreface)) != 0) {
    WriteError(fd, absl::InvalidArgumentError("selection link: bad preface"));
    ::shutdown(fd, SHUT_RDWR);
    c->done.store(true);
    return;
  }
  std::string payload;
  auto read = [&](v1::SelectionRequest* req) {
    if (!bad.ok()) return false;
    uint8_t kind = 0;
    const ReadResult r = ReadFrame(fd, absl::InfiniteFuture(), spin_us_, &kind, &payload);
    if (r == ReadResult::kClosed) return false;
    if (r != ReadResult::kOk) {
      bad = absl::InvalidArgumentError("selection link: malformed frame");
      return false;
    }
    if (kind != kRequestFrame || !req->ParseFromString(payload)) {
      bad = absl::InvalidArgumentError("selection link: a frame that is not a SelectionRequest");
      return false;
    }
    return true;
  };
  std::string out;
  auto write = [&](const v1::SelectionResponse& resp) {
    resp.SerializeToString(&out);
    return WriteFrame(fd, kResponseFrame, out.data(), out.size());
  };
  absl::Status status = serve_(read, write);
  if (status.ok()) status = bad;
  if (!status.ok()) WriteError(fd, status);
  ::shutdown(fd, SHUT_RDWR);
  c->done.store(true);
}

// ---------------------------------------------------------------------------------------------
// SelectionLink
// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<SelectionLink>> SelectionLink::Connect(const std::string& address,
                                                                       absl::Duration timeout) {
  std::string host, port;
  if (!SplitHostPort(address, &host, &port) || host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("selection link: malformed address '", address, "'"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) {
    return absl::UnavailableError(absl::StrCat("selection link: cannot resolve '", address, "'"));
  }
  const absl::Time deadline = absl::Now() + timeout;
  int fd = -1;
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    bool ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    if (!ok && errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      const int ms = static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
      int err = 0;
      socklen_t len = sizeof(err);
      ok = poll(&pfd, 1, ms) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
    }
    if (!ok) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("selection link: cannot connect to '", address, "'"));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // blocking sends; reads poll
  SetNoDelay(fd);
  SetSendTimeout(fd);
  std::unique_ptr<SelectionLink> link(new SelectionLink(fd, SpinUsFromEnv()));
  struct iovec iov = {const_cast<char*>(kPreface), sizeof(kPreface)};
  if (!SendAll(fd, &iov, 1)) {
    return absl::UnavailableError(absl::StrCat("selection link: cannot write to '", address, "'"));
  }
  return link;
}

SelectionLink::~SelectionLink() {
  if (fd_ >= 0) close(fd_);
}

bool SelectionLink::Write(const std::string& serialized_request) {
  return fd_ >= 0 && WriteFrame(fd_, kRequestFrame, serialized_request.data(), serialized_request.size());
}

bool SelectionLink::Read(absl::Time deadline, v1::SelectionResponse* out, std::string* why) {
  if (fd_ < 0) {
    *why = "link closed";
    return false;
  }
  uint8_t kind = 0;
  const ReadResult r = ReadFrame(fd_, deadline, spin_us_, &kind, &payload_);
  if (r == ReadResult::kOk && kind == kResponseFrame && out->ParseFromString(payload_)) return true;
  if (r == ReadResult::kTimeout) {
    *why = "no answer before the deadline";
  } else if (r == ReadResult::kClosed) {
    *why = "link closed";
  } else if (r == ReadResult::kOk && kind == kErrorFrame && payload_.size() >= 4) {
    uint32_t code = 0;
    for (int i = 0; i < 4; ++i) code |= static_cast<uint32_t>(static_cast<unsigned char>(payload_[i])) << (8 * i);
    if (code == 0 || code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
      code = static_cast<uint32_t>(absl::StatusCode::kUnknown);
    }
    *why = absl::StrCat("the peer ended the stream: ",
                        absl::Status(static_cast<absl::StatusCode>(code), payload_.substr(4)).ToString());
  } else {
    *why = "malformed answer frame";
  }
  close(fd_);
  fd_ = -1;
  return false;
}

}  // namespace strata::worker
