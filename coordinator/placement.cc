#include "coordinator/placement.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"

namespace strata::coordinator {

absl::Status PlacementOptions::Validate() const {
  if (page_size < 1) return absl::InvalidArgumentError(absl::StrCat("page_size must be >= 1, got ", page_size));
  if (target_shard_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_shard_tokens must be >= 1, got ", target_shard_tokens));
  }
  return absl::OkStatus();
}

int64_t ShardTokens(const v1::ShardRange& range, int64_t page_size, int64_t num_tokens) {
  const int64_t begin = static_cast<int64_t>(range.first_page()) * page_size;
  const int64_t end = std::min<int64_t>(static_cast<int64_t>(range.end_page()) * page_size, num_tokens);
  return std::max<int64_t>(0, end - begin);
}

absl::StatusOr<v1::ShardMap> PlaceDocument(const std::string& document_id, int64_t num_tokens,
                                           const PlacementOptions& options,
                                           const std::vector<WorkerCapacity>& workers) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (num_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("document has ", num_tokens, " tokens"));
  }
  if (workers.empty()) return absl::UnavailableError("no live workers to place the document on");

  const int64_t P = options.page_size;
  const int64_t num_pages = (num_tokens + P - 1) / P;
  const int64_t pages_per_shard = std::max<int64_t>(1, options.target_shard_tokens / P);
  const int64_t num_shards = (num_pages + pages_per_shard - 1) / pages_per_shard;

  v1::ShardMap map;
  map.set_document_id(document_id);
  map.set_page_size(static_cast<uint32_t>(P));
  map.set_num_tokens(static_cast<uint64_t>(num_tokens));
  map.set_version(1);

  // Near-equal split: the first (num_pages % num_shards) shards get one page more.
  const int64_t base = num_pages / num_shards;
  const int64_t extra = num_pages % num_shards;
  int64_t first = 0;
  for (int64_t i = 0; i < num_shards; ++i) {
    const int64_t pages = base + (i < extra ? 1 : 0);
    v1::ShardAssignment* a = map.add_shards();
    a->mutable_range()->set_document_id(document_id);
    a->mutable_range()->set_first_page(static_cast<uint64_t>(first));
    a->mutable_range()->set_end_page(static_cast<uint64_t>(first + pages));
    first += pages;
  }

  // Assign shards largest first (by tokens; the last one may be partial).
  std::vector<int> order(map.shards_size());
  for (int i = 0; i < map.shards_size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return ShardTokens(map.shards(a).range(), P, num_tokens) >
           ShardTokens(map.shards(b).range(), P, num_tokens);
  });
  std::vector<int64_t> free_tokens;
  std::vector<int> shards_here(workers.size(), 0);
  for (const WorkerCapacity& w : workers) free_tokens.push_back(w.free_tokens);
  for (int index : order) {
    const int64_t need = ShardTokens(map.shards(index).range(), P, num_tokens);
    int best = -1;
    for (size_t w = 0; w < workers.size(); ++w) {
      if (free_tokens[w] < need) continue;
      if (best < 0) {
        best = static_cast<int>(w);
        continue;
      }
      const auto key = [&](size_t i) {
        return std::make_tuple(-free_tokens[i], shards_here[i], workers[i].worker_id);
      };
      if (key(w) < key(static_cast<size_t>(best))) best = static_cast<int>(w);
    }
    if (best < 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no worker can hold shard ", index, " (", need, " tokens) of document ", document_id,
          " (", num_tokens, " tokens, ", workers.size(), " workers)"));
    }
    free_tokens[best] -= need;
    ++shards_here[best];
    map.mutable_shards(index)->set_worker_id(workers[best].worker_id);
  }
  return map;
}

absl::StatusOr<v1::ShardMap> ReassignShards(const v1::ShardMap& map, const std::vector<WorkerCapacity>& workers) {
  const int64_t P = map.page_size();
  const int64_t num_tokens = static_cast<int64_t>(map.num_tokens());
  std::map<std::string, size_t> index_of;
  for (size_t w = 0; w < workers.size(); ++w) index_of[workers[w].worker_id] = w;
  std::vector<int64_t> free_tokens;
  std::vector<int> shards_here(workers.size(), 0);
  for (const WorkerCapacity& w : workers) free_tokens.push_back(w.free_tokens);
  std::vector<int> orphans;
  for (int i = 0; i < map.shards_size(); ++i) {
    auto it = index_of.find(map.shards(i).worker_id());
    if (it == index_of.end()) {
      orphans.push_back(i);
    } else {
      ++shards_here[it->second];
    }
  }
  if (orphans.empty()) return map;
  if (workers.empty()) return absl::UnavailableError("no live workers to move the shards to");
  std::stable_sort(orphans.begin(), orphans.end(), [&](int a, int b) {
    return ShardTokens(map.shards(a).range(), P, num_tokens) > ShardTokens(map.shards(b).range(), P, num_tokens);
  });
  v1::ShardMap moved = map;
  for (int index : orphans) {
    const int64_t need = ShardTokens(map.shards(index).range(), P, num_tokens);
    int best = -1;
    const auto key = [&](size_t i) { return std::make_tuple(-free_tokens[i], shards_here[i], workers[i].worker_id); };
    for (size_t w = 0; w < workers.size(); ++w) {
      if (free_tokens[w] < need) continue;
      if (best < 0 || key(w) < key(static_cast<size_t>(best))) best = static_cast<int>(w);
    }
    if (best < 0) {
      return absl::ResourceExhaustedError(absl::StrCat("no live worker can hold shard ", index, " (", need,
                                                       " tokens) of document ", map.document_id()));
    }
    free_tokens[best] -= need;
    ++shards_here[best];
    moved.mutable_shards(index)->set_worker_id(workers[best].worker_id);
    moved.mutable_shards(index)->clear_worker_address();
    moved.mutable_shards(index)->clear_selection_link_address();
  }
  moved.set_version(map.version() + 1);
  return moved;
}

absl::StatusOr<std::string> ChooseLeader(const v1::ShardMap& map,
                                         const std::vector<WorkerLoadView>& workers) {
  std::map<std::string, int64_t> held;
  for (const v1::ShardAssignment& a : map.shards()) {
    held[a.worker_id()] += ShardTokens(a.range(), map.page_size(), map.num_tokens());
  }
  const WorkerLoadView* best = nullptr;
  auto key = [&](const WorkerLoadView& w) {
    auto it = held.find(w.worker_id);
    return std::make_tuple(-(it == held.end() ? 0 : it->second), w.running_jobs, w.worker_id);
  };
  for (const WorkerLoadView& w : workers) {
    if (w.running_jobs >= w.max_jobs) continue;
    if (best == nullptr || key(w) < key(*best)) best = &w;
  }
  if (best == nullptr) return absl::UnavailableError("no live worker has a free job slot");
  return best->worker_id;
}

}  // namespace strata::coordinator
