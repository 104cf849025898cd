// Sums of time intervals of a device's work, measured without a device
// synchronisation per interval. On CPU an interval is host time between two
// steady-clock readings (CPU ops run synchronously). On CUDA it is device time
// between two timing events recorded on the device's current stream, so
// asynchronous kernels count when they run, not when they were launched; the
// events come from a pool kept across periods and are read once, by
// take_seconds(), which waits only for the last one.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <vector>

namespace viaduct {

class DeviceTimer {
 public:
  // `num_slots` independent sums. Intervals of one slot do not nest; those
  // of different slots may (a slot for a whole phase around slots for its
  // parts).
  DeviceTimer(const at::Device& device, size_t num_slots);
  ~DeviceTimer();
  DeviceTimer(const DeviceTimer&) = delete;
  DeviceTimer& operator=(const DeviceTimer&) = delete;

  // Opens / closes an interval of `slot` at this point of the device's work.
  void begin(size_t slot);
  void end(size_t slot);
  // Seconds per slot of the intervals closed since the last take, then
  // forgets them (an interval still open is dropped).
  std::vector<double> take_seconds();
  // Forgets every interval, open or closed (after a failed step).
  void reset();

 private:
  struct CudaEvents;  // the CUDA build's event pool (device_timer.cpp)
  using Clock = std::chrono::steady_clock;

  at::Device device_;
  std::vector<double> host_seconds_;          // CPU: closed intervals
  std::vector<Clock::time_point> host_open_;  // CPU: start of the open one
  std::vector<bool> open_;
  std::unique_ptr<CudaEvents> cuda_;  // null on CPU
};

}  // namespace viaduct
