// Shared pieces of the fuzz targets: the entry-point macro, the reader that turns fuzz bytes into decisions, and the
// contract every target checks (a reader either succeeds or throws trellis::Error).
//
// One source file per target. Built with TRELLIS_LIBFUZZER (clang, -fsanitize=fuzzer), TRELLIS_FUZZ_TARGET defines
// LLVMFuzzerTestOneInput; otherwise it registers the target with replay_main.cpp, which runs it over files (the test
// suite replays the seed corpora that way with any compiler).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <typeinfo>
#include <vector>

#include "trellis/error.h"

namespace trellis_fuzz {

using TargetFunction = void (*)(const uint8_t* data, std::size_t size);
bool register_target(const char* name, TargetFunction f);  // replay_main.cpp
// Called once before the first input: one intra-op thread (fuzzing runs one process per core), quiet HDF5.
void initialise_process();

}  // namespace trellis_fuzz

#ifdef TRELLIS_LIBFUZZER
#define TRELLIS_FUZZ_ENTRY(name)                                                   \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {   \
    static const bool initialised = (trellis_fuzz::initialise_process(), true);    \
    (void)initialised;                                                             \
    name##_one_input(data, size);                                                  \
    return 0;                                                                      \
  }
#else
#define TRELLIS_FUZZ_ENTRY(name) \
  [[maybe_unused]] static const bool name##_registered = trellis_fuzz::register_target(#name, name##_one_input);
#endif

// Defines a fuzz target: TRELLIS_FUZZ_TARGET(conll) { ... uses data, size ... }
#define TRELLIS_FUZZ_TARGET(name)                                       \
  static void name##_one_input(const uint8_t* data, std::size_t size); \
  TRELLIS_FUZZ_ENTRY(name)                                              \
  static void name##_one_input(const uint8_t* data, std::size_t size)

namespace trellis_fuzz {

// A finding: prints why and aborts, so that libFuzzer (or the replay test) keeps the input and the stack.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "FUZZ FINDING: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// The contract: f() returns, or throws trellis::Error. Any other exception is a finding. Returns whether f returned.
template <class F>
bool succeeds_or_throws_error(const char* what, F&& f) {
  try {
    f();
    return true;
  } catch (const trellis::Error& e) {
    static const bool verbose = std::getenv("TRELLIS_FUZZ_VERBOSE") != nullptr;  // for checking seeds and harnesses
    if (verbose) std::fprintf(stderr, "%s: trellis::Error: %s\n", what, e.what());
    return false;
  } catch (const std::exception& e) {
    finding(std::string(what) + " threw " + typeid(e).name() + " (not trellis::Error): " + e.what());
  } catch (...) {
    finding(std::string(what) + " threw an exception that is not a std::exception");
  }
}

// Decisions drawn from the fuzz input, front to back; an exhausted input reads as zeros, so every input decodes.
class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, std::size_t size) : p_(data), n_(size) {}

  std::size_t remaining() const { return n_ - pos_; }
  uint8_t byte() { return pos_ < n_ ? p_[pos_++] : 0; }
  bool flag() { return byte() & 1; }
  template <class T>
  T pod() {
    T v{};
    unsigned char raw[sizeof(T)] = {};
    for (std::size_t i = 0; i < sizeof(T); ++i) raw[i] = byte();
    std::memcpy(&v, raw, sizeof v);
    return v;
  }
  // Uniform enough in [0, n) for n <= 65536.
  std::size_t below(std::size_t n) {
    if (n <= 1) return 0;
    const std::size_t v = n <= 256 ? byte() : pod<uint16_t>();
    return v % n;
  }
  template <class T, std::size_t N>
  const T& pick(const T (&table)[N]) { return table[below(N)]; }
  // Up to max_len arbitrary bytes.
  std::string bytes(std::size_t max_len) {
    const std::size_t len = std::min<std::size_t>(below(max_len + 1), remaining());
    std::string s(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return s;
  }
  // Everything that is left.
  std::string rest() {
    std::string s(reinterpret_cast<const char*>(p_ + pos_), n_ - pos_);
    pos_ = n_;
    return s;
  }

 private:
  const uint8_t* p_;
  std::size_t n_, pos_ = 0;
};

// A file name of this process's own (fuzz targets whose readers take a path write their input there).
std::string scratch_path(const std::string& name);
void write_file(const std::string& path, const std::string& contents);

// A model file (CRF and neural CRF models) from the input. Their checksum would stop almost every mutation at the first
// check, so the first byte chooses: even, the rest of the input with a correct checksum (the formats' FNV-1a, 64-bit,
// over everything before it) appended, so that mutations reach the parser behind it; odd, the rest as it is.
std::string model_file(FuzzInput& in);
// A sentence of three tokens with `columns` input columns each (for tagging with a model that loaded).
std::vector<std::vector<std::string>> sentence_of(std::size_t columns);

// What the command line does with a tagger after loading it (CrfTagger, NeuralTagger): tag a sentence of the model's
// own column count, with marginals and k-best, and save it to a file that loads again. `name` names the type.
template <class Tagger>
void check_tagging_and_reload(const Tagger& model, const std::string& name) {
  const std::size_t columns = model.input_columns();
  if (columns >= 1 && columns <= 8) {
    const std::vector<std::vector<std::string>> sentence = sentence_of(columns);
    const std::vector<const std::vector<std::vector<std::string>>*> sentences = {&sentence};
    succeeds_or_throws_error((name + "::tag").c_str(), [&] { model.tag(sentences, true); });
    succeeds_or_throws_error((name + "::tag_kbest").c_str(), [&] { model.tag_kbest(sentences, 2); });
  }
  const std::string copy = scratch_path(name + "_resaved");
  if (!succeeds_or_throws_error((name + "::save").c_str(), [&] { model.save(copy); })) return;
  if (!succeeds_or_throws_error((name + "::load of a saved model").c_str(), [&] { Tagger::load(copy); }))
    finding("a " + name + " model that loaded, saved again, does not load");
}

}  // namespace trellis_fuzz
