// Stop strings over streamed text: releases text as soon as it cannot be the start of a stop
// string, and cuts the text before the first stop string that appears.
#pragma once
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace tiermoe {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stop) : stop_(std::move(stop)) {
    std::erase_if(stop_, [](const std::string& s) { return s.empty(); });
  }

  // Adds text; returns what can be released. Sets *stopped when a stop string appeared.
  std::string push(const std::string& piece, bool* stopped) {
    pending_ += piece;
    size_t cut = std::string::npos;
    for (const auto& s : stop_) cut = std::min(cut, pending_.find(s));
    if (cut != std::string::npos) {
      *stopped = true;
      std::string out = pending_.substr(0, cut);
      pending_.clear();
      return out;
    }
    size_t keep = 0;  // the longest tail that is a proper prefix of some stop string
    for (const auto& s : stop_)
      for (size_t n = std::min(s.size() - 1, pending_.size()); n > keep; --n)
        if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
          keep = n;
          break;
        }
    std::string out = pending_.substr(0, pending_.size() - keep);
    pending_.erase(0, pending_.size() - keep);
    return out;
  }
  std::string flush() { return std::exchange(pending_, {}); }

 private:
  std::vector<std::string> stop_;
  std::string pending_;
};

}  // namespace tiermoe
