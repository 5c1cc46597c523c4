// Error messages assembled without iostreams. c10::str (an std::ostringstream compiled into these libraries) crashed
// the Python process raising the error on the GPU machine (torch 2.11.0+cu130 in Python 3.12, the library built by
// g++ 13.3), where messages built from std::string pieces did not.
#pragma once

#include <ATen/ATen.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace trellis::message {

inline std::string piece(const std::string& s) { return s; }
inline std::string piece(const char* s) { return s; }
inline std::string piece(c10::string_view s) { return std::string(s.data(), s.size()); }
inline std::string piece(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, char>, int> = 0>
std::string piece(T v) {
  return std::to_string(v);
}
inline std::string piece(at::IntArrayRef shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}
inline std::string piece(c10::ScalarType type) { return c10::toString(type); }
inline std::string piece(const c10::Device& device) { return device.str(); }

// The pieces, concatenated: numbers as %g or in full, shapes as "[2, 3]", dtypes and devices by name.
template <class... Pieces>
std::string text(const Pieces&... pieces) {
  return (std::string() + ... + piece(pieces));
}

}  // namespace trellis::message
