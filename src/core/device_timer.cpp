#include "core/device_timer.h"

#include <algorithm>
#include <deque>

#include "core/check.h"

#ifdef VIADUCT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#endif

namespace viaduct {

#ifdef VIADUCT_WITH_CUDA
// Events are recorded in order into a pool that only grows: after the first
// period no event is created. A closed interval is a pair of pool indices.
struct DeviceTimer::CudaEvents {
  struct Interval {
    size_t slot, first, last;
  };
  std::deque<at::cuda::CUDAEvent> pool;  // a deque: growing moves none
  size_t used = 0;                       // events recorded this period
  std::vector<size_t> open_at;           // per slot: its begin event
  std::vector<Interval> closed;

  size_t record(c10::DeviceIndex device) {
    if (used == pool.size()) pool.emplace_back(cudaEventDefault);  // timing on
    pool[used].record(at::cuda::getCurrentCUDAStream(device));
    return used++;
  }
};
#else
struct DeviceTimer::CudaEvents {};
#endif

DeviceTimer::DeviceTimer(const at::Device& device, size_t num_slots)
    : device_(device),
      host_seconds_(num_slots, 0.0),
      host_open_(num_slots),
      open_(num_slots, false) {
  if (device_.is_cuda()) {
#ifdef VIADUCT_WITH_CUDA
    cuda_ = std::make_unique<CudaEvents>();
    cuda_->open_at.assign(num_slots, 0);
#else
    VIADUCT_CHECK(false, "DeviceTimer on ", device_,
                  ": this build has no CUDA");
#endif
  }
}

DeviceTimer::~DeviceTimer() = default;

void DeviceTimer::begin(size_t slot) {
  VIADUCT_ASSERT(slot < open_.size() && !open_[slot], "timer slot ", slot,
                 " is out of range or already open");
  open_[slot] = true;
#ifdef VIADUCT_WITH_CUDA
  if (cuda_) {
    cuda_->open_at[slot] = cuda_->record(device_.index());
    return;
  }
#endif
  host_open_[slot] = Clock::now();
}

void DeviceTimer::end(size_t slot) {
  VIADUCT_ASSERT(slot < open_.size() && open_[slot], "timer slot ", slot,
                 " is out of range or not open");
  open_[slot] = false;
#ifdef VIADUCT_WITH_CUDA
  if (cuda_) {
    const size_t last = cuda_->record(device_.index());
    cuda_->closed.push_back({slot, cuda_->open_at[slot], last});
    return;
  }
#endif
  host_seconds_[slot] +=
      std::chrono::duration<double>(Clock::now() - host_open_[slot]).count();
}

std::vector<double> DeviceTimer::take_seconds() {
#ifdef VIADUCT_WITH_CUDA
  if (cuda_) {
    std::vector<double> out(open_.size(), 0.0);
    if (cuda_->used > 0) {
      // Events complete in stream order: once the last recorded one has,
      // all have (normally already: the caller has read a result since).
      cuda_->pool[cuda_->used - 1].synchronize();
      for (const auto& iv : cuda_->closed) {
        out[iv.slot] +=
            1e-3 * cuda_->pool[iv.first].elapsed_time(cuda_->pool[iv.last]);
      }
    }
    reset();
    return out;
  }
#endif
  auto out = host_seconds_;
  reset();
  return out;
}

void DeviceTimer::reset() {
  std::fill(host_seconds_.begin(), host_seconds_.end(), 0.0);
  std::fill(open_.begin(), open_.end(), false);
#ifdef VIADUCT_WITH_CUDA
  if (cuda_) {
    cuda_->used = 0;
    cuda_->closed.clear();
  }
#endif
}

}  // namespace viaduct
