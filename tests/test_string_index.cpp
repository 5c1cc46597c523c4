#include <gtest/gtest.h>

#include <random>
#include <unordered_map>

#include "trellis/error.h"
#include "../lib/src/io/string_index.h"  // private to the library, tested on its own

using namespace trellis;

TEST(StringIndex, AgreesWithAHashMapThroughManyRehashes) {
  // Random short keys with many repeats, inserted and looked up against std::unordered_map.
  std::mt19937 rng(7);
  std::unordered_map<std::string, int64_t> want;
  StringIndex index;
  for (int i = 0; i < 200000; ++i) {
    std::string key(1 + rng() % 6, 'a');
    for (char& c : key) c = static_cast<char>('a' + rng() % 5);
    const auto [id, fresh] = index.insert(key, StringIndex::hash(key));
    const auto [it, added] = want.try_emplace(key, static_cast<int64_t>(want.size()));
    ASSERT_EQ(fresh, added) << key;
    ASSERT_EQ(id, it->second) << key;
  }
  ASSERT_GT(want.size(), 10000u);
  ASSERT_EQ(index.size(), want.size());
  for (const auto& [key, id] : want) {
    EXPECT_EQ(index.find(key), id);
    EXPECT_EQ(index.keys()[id], key);
    EXPECT_EQ(index.find(key + "z"), -1);  // 'z' never occurs in a key
  }
  EXPECT_EQ(index.find(""), -1);
  const std::vector<std::string> keys = index.keys();
  const StringIndex rebuilt(keys);
  for (std::size_t i = 0; i < keys.size(); ++i) ASSERT_EQ(rebuilt.find(keys[i]), static_cast<int64_t>(i));
  EXPECT_EQ(index.release(), keys);
  EXPECT_EQ(index.size(), 0u);
  EXPECT_EQ(index.find(keys[0]), -1);
}

TEST(StringIndex, KeysWithTheSameHashStayApart) {
  StringIndex index;
  EXPECT_EQ(index.insert("a", 5), (std::pair<int64_t, bool>{0, true}));
  EXPECT_EQ(index.insert("b", 5), (std::pair<int64_t, bool>{1, true}));
  EXPECT_EQ(index.insert("a", 5), (std::pair<int64_t, bool>{0, false}));
  EXPECT_EQ(index.find("b", 5), 1);
  EXPECT_EQ(index.find("c", 5), -1);
  EXPECT_EQ(index.find("b", 6), -1);  // a lookup goes by the hash it is given
}

TEST(StringIndex, EmptyIndexAndDuplicateKeys) {
  const StringIndex empty;
  EXPECT_EQ(empty.find("x"), -1);
  try {
    StringIndex({"a", "b", "a"}, "feature");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "duplicate feature 'a'");
  }
}
