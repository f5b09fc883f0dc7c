#include "server/http_server.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <random>

#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <httplib.h>

#include "core/check.h"
#include "server/chat_template.h"
#include "server/openai_protocol.h"

namespace tiermoe {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

constexpr int kCompletionsDefaultMaxTokens = 16;  // OpenAI's legacy default; chat: the rest of the context

std::string random_id(const char* prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[40];
  std::snprintf(buf, sizeof buf, "%s%016llx", prefix, static_cast<unsigned long long>(rng()));
  return buf;
}

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

int port_of(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
  return -1;
}

// cpp-httplib 0.11 does not give a handler its socket, and a non-streaming handler writes
// nothing until the answer is ready; to notice a client that left, find the connection's
// socket among the open descriptors by its address pair (it stays open while the handler runs).
int find_socket(const httplib::Request& req) {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return -1;
  int found = -1;
  while (dirent* e = readdir(dir)) {
    const int fd = std::atoi(e->d_name);
    if (fd <= 2) continue;
    sockaddr_storage peer{}, local{};
    socklen_t pl = sizeof peer, ll = sizeof local;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0) continue;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0) continue;
    if (port_of(peer) == req.remote_port && port_of(local) == req.local_port) {
      found = fd;
      break;
    }
  }
  closedir(dir);
  return found;
}

// The peer closed its side (or the connection failed). Pipelined bytes do not count.
bool peer_gone(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, short(POLLIN | POLLRDHUP), 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
  char c;
  return recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

}  // namespace

struct HttpServer::Impl {
  Impl(Engine& e, const ServerOptions& o, std::shared_ptr<ServerMetrics> m)
      : engine(e), opts(o), chat_template(ChatTemplate::load(o.model_dir)), metrics_owner(std::move(m)),
        metrics(*metrics_owner), scheduler(e.scheduler()) {
    metrics.set_kv_budget(scheduler.options().kv_budget_bytes);
  }

  Engine& engine;
  ServerOptions opts;
  ChatTemplate chat_template;
  std::shared_ptr<ServerMetrics> metrics_owner;
  ServerMetrics& metrics;
  Scheduler& scheduler;
  httplib::Server http;

