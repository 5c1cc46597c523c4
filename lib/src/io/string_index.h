// Strings -> dense ids 0, 1, 2, ... in insertion order, for feature dictionaries of millions of keys: open addressing
// over stored 64-bit hashes (a probe compares hashes and touches a key only on a match), the keys in one vector.
// Lookups take string_views, so looking up a feature built in a reused buffer allocates nothing, and callers that
// hash a key once (to pick a shard, say) pass the hash along.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trellis {

class StringIndex {
 public:
  static uint64_t hash(std::string_view key);

  StringIndex() = default;
  // An index over distinct keys, key i getting id i; a duplicate is an Error naming it as a `what`.
  explicit StringIndex(std::vector<std::string> keys, const std::string& what = "key");

  // The key's id, or -1.
  int64_t find(std::string_view key) const { return find(key, hash(key)); }
  int64_t find(std::string_view key, uint64_t h) const;
  // The key's id, adding the key with the next id when it is new; .second says whether it was added.
  std::pair<int64_t, bool> insert(std::string_view key, uint64_t h);

  std::size_t size() const { return keys_.size(); }
  const std::vector<std::string>& keys() const { return keys_; }
  // Moves the keys out, leaving the index empty.
  std::vector<std::string> release();

 private:
  struct Slot {
    uint64_t hash;
    int64_t id;  // -1: empty
  };
  std::size_t probe(std::string_view key, uint64_t h) const;  // the slot holding key, or the empty slot ending its run
  void rehash(std::size_t slots);

  std::vector<std::string> keys_;
  std::vector<Slot> slots_;  // a power of two, at most half full
};

}  // namespace trellis
