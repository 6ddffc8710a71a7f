// Unit tests of <ddiloco/shard_map.hpp>: the fragment -> syncer shard map.
#include <ddiloco/shard_map.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <random>
#include <string>
#include <vector>

using ddiloco::Plan;
using ddiloco::ShardMap;
using ddiloco::TensorSpec;

namespace {

Plan plan_of(const std::vector<std::size_t>& sizes, std::size_t p) {
  std::vector<TensorSpec> t;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::string name = "t";  // appended, not "t" + ...: GCC 12 -Wrestrict false positive (see test_fragmenter)
    name += std::to_string(i);
    t.push_back({std::move(name), sizes[i], false});
  }
  return ddiloco::make_plan(t, p, ddiloco::PerTensor{});
}

std::vector<std::size_t> random_sizes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::size_t> d(1, 1'000'000);
  std::vector<std::size_t> s(n);
  for (auto& x : s) x = d(rng);
  return s;
}

}  // namespace

TEST_CASE("ShardMap gives every fragment to exactly one shard and balances bytes within the LPT bound", "[shard]") {
  for (const unsigned seed : {1U, 2U, 3U}) {
    const Plan plan = plan_of(random_sizes(40, seed), 40);
    for (const std::size_t s : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{7}, std::size_t{40}}) {
      const ShardMap map(plan, s);
      INFO("seed " << seed << ", S = " << s);
      REQUIRE(map.shards() == s);
      std::vector<int> owners(plan.num_fragments(), 0);
      std::size_t total = 0, largest = 0, biggest_fragment = 0;
      for (std::size_t k = 0; k < s; ++k) {
        const auto frags = map.fragments_of(k);
        CHECK_FALSE(frags.empty());
        CHECK(std::is_sorted(frags.begin(), frags.end()));
        std::size_t elems = 0;
        for (const std::size_t f : frags) {
          ++owners[f];
          CHECK(map.shard_of(f) == k);
          elems += plan.fragments()[f].numel;
        }
        CHECK(map.elements_of(k) == elems);
        total += elems;
        largest = std::max(largest, elems);
      }
      for (const auto& f : plan.fragments()) biggest_fragment = std::max(biggest_fragment, f.numel);
      CHECK(std::all_of(owners.begin(), owners.end(), [](int o) { return o == 1; }));
      CHECK(total == plan.total_numel());
      // Greedy by decreasing size: the largest shard is at most the mean plus one fragment.
      CHECK(static_cast<double>(largest) <= static_cast<double>(total) / static_cast<double>(s) +
                                                static_cast<double>(biggest_fragment));
      CHECK(map.imbalance() >= 1.0);
      if (s == 1) CHECK(map.imbalance() == 1.0);
    }
  }
}

TEST_CASE("ShardMap puts the two largest fragments on different shards and fills the lighter one next", "[shard]") {
  // Fragments of 10, 9, 2, 2, 1 elements into 2 shards: 10 -> 0, 9 -> 1, 2 -> 1 (11), 2 -> 0 (12), 1 -> 1 (12).
  const ShardMap map(plan_of({10, 9, 2, 2, 1}, 5), 2);
  CHECK(map.shard_of(0) == 0);
  CHECK(map.shard_of(1) == 1);
  CHECK(map.shard_of(2) == 1);  // 9 < 10: the lighter shard takes the first 2
  CHECK(map.shard_of(3) == 0);  // 11 vs 12
  CHECK(map.shard_of(4) == 1);  // 12 vs 11
  CHECK(map.elements_of(0) == 12);
  CHECK(map.elements_of(1) == 12);
}

TEST_CASE("ShardMap is the same in every process that derives it, and its fingerprint tells maps apart", "[shard]") {
  const Plan plan = plan_of(random_sizes(24, 9), 12);
  const ShardMap a(plan, 3), b(plan_of(random_sizes(24, 9), 12), 3);
  for (std::size_t f = 0; f < plan.num_fragments(); ++f) CHECK(a.shard_of(f) == b.shard_of(f));
  CHECK(a.fingerprint() == b.fingerprint());
  CHECK(ShardMap(plan, 2).fingerprint() != a.fingerprint());
  CHECK(ShardMap(plan_of(random_sizes(24, 10), 12), 3).fingerprint() != a.fingerprint());  // another plan
}

TEST_CASE("ShardMap refuses a shard count outside [1, P] and bad indices, naming the value", "[shard]") {
  const Plan plan = plan_of({5, 6, 7}, 3);
  CHECK_THROWS_WITH(ShardMap(plan, 0), Catch::Contains("shards = 0") && Catch::Contains("3 fragments"));
  CHECK_THROWS_WITH(ShardMap(plan, 4), Catch::Contains("shards = 4"));
  const ShardMap map(plan, 2);
  CHECK_THROWS_WITH(map.shard_of(3), Catch::Contains("fragment 3"));
  CHECK_THROWS_WITH(map.fragments_of(2), Catch::Contains("shard 2") && Catch::Contains("valid: 0..1"));
  CHECK_THROWS_WITH(map.elements_of(9), Catch::Contains("shard 9"));
}
