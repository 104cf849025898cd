#include "kernels/weight_cache.h"

#include <memory>
#include <mutex>
#include <unordered_map>

#include "core/check.h"

namespace viaduct::kernels::weight_cache {
namespace {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// One copy: its parts (weakly: a freed weight drops its copy at the next
// sweep), each part's first row in the copy and the version it was
// written at (-1: never).
struct Entry {
  std::vector<WeakImpl> parts;
  std::vector<int64_t> row_begin;
  std::vector<int64_t> versions;
  at::Tensor copy;
};

struct Registry {
  std::mutex mu;
  // Each part's entry, keyed by its TensorImpl (checked against the weak
  // pointer, so a new tensor at a freed address never matches).
  std::unordered_map<const c10::TensorImpl*, std::shared_ptr<Entry>> by_part;
  int64_t casts = 0;
};

Registry& registry() {
  static Registry r;
  return r;
}

// The index of `p` among e's parts, or -1.
int64_t index_of(const Entry& e, const c10::TensorImpl* p) {
  for (size_t i = 0; i < e.parts.size(); ++i) {
    if (e.parts[i].lock().get() == p) return static_cast<int64_t>(i);
  }
  return -1;
}

bool matches(const Entry& e, at::TensorList parts, at::ScalarType dtype) {
  if (e.parts.size() != parts.size() || e.copy.scalar_type() != dtype ||
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
  return e.copy.narrow(0, e.row_begin[i], p->size(0));
}

// Drops the entries of freed weights (their copies with them).
void sweep(Registry& r) {
  for (auto it = r.by_part.begin(); it != r.by_part.end();) {
    bool dead = false;
    for (const auto& w : it->second->parts) dead = dead || w.expired();
    it = dead ? r.by_part.erase(it) : std::next(it);
  }
}

}  // namespace

at::Tensor get(at::TensorList parts, at::ScalarType dtype) {
  VIADUCT_CHECK(!parts.empty(), "weight cache: no weights");
  const auto inner = parts[0].sizes().slice(std::min<size_t>(1, parts[0].dim()));
  for (const auto& p : parts) {
    VIADUCT_CHECK(p.dim() >= 2 && p.sizes().slice(1) == inner &&
                      p.device() == parts[0].device() &&
                      p.scalar_type() == parts[0].scalar_type() && p.scalar_type() != dtype,
                  "weight cache: the parts must be weights of 2 or more dims, equal past the "
                  "first, of one device and dtype, other than ", dtype);
  }
  at::NoGradGuard no_grad;
  auto& r = registry();
  // Only leaves are cached: a view of a weight (an expert's slice of the
  // MoE's stacked weights) is a new tensor on every forward, so a copy keyed
  // by it would never be found again.
  bool leaves = true;
  for (const auto& p : parts) leaves = leaves && p.is_leaf();
  if (!leaves) {
    std::lock_guard<std::mutex> lock(r.mu);
    ++r.casts;
    return parts.size() == 1 ? parts[0].to(dtype) : at::cat(parts).to(dtype);
  }
  std::lock_guard<std::mutex> lock(r.mu);
  std::shared_ptr<Entry> e;
  if (auto it = r.by_part.find(parts[0].unsafeGetTensorImpl());
      it != r.by_part.end() && matches(*it->second, parts, dtype)) {
    e = it->second;
  } else {
    sweep(r);
    e = std::make_shared<Entry>();
    int64_t rows = 0;
    for (const auto& p : parts) {
      e->parts.emplace_back(p.getIntrusivePtr());
      e->row_begin.push_back(rows);
      e->versions.push_back(-1);
      rows += p.size(0);
    }
    auto sizes = parts[0].sizes().vec();
    sizes[0] = rows;
    e->copy = at::empty(sizes, parts[0].options().dtype(dtype));
    // A weight belongs to one copy: a new grouping replaces every copy that
    // held one of its parts, for all of that copy's parts.
    for (const auto& p : parts) {
      auto it = r.by_part.find(p.unsafeGetTensorImpl());
      if (it == r.by_part.end()) continue;
      const auto old = it->second;
      for (auto j = r.by_part.begin(); j != r.by_part.end();) {
        j = j->second == old ? r.by_part.erase(j) : std::next(j);
      }
    }
    for (const auto& p : parts) r.by_part[p.unsafeGetTensorImpl()] = e;
  }
  bool cast = false;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t v = parts[i]._version();
    if (v == e->versions[i]) continue;
    rows_of(*e, i).copy_(parts[i]);  // rounds to nearest-even, as .to() does
    e->versions[i] = v;
    cast = true;
  }
  if (cast) ++r.casts;
  return e->copy;
}

at::Tensor slot_for(const at::Tensor& p) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_part.find(p.unsafeGetTensorImpl());
  if (it == r.by_part.end()) return {};
  const auto& e = *it->second;
  const auto i = index_of(e, p.unsafeGetTensorImpl());
  if (i < 0) return {};
  auto rows = rows_of(e, static_cast<size_t>(i));
  return rows.numel() == p.numel() ? rows : at::Tensor();
}

void mark_written(const at::Tensor& p) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_part.find(p.unsafeGetTensorImpl());
  VIADUCT_CHECK(it != r.by_part.end(), "weight cache: mark_written of a weight without a copy");
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

void clear() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.by_part.clear();
}

int64_t bytes() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<const Entry*> seen;
  int64_t n = 0;
  for (const auto& [impl, e] : r.by_part) {
    if (std::find(seen.begin(), seen.end(), e.get()) != seen.end()) continue;
    seen.push_back(e.get());
    n += static_cast<int64_t>(e->copy.nbytes());
  }
  return n;
}

int64_t casts() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.casts;
}

}  // namespace viaduct::kernels::weight_cache
