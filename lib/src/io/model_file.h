// The binary pieces of the library's model files (CrfTagger's and NeuralTagger's): native-endian plain values,
// length-prefixed strings, float32 arrays and an FNV-1a checksum. Internal to the library.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "trellis/error.h"

namespace trellis {

inline uint64_t fnv1a(const char* data, std::size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 1099511628211ull;
  return h;
}

class ModelWriter {
 public:
  template <class T>
  void pod(T v) {
    buf_.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void str(const std::string& s) {
    pod<uint64_t>(s.size());
    buf_ += s;
  }
  void strings(const std::vector<std::string>& v) {
    pod<uint64_t>(v.size());
    for (const auto& s : v) str(s);
  }
  void floats(const at::Tensor& t) {
    const at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
    buf_.append(reinterpret_cast<const char*>(c.data_ptr<float>()), c.numel() * sizeof(float));
  }
  std::string& buffer() { return buf_; }

 private:
  std::string buf_;
};

// Reads data[begin, end); every shortfall or impossible value is an Error "'SOURCE': corrupt KIND (why)".
class ModelReader {
 public:
  ModelReader(const std::string& data, std::size_t begin, std::size_t end, std::string source, std::string kind)
      : d_(data), end_(end), pos_(begin), src_(std::move(source)), kind_(std::move(kind)) {}
  template <class T>
  T pod() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, d_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }
  std::string str() {
    const uint64_t n = pod<uint64_t>();
    need(n);
    std::string s = d_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  // A count of items that take at least `item_bytes` each: more than the rest of the file can hold is corrupt
  // (checked before anything is allocated for them).
  uint64_t count(std::size_t item_bytes, const std::string& what) {
    const uint64_t n = pod<uint64_t>();
    if (n > (end_ - pos_) / item_bytes) corrupt(what + " count " + std::to_string(n) + " exceeds the file");
    return n;
  }
  std::vector<std::string> strings(const std::string& what) {
    std::vector<std::string> v(count(sizeof(uint64_t), what));
    for (auto& s : v) s = str();
    return v;
  }
  // Finite float32 values of the given shape: a NaN or infinite weight is corrupt (it would make every probability
  // NaN).
  at::Tensor floats(const std::vector<int64_t>& shape, const std::string& what) {
    uint64_t n = 1;
    for (int64_t s : shape) {
      if (s != 0 && n > (end_ - pos_) / static_cast<uint64_t>(s)) corrupt("truncated in " + what);
      n *= static_cast<uint64_t>(s);
    }
    if (n > (end_ - pos_) / sizeof(float)) corrupt("truncated in " + what);
    at::Tensor t = at::empty(shape, at::kFloat);
    if (n > 0) std::memcpy(t.data_ptr<float>(), d_.data() + pos_, n * sizeof(float));
    pos_ += n * sizeof(float);
    const at::Tensor bad = ~at::isfinite(t).flatten();
    if (bad.any().item<bool>())
      corrupt(what + " entry " + std::to_string(bad.nonzero()[0][0].item<int64_t>()) + " is not finite");
    return t;
  }
  // floats() of t's shape, copied into t.
  void floats_into(at::Tensor& t, const std::string& what) {
    const at::Tensor values = floats(t.sizes().vec(), what);
    c10::NoGradGuard no_grad;
    t.copy_(values);
  }
  bool done() const { return pos_ == end_; }
  std::size_t remaining() const { return end_ - pos_; }
  [[noreturn]] void corrupt(const std::string& why) const {
    throw Error("'" + src_ + "': corrupt " + kind_ + " (" + why + ")");
  }

 private:
  void need(uint64_t n) const {
    if (n > end_ - pos_) corrupt("truncated");
  }
  const std::string& d_;
  std::size_t end_, pos_;
  std::string src_, kind_;
};

}  // namespace trellis
