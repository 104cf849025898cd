#include "kernels/weight_cache.h"

#include <algorithm>

#include "core/check.h"

namespace viaduct::kernels {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// One copy: its parts (weakly: a freed weight drops its copy at the next
// sweep), the dim they are concatenated along, each part's first index
// there and the version it was written at (-1: never).
struct WeightCache::Entry {
  std::vector<WeakImpl> parts;
  int64_t dim = 0;
  std::vector<int64_t> row_begin;
  std::vector<int64_t> versions;
  at::Tensor copy;
};

namespace {

using Entry = WeightCache::Entry;

// The index of `p` among e's parts, or -1.
int64_t index_of(const Entry& e, const c10::TensorImpl* p) {
  for (size_t i = 0; i < e.parts.size(); ++i) {
    if (e.parts[i].lock().get() == p) return static_cast<int64_t>(i);
  }
  return -1;
}

bool matches(const Entry& e, at::TensorList parts, at::ScalarType dtype, int64_t dim) {
  if (e.parts.size() != parts.size() || e.dim != dim || e.copy.scalar_type() != dtype ||
      e.copy.device() != parts[0].device()) {
    return false;
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    if (e.parts[i].lock().get() != parts[i].unsafeGetTensorImpl()) return false;
  }
  return true;
}

at::Tensor rows_of(const Entry& e, size_t i) {
  const auto p = e.parts[i].lock();
  return e.copy.narrow(e.dim, e.row_begin[i], p->size(e.dim));
}

// Drops the entries of freed weights (their copies with them).
void sweep(std::unordered_map<const c10::TensorImpl*, std::shared_ptr<Entry>>& by_part) {
  for (auto it = by_part.begin(); it != by_part.end();) {
    bool dead = false;
    for (const auto& w : it->second->parts) dead = dead || w.expired();
    it = dead ? by_part.erase(it) : std::next(it);
  }
}

// p's sizes but along `dim`.
std::vector<int64_t> sizes_but(const at::Tensor& p, int64_t dim) {
  auto s = p.sizes().vec();
  s.erase(s.begin() + dim);
  return s;
}

void check_parts(at::TensorList parts, at::ScalarType dtype, int64_t dim) {
  VIADUCT_CHECK(!parts.empty(), "weight cache: no weights");
  VIADUCT_CHECK(dim >= 0 && dim < parts[0].dim(), "weight cache: dim ", dim, " of a ",
                parts[0].dim(), "-dim weight");
  const auto others = sizes_but(parts[0], dim);
  for (const auto& p : parts) {
    VIADUCT_CHECK(p.dim() == parts[0].dim() && sizes_but(p, dim) == others &&
                      p.device() == parts[0].device() &&
                      p.scalar_type() == parts[0].scalar_type() && p.scalar_type() != dtype,
                  "weight cache: the parts must be weights (or biases) of one number of dims, "
                  "equal but along dim ", dim, ", of one device and dtype, other than ", dtype);
  }
}

// A fresh cast of the parts' concatenation, not kept.
at::Tensor cast_afresh(at::TensorList parts, at::ScalarType dtype, int64_t dim) {
  at::NoGradGuard no_grad;
  return parts.size() == 1 ? parts[0].to(dtype) : at::cat(parts, dim).to(dtype);
}

}  // namespace

WeightCache::WeightCache() = default;
WeightCache::~WeightCache() = default;

at::Tensor WeightCache::get(at::TensorList parts, at::ScalarType dtype, int64_t dim) {
  check_parts(parts, dtype, dim);
  at::NoGradGuard no_grad;
  // Only leaves are cached: a view of a weight (an expert's slice of the
  // MoE's stacked weights) is a new tensor on every forward, so a copy keyed
  // by it would never be found again.
  bool leaves = true;
  for (const auto& p : parts) leaves = leaves && p.is_leaf();
  if (!leaves) {
    std::lock_guard<std::mutex> lock(mu_);
    ++casts_;
    return cast_afresh(parts, dtype, dim);
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Entry> e;
  if (auto it = by_part_.find(parts[0].unsafeGetTensorImpl());
      it != by_part_.end() && matches(*it->second, parts, dtype, dim)) {
    e = it->second;
  } else {
    sweep(by_part_);
    e = std::make_shared<Entry>();
    e->dim = dim;
    int64_t rows = 0;
    for (const auto& p : parts) {
      e->parts.emplace_back(p.getIntrusivePtr());
      e->row_begin.push_back(rows);
      e->versions.push_back(-1);
      rows += p.size(dim);
    }
    auto sizes = parts[0].sizes().vec();
    sizes[dim] = rows;
    e->copy = at::empty(sizes, parts[0].options().dtype(dtype));
    // A weight belongs to one copy: a new grouping replaces every copy that
    // held one of its parts, for all of that copy's parts.
    for (const auto& p : parts) {
      auto it = by_part_.find(p.unsafeGetTensorImpl());
      if (it == by_part_.end()) continue;
      const auto old = it->second;
      for (auto j = by_part_.begin(); j != by_part_.end();) {
        j = j->second == old ? by_part_.erase(j) : std::next(j);
      }
    }
    for (const auto& p : parts) by_part_[p.unsafeGetTensorImpl()] = e;
  }
  bool cast = false;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t v = parts[i]._version();
    if (v == e->versions[i]) continue;
    rows_of(*e, i).copy_(parts[i]);  // rounds to nearest-even, as .to() does
    e->versions[i] = v;
    cast = true;
  }
  if (cast) ++casts_;
  return e->copy;
}

at::Tensor WeightCache::slot_for(const at::Tensor& p) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_part_.find(p.unsafeGetTensorImpl());
  if (it == by_part_.end()) return {};
  const auto& e = *it->second;
  const auto i = index_of(e, p.unsafeGetTensorImpl());
  if (i < 0) return {};
  auto rows = rows_of(e, static_cast<size_t>(i));
  return rows.numel() == p.numel() ? rows : at::Tensor();
}

