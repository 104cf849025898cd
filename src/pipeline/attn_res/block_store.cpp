// RankBlockStore (see Note [Rank block store lifetimes] in block_store.h).
#include "pipeline/attn_res/block_store.h"

#include <algorithm>
#include <climits>
#include <sstream>

#include "core/check.h"

namespace viaduct::pipeline {
namespace {

int64_t nbytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// Pinned host copy on the current stream. The same calls in LibTorch 1.13 and
// 2.x, so no shim: at::empty(pinned_memory) and copy_(non_blocking).
at::Tensor to_pinned_host(const at::Tensor& t) {
  auto host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  host.copy_(t, /*non_blocking=*/true);
  return host;
}

}  // namespace

RankBlockStore::RankBlockStore(int64_t rank, const BlockLayoutTables& tables,
                               bool offload)
    : rank_(rank), tables_(tables), offload_(offload) {}

void RankBlockStore::account(const at::Tensor& t, int sign) {
  bytes_ += sign * nbytes(t);
  if (!t.is_cpu()) device_bytes_ += sign * nbytes(t);
  peak_bytes_ = std::max(peak_bytes_, bytes_);
  peak_device_bytes_ = std::max(peak_device_bytes_, device_bytes_);
}

void RankBlockStore::put(int64_t stage, int64_t mb, int64_t entry,
                         const at::Tensor& block) {
  const Key k{mb, entry};
  VIADUCT_CHECK(!blocks_.count(k), "rank ", rank_, " block store: stage ", stage,
                " micro-batch ", mb, " puts block ", entry, " twice");
  auto b = block.detach();
  // On CPU there is nowhere to park: the tensor stays as it is.
  if (offload_ && !b.is_cpu()) b = to_pinned_host(b);
  account(b, +1);
  blocks_.emplace(k, std::move(b));
}

at::Tensor RankBlockStore::get(int64_t stage, int64_t mb, int64_t entry,
                               at::Device device) const {
  auto it = blocks_.find({mb, entry});
  VIADUCT_CHECK(it != blocks_.end(), "rank ", rank_, " block store: stage ", stage,
                " micro-batch ", mb, " reads block ", entry,
                ", which no earlier stage of the rank stored (or it was released)");
  const auto& b = it->second;
  if (b.device() == device) return b;
  return b.to(b.options().device(device), /*non_blocking=*/true);
}

void RankBlockStore::release(int64_t mb) {
  for (auto it = blocks_.lower_bound({mb, INT64_MIN});
       it != blocks_.end() && it->first.first == mb;) {
    account(it->second, -1);
    it = blocks_.erase(it);
  }
}

void RankBlockStore::deposit(int64_t stage, int64_t mb, int64_t entry,
                             const at::Tensor& grad) {
  VIADUCT_CHECK(grad.defined(), "rank ", rank_, " block store: stage ", stage,
                " micro-batch ", mb, " deposits an undefined gradient for block ", entry);
  const int64_t expected = tables_.expected_deposits(rank_, entry);
  auto& slot = slots_[{mb, entry}];
  VIADUCT_CHECK(static_cast<int64_t>(slot.grads.size()) < expected, "rank ", rank_,
                " block store: stage ", stage, " micro-batch ", mb,
                " deposits a gradient for block ", entry, " beyond the ", expected,
                " the layout tables expect");
  account(grad, +1);
  slot.grads.push_back(grad);
}

at::Tensor RankBlockStore::collect(int64_t stage, int64_t mb, int64_t entry) {
  const int64_t expected = tables_.expected_deposits(rank_, entry);
  auto it = slots_.find({mb, entry});
  const int64_t got = it == slots_.end() ? 0 : static_cast<int64_t>(it->second.grads.size());
  VIADUCT_CHECK(got == expected && expected > 0, "rank ", rank_, " stage ", stage,
                " micro-batch ", mb, " block ", entry, ": collected ", got,
                " gradient deposits, the layout tables expect ", expected,
                " (a later stage of the rank did not run its backward first)");
  at::Tensor sum;
  for (auto& g : it->second.grads) {
    account(g, -1);
    sum = sum.defined() ? sum + g : g;
  }
  slots_.erase(it);
  return sum;
}

void RankBlockStore::sweep(const std::string& what) {
  if (blocks_.empty() && slots_.empty()) return;
  std::ostringstream os;
  for (const auto& [k, b] : blocks_) os << " block " << k.second << " of micro-batch " << k.first << ";";
  for (const auto& [k, s] : slots_) {
    os << " " << s.grads.size() << " uncollected deposits for block " << k.second
       << " of micro-batch " << k.first << ";";
  }
  clear();
  VIADUCT_CHECK(false, "rank ", rank_, " block store at ", what, " still holds:", os.str());
}

void RankBlockStore::clear() {
  blocks_.clear();
  slots_.clear();
  bytes_ = device_bytes_ = 0;
}

}  // namespace viaduct::pipeline
