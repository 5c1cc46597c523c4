#include "lib/src/io/string_index.h"

#include <algorithm>
#include <functional>

#include "trellis/error.h"

namespace trellis {

uint64_t StringIndex::hash(std::string_view key) { return std::hash<std::string_view>{}(key); }

StringIndex::StringIndex(std::vector<std::string> keys, const std::string& what) : keys_(std::move(keys)) {
  std::size_t slots = 16;
  while (slots < 2 * keys_.size()) slots *= 2;
  slots_.assign(slots, Slot{0, -1});
  for (std::size_t i = 0; i < keys_.size(); ++i) {
    const uint64_t h = hash(keys_[i]);
    Slot& s = slots_[probe(keys_[i], h)];
    if (s.id >= 0) throw Error("duplicate " + what + " '" + keys_[i] + "'");
    s = {h, static_cast<int64_t>(i)};
  }
}

std::size_t StringIndex::probe(std::string_view key, uint64_t h) const {
  const std::size_t mask = slots_.size() - 1;
  for (std::size_t i = h & mask;; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.id < 0 || (s.hash == h && keys_[s.id] == key)) return i;
  }
}

int64_t StringIndex::find(std::string_view key, uint64_t h) const {
  return slots_.empty() ? -1 : slots_[probe(key, h)].id;
}

std::pair<int64_t, bool> StringIndex::insert(std::string_view key, uint64_t h) {
  if (2 * (keys_.size() + 1) > slots_.size()) rehash(std::max<std::size_t>(16, 2 * slots_.size()));
  Slot& s = slots_[probe(key, h)];
  if (s.id >= 0) return {s.id, false};
  keys_.emplace_back(key);  // first, so that a failed allocation leaves no slot pointing past the keys
  s = {h, static_cast<int64_t>(keys_.size()) - 1};
  return {s.id, true};
}

void StringIndex::rehash(std::size_t slots) {
  std::vector<Slot> old(slots, Slot{0, -1});
  old.swap(slots_);
  const std::size_t mask = slots - 1;
  for (const Slot& s : old) {
    if (s.id < 0) continue;
    std::size_t i = s.hash & mask;
    while (slots_[i].id >= 0) i = (i + 1) & mask;
    slots_[i] = s;
  }
}

std::vector<std::string> StringIndex::release() {
  std::vector<std::string> keys = std::move(keys_);
  keys_.clear();
  slots_.clear();
  return keys;
}

}  // namespace trellis
