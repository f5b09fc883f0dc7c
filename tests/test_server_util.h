// Helpers of the server tests: start `tiermoe serve` on a free port, and a small blocking HTTP
// client on raw sockets (so tests can send malformed requests and hang up mid-stream). Every
// wait has a timeout; the server process is killed when the helper goes out of scope.
#pragma once
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace tiermoe::test {

using json = nlohmann::json;
using namespace std::chrono_literals;

class ServerProcess {
 public:
  // Starts `tiermoe serve --port 0 ARGS` and waits (up to 60 s) for its "listening" line.
  explicit ServerProcess(const std::vector<std::string>& args) {
    const char* bin = std::getenv("TIERMOE_BIN");
    if (!bin) throw std::runtime_error("TIERMOE_BIN is not set");
    int fds[2];
    if (pipe(fds) != 0) throw std::runtime_error("pipe");
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      std::vector<std::string> all = {bin, "serve", "--host", "127.0.0.1", "--port", "0"};
      all.insert(all.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (auto& a : all) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(bin, argv.data());
      _exit(127);
    }
    close(fds[1]);
    out_fd_ = fds[0];
    std::string line;
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (line.find('\n') == std::string::npos) {
      const int left = int(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
      pollfd p{out_fd_, POLLIN, 0};
      if (left <= 0 || poll(&p, 1, left) <= 0) throw std::runtime_error("server did not start: " + line);
      char buf[256];
      const ssize_t n = read(out_fd_, buf, sizeof buf);
      if (n <= 0) throw std::runtime_error("server exited before listening: " + line);
      line.append(buf, size_t(n));
    }
    const size_t colon = line.rfind(':');
    port_ = std::atoi(line.c_str() + colon + 1);
    if (port_ <= 0) throw std::runtime_error("no port in: " + line);
  }
  ~ServerProcess() { stop(); }

  int port() const { return port_; }
  pid_t pid() const { return pid_; }

  // SIGTERM, then SIGKILL after 10 s. Returns the exit status (-1 if it had to be killed).
  int stop() {
    if (pid_ <= 0) return status_;
    kill(pid_, SIGTERM);
    int st = 0;
    for (int i = 0; i < 200; ++i) {
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        pid_ = 0;
        close(out_fd_);
        return status_;
      }
      std::this_thread::sleep_for(50ms);
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, &st, 0);
    pid_ = 0;
    close(out_fd_);
    return status_ = -1;
  }

  // Resident memory of the server, in kB.
  long rss_kb() const {
    std::ifstream in("/proc/" + std::to_string(pid_) + "/status");
    std::string key;
    long v = -1;
    while (in >> key)
      if (key == "VmRSS:") {
        in >> v;
        break;
      }
    return v;
  }

 private:
  pid_t pid_ = 0;
  int out_fd_ = -1;
  int port_ = 0;
  int status_ = 0;
};

struct HttpResponse {
  int status = 0;  // 0: no response (connection failed or was reset)
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;                            // de-chunked
};

inline int connect_to(int port, int timeout_s = 120) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{timeout_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

inline bool send_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += size_t(n);
  }
  return true;
}

inline std::string request_text(const std::string& method, const std::string& path, const std::string& body,
                                 const std::string& content_type = "application/json") {
  std::string r = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  if (method == "POST") r += "Content-Type: " + content_type + "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  return r + "\r\n" + body;
}

inline HttpResponse parse_response(const std::string& raw) {
  HttpResponse r;
  const size_t head_end = raw.find("\r\n\r\n");
  if (raw.compare(0, 5, "HTTP/") != 0 || head_end == std::string::npos) return r;
  r.status = std::atoi(raw.c_str() + raw.find(' ') + 1);
  std::istringstream hs(raw.substr(0, head_end));
  std::string line;
  std::getline(hs, line);
  while (std::getline(hs, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const size_t c = line.find(':');
    if (c == std::string::npos) continue;
    std::string k = line.substr(0, c);
    for (char& ch : k) ch = char(std::tolower(static_cast<unsigned char>(ch)));
    r.headers[k] = line.substr(line.find_first_not_of(' ', c + 1));
  }
  std::string body = raw.substr(head_end + 4);
  if (r.headers["transfer-encoding"] == "chunked") {
    std::string out;
    size_t pos = 0;
    while (pos < body.size()) {
      const size_t eol = body.find("\r\n", pos);
      if (eol == std::string::npos) break;
      const size_t n = std::stoul(body.substr(pos, eol - pos), nullptr, 16);
      if (n == 0) break;
      out += body.substr(eol + 2, n);
      pos = eol + 2 + n + 2;
    }
    body = out;
  }
  r.body = body;
  return r;
}

// One request on its own connection; reads until the server closes it.
inline HttpResponse http(int port, const std::string& method, const std::string& path, const std::string& body = "",
                         const std::string& raw_request = "") {
  const int fd = connect_to(port);
  if (fd < 0) return {};
  if (!send_all(fd, raw_request.empty() ? request_text(method, path, body) : raw_request)) {
    // The server may refuse a body early; still try to read its answer.
  }
  std::string raw;
  char buf[65536];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    raw.append(buf, size_t(n));
  }
  close(fd);
  return parse_response(raw);
}

inline HttpResponse post(int port, const std::string& path, const json& body) { return http(port, "POST", path, body.dump()); }

// The data: payloads of an SSE body, in order ("[DONE]" included).
inline std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> out;
  std::istringstream in(body);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("data: ", 0) == 0) out.push_back(line.substr(6));
  return out;
}

// A metric's value from /metrics (the first series whose name and labels start with `name`).
inline double metric(int port, const std::string& name) {
  const HttpResponse r = http(port, "GET", "/metrics");
  std::istringstream in(r.body);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name, 0) == 0 && (line[name.size()] == ' ' || line[name.size()] == '{'))
      return std::atof(line.c_str() + line.rfind(' ') + 1);
  return -1;
}

// Polls `pred` every 50 ms for at most `timeout`.
template <class F>
bool wait_until(F pred, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(50ms);
  }
  return pred();
}

}  // namespace tiermoe::test
