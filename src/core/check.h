// Two kinds of failure, kept apart on purpose:
//  - a bug in tiermoe: CHECK aborts with file:line (never caught, never in a hot path's contract);
//  - bad input (a file, a flag, a request): throw InputError naming what is wrong, at the boundary.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace tiermoe {

struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void check_failed(const char* expr, const char* file, int line, const char* msg) {
  std::fprintf(stderr, "tiermoe: internal error at %s:%d: CHECK(%s) failed%s%s\n", file, line, expr,
               msg[0] ? ": " : "", msg);
  std::abort();
}

}  // namespace tiermoe

#define CHECK(cond) \
  do { if (!(cond)) ::tiermoe::check_failed(#cond, __FILE__, __LINE__, ""); } while (0)
#define CHECK_MSG(cond, msg) \
  do { if (!(cond)) ::tiermoe::check_failed(#cond, __FILE__, __LINE__, (msg)); } while (0)