  void send_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    if (e.status == 429) res.set_header("Retry-After", "1");
    res.set_content(dump(error_body(e)), "application/json");
  }

  // The most body bytes cpp-httplib reads (the handler refuses more than opts.max_body_bytes).
  size_t payload_max() const { return std::max<size_t>(opts.max_body_bytes * 4, 16 << 20); }

  // Validates and tokenizes; builds the scheduler request.
  SeqRequest build(const ApiRequest& r) {
    if (!r.model.empty() && r.model != opts.model_name)
      throw ApiError(404, "the model '" + r.model + "' does not exist; this server serves '" + opts.model_name + "'",
                     "model", "model_not_found");
    SeqRequest s;
    const Tokenizer& tok = engine.tokenizer();
    const ModelConfig& cfg = engine.config();
    if (!r.ignore_eos) s.stop_ids = cfg.eos_token_ids;
    s.stop = r.stop;
    if (r.chat) {
      std::string text;
      try {
        text = chat_template.render(r.messages);
      } catch (const InputError& e) {
        throw ApiError(400, e.what(), "messages", chat_template.family() == ChatTemplate::Family::None ||
                                                          chat_template.family() == ChatTemplate::Family::Unknown
                                                      ? "chat_template_unavailable"
                                                      : "");
      }
      s.prompt = tok.encode(text, false);
      const std::string eot = chat_template.end_of_turn();
      if (!eot.empty()) {
        if (auto id = tok.token_to_id(eot)) s.stop_ids.push_back(*id);
        else s.stop.push_back(eot);
      }
    } else if (!r.prompt_ids.empty()) {
      try {
        check_token_ids(r.prompt_ids, cfg, "prompt");
      } catch (const InputError& e) {
        throw ApiError(400, e.what(), "prompt");
      }
      s.prompt = r.prompt_ids;
    } else {
      s.prompt = tok.encode(r.prompt, true);
    }
    if (s.prompt.empty()) throw ApiError(400, "prompt: empty after tokenization", "prompt");
    const int ctx = cfg.max_position_embeddings;
    const int n_prompt = int(s.prompt.size());
    if (n_prompt >= ctx)
      throw ApiError(400, "this model's maximum context length is " + std::to_string(ctx) + " tokens; the prompt has " +
                              std::to_string(n_prompt) + " (and at least one token must be generated)",
                     r.chat ? "messages" : "prompt", "context_length_exceeded");
    const int64_t room = ctx - n_prompt;
    if (r.max_tokens && *r.max_tokens > room)
      throw ApiError(400, "max_tokens: " + std::to_string(*r.max_tokens) + " plus the prompt's " +
                              std::to_string(n_prompt) + " tokens exceed this model's maximum context length of " +
                              std::to_string(ctx), "max_tokens", "context_length_exceeded");
    s.max_tokens = int(r.max_tokens ? *r.max_tokens : r.chat ? room : std::min<int64_t>(kCompletionsDefaultMaxTokens, room));
    s.sampling.temperature = r.temperature;
    s.sampling.top_p = r.top_p;
    s.sampling.top_k = r.top_k;
    s.sampling.seed = r.seed ? uint64_t(*r.seed) : std::random_device{}() * 0x9E3779B97F4A7C15ull + uint64_t(std::time(nullptr));
    return s;
  }

  json usage(const SeqStream::Chunk& c) {
    return {{"prompt_tokens", c.prompt_tokens},
            {"completion_tokens", c.completion_tokens},
            {"total_tokens", c.prompt_tokens + c.completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", c.cached_tokens}}}};
  }

  json choice(bool chat, const std::string& text, const json& finish, bool stream, bool first) {
    json c = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish}};
    if (!chat) {
      c["text"] = text;
    } else if (stream) {
      json delta = json::object();
      if (first) delta["role"] = "assistant";
      if (!text.empty() || first) delta["content"] = text;
      c["delta"] = delta;
    } else {
      c["message"] = {{"role", "assistant"}, {"content", text}};
    }
    return c;
  }

  void handle_generate(const httplib::Request& req, httplib::Response& res, bool chat) {
    const std::string endpoint = chat ? "/v1/chat/completions" : "/v1/completions";
    try {
      if (req.body.size() > opts.max_body_bytes)
        throw ApiError(413, "the body has " + std::to_string(req.body.size()) + " bytes; at most " +
                                std::to_string(opts.max_body_bytes) + " are accepted", "", "request_too_large");
      const ApiRequest r = parse_api_request(req.body, chat);
      SeqRequest s = build(r);
      std::shared_ptr<SeqStream> out;
      try {
        out = scheduler.submit(std::move(s));
      } catch (const QueueFull& e) {
        throw ApiError(429, std::string(e.what()) + "; retry later", "", "queue_full");
      } catch (const InputError& e) {
        throw ApiError(400, e.what());
      }
      const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
      const int64_t created = int64_t(std::time(nullptr));
      json base = {{"id", id}, {"object", chat ? (r.stream ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
                   {"created", created}, {"model", opts.model_name}};
      if (!r.stream) {
        std::string text;
        SeqStream::Chunk c;
        const int fd = find_socket(req);
        while (!c.finished) {
          c = out->take(200ms);
          text += c.text;
          if (!c.finished && peer_gone(fd)) {
            out->cancel();  // the client left: free its sequence now; nobody reads an answer
            res.status = 499;  // nginx's "client closed request", for the metrics only
            metrics.count_request(endpoint, res.status);
            return;
          }
        }
        if (c.finish_reason == "cancelled") throw ApiError(503, "the server is shutting down");
        if (c.finish_reason == "error") throw ApiError(500, c.error);
        json body = base;
        body["choices"] = json::array({choice(chat, text, c.finish_reason, false, false)});
        body["usage"] = usage(c);
        res.status = 200;
        res.set_content(dump(body), "application/json");
      } else {
        struct State {
          std::shared_ptr<SeqStream> out;
          bool first = true;
          std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
        };
        auto st = std::make_shared<State>(State{out});
        const bool include_usage = r.include_usage;
        res.status = 200;
        res.set_header("Cache-Control", "no-cache");
        res.set_header("X-Accel-Buffering", "no");
        res.set_chunked_content_provider(
            "text/event-stream",
            [this, st, base, chat, include_usage](size_t, httplib::DataSink& sink) {
              auto write = [&](const std::string& s) {
                st->last_write = std::chrono::steady_clock::now();
                if (sink.write(s.data(), s.size())) return true;
                st->out->cancel();  // the client went away: free its sequence now
                return false;
              };
              if (chat && st->first) {
                json ev = base;
                ev["choices"] = json::array({choice(true, "", nullptr, true, true)});
                st->first = false;
                return write(sse(ev));
              }
              const SeqStream::Chunk c = st->out->take(250ms);
              if (!c.text.empty()) {
                json ev = base;
                ev["choices"] = json::array({choice(chat, c.text, nullptr, true, false)});
                if (!write(sse(ev))) return false;
              }
              if (c.finished) {
                if (c.finish_reason == "cancelled" || c.finish_reason == "error") {
                  const ApiError e(c.finish_reason == "error" ? 500 : 503,
                                   c.finish_reason == "error" ? c.error : "the server is shutting down");
                  write(sse(error_body(e)));
                } else {
                  json ev = base;
                  ev["choices"] = json::array({choice(chat, "", c.finish_reason, true, false)});
                  if (!write(sse(ev))) return false;
                  if (include_usage) {
                    json u = base;
                    u["choices"] = json::array();
                    u["usage"] = usage(c);
                    if (!write(sse(u))) return false;
                  }
                }
                if (!write("data: [DONE]\n\n")) return false;
                sink.done();
                return true;
              }
              // Nothing to send for a while (queued, or a long prefill): an SSE comment keeps
              // the connection checked, so a client that left is noticed.
              if (std::chrono::steady_clock::now() - st->last_write > 1s) return write(": keep-alive\n\n");
              return true;
            },
            [st](bool) { st->out->cancel(); });
      }
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const InputError& e) {
      send_error(res, ApiError(400, e.what()));
    } catch (const std::exception& e) {
      send_error(res, ApiError(500, std::string("internal error: ") + e.what()));
    }
    metrics.count_request(endpoint, res.status);
  }

  void routes() {
    http.Post("/v1/completions", [this](const httplib::Request& q, httplib::Response& s) { handle_generate(q, s, false); });
    http.Post("/v1/chat/completions", [this](const httplib::Request& q, httplib::Response& s) { handle_generate(q, s, true); });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      json m = {{"id", opts.model_name}, {"object", "model"}, {"created", 0}, {"owned_by", "tiermoe"},
                {"max_model_len", engine.config().max_position_embeddings}};
      res.set_content(dump({{"object", "list"}, {"data", json::array({m})}}), "application/json");
      metrics.count_request("/v1/models", 200);
    });
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"status":"ok"})", "application/json");
      metrics.count_request("/health", 200);
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics.render(), "text/plain; version=0.0.4");
    });
    // A Content-Length that is not a byte count, or over the payload limit, is answered before
    // any body is read: cpp-httplib would wait its read timeout for that many bytes, then close
    // the connection without an answer.
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!req.has_header("Content-Length")) return httplib::Server::HandlerResponse::Unhandled;
      const std::string v = req.get_header_value("Content-Length");
      const bool count = !v.empty() && v.size() <= 18 && std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (count && std::stoull(v) <= payload_max()) return httplib::Server::HandlerResponse::Unhandled;
      send_error(res, count ? ApiError(413, "Content-Length: " + v + " bytes; at most " + std::to_string(opts.max_body_bytes) +
                                                " are accepted", "", "request_too_large")
                            : ApiError(400, "Content-Length: must be a byte count, got '" + v + "'"));
      res.set_header("Connection", "close");
      return httplib::Server::HandlerResponse::Handled;
    });
    // Every other error (unknown path, wrong method, an HTTP-level failure such as a body over
    // the hard limit) still gets an OpenAI-style body.
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      std::string msg = res.status == 404 ? "no route for " + req.method + " " + req.path
                        : res.status == 413 ? "the request body is too large"
                                            : "the HTTP request could not be served (status " + std::to_string(res.status) + ")";
      res.set_content(dump(error_body(ApiError(res.status, msg))), "application/json");
    });
    http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "internal error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what += std::string(": ") + e.what();
      } catch (...) {
      }
      res.status = 500;
      res.set_content(dump(error_body(ApiError(500, what))), "application/json");
    });
  }
};