void WeightCache::mark_written(const at::Tensor& p) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_part_.find(p.unsafeGetTensorImpl());
  VIADUCT_CHECK(it != by_part_.end(), "weight cache: mark_written of a weight without a copy");
  auto& e = *it->second;
  const auto i = index_of(e, p.unsafeGetTensorImpl());
  VIADUCT_CHECK(i >= 0, "weight cache: mark_written of a weight without a copy");
  // The kernel's raw writes bumped neither version: the weight's, so that
  // anything holding it sees the change, and the copy's, so that a graph
  // still holding the copy fails loudly instead of reading new values.
  torch::autograd::impl::bump_version(p);
  torch::autograd::impl::bump_version(e.copy);
  e.versions[static_cast<size_t>(i)] = p._version();
}

at::Tensor WeightCache::ones_row(int64_t n, at::ScalarType dtype, const at::Device& device) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& v : ones_) {
    if (v.scalar_type() != dtype || v.device() != device) continue;
    if (v.size(0) < n) v = at::ones({n}, v.options());
    return v.narrow(0, 0, n).view({1, n});
  }
  ones_.push_back(at::ones({n}, at::TensorOptions().dtype(dtype).device(device)));
  return ones_.back().view({1, n});
}

void WeightCache::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  by_part_.clear();
}

int64_t WeightCache::bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const Entry*> seen;
  int64_t n = 0;
  for (const auto& [impl, e] : by_part_) {
    if (std::find(seen.begin(), seen.end(), e.get()) != seen.end()) continue;
    seen.push_back(e.get());
    n += static_cast<int64_t>(e->copy.nbytes());
  }
  return n;
}

int64_t WeightCache::casts() {
  std::lock_guard<std::mutex> lock(mu_);
  return casts_;
}

at::Tensor cast_weights(WeightCache* cache, at::TensorList parts, at::ScalarType dtype,
                        int64_t dim) {
  if (cache != nullptr) return cache->get(parts, dtype, dim);
  check_parts(parts, dtype, dim);
  return cast_afresh(parts, dtype, dim);
}

at::Tensor ones_row(WeightCache* cache, int64_t n, at::ScalarType dtype, const at::Device& device) {
  if (cache != nullptr) return cache->ones_row(n, dtype, device);
  return at::ones({1, n}, at::TensorOptions().dtype(dtype).device(device));
}

}  // namespace viaduct::kernels