HttpServer::HttpServer(Engine& engine, const ServerOptions& opts, std::shared_ptr<ServerMetrics> metrics) {
  engine.tokenizer();  // throws InputError when the model has no tokenizer.json
  impl_ = std::make_unique<Impl>(engine, opts, std::move(metrics));
  impl_->routes();
  // One HTTP thread per connection that waits on a sequence: the running batch, the queue and
  // a few for /metrics and requests that are refused.
  const SchedulerOptions& so = impl_->scheduler.options();
  const size_t threads = size_t(so.max_batch + so.max_queue + 16);
  impl_->http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  impl_->http.set_payload_max_length(impl_->payload_max());
  impl_->http.set_read_timeout(30, 0);
  impl_->http.set_write_timeout(30, 0);
  impl_->http.set_tcp_nodelay(true);
  impl_->http.set_keep_alive_max_count(1000);
}

HttpServer::~HttpServer() = default;

void HttpServer::run(const std::function<void(int)>& on_listening) {
  int port = impl_->opts.port;
  if (port == 0) {
    port = impl_->http.bind_to_any_port(impl_->opts.host);
    if (port <= 0) throw InputError("cannot bind " + impl_->opts.host + " to a free port");
  } else if (!impl_->http.bind_to_port(impl_->opts.host, port)) {
    throw InputError("cannot bind " + impl_->opts.host + ":" + std::to_string(port) + " (in use?)");
  }
  if (on_listening) on_listening(port);
  impl_->http.listen_after_bind();
}

void HttpServer::stop() { impl_->http.stop(); }

}  // namespace tiermoe
