#include "core/cuda_graph.h"

#include <exception>
#include <optional>
#include <string>

#include "core/check.h"

#ifdef VIADUCT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace viaduct {

#ifdef VIADUCT_WITH_CUDA

struct DeviceGraph::Impl {
  explicit Impl(c10::DeviceIndex index)
      : device(index), stream(at::cuda::getStreamFromPool(/*isHighPriority=*/false, index)) {}
  c10::DeviceIndex device;
  // Capture needs a stream other than the default one; the eager steps
  // before the capture run on it too, so the capture meets the per-stream
  // state (cuBLAS workspaces) they made.
  at::cuda::CUDAStream stream;
  at::cuda::CUDAGraph graph;
  bool captured = false;
};

struct DeviceGraph::StreamScope::State {
  State(const at::cuda::CUDAStream& caller, const at::cuda::CUDAStream& own)
      : caller(caller), guard(own) {}
  at::cuda::CUDAStream caller;
  c10::cuda::CUDAStreamGuard guard;
};

DeviceGraph::DeviceGraph(const at::Device& device) {
  VIADUCT_CHECK(device.is_cuda(), "a CUDA graph needs a CUDA device, not ", device);
  impl_ = std::make_unique<Impl>(device.index());
}

DeviceGraph::StreamScope DeviceGraph::stream_scope() {
  const auto caller = at::cuda::getCurrentCUDAStream(impl_->device);
  at::cuda::CUDAEvent queued;
  queued.record(caller);
  queued.block(impl_->stream);
  return StreamScope(std::make_unique<StreamScope::State>(caller, impl_->stream));
}

DeviceGraph::StreamScope::~StreamScope() {
  if (!state_) return;
  // The caller's stream waits for the scope's work: what it queues next
  // (an eval, a checkpoint's copies, frees of the step's tensors) comes after.
  at::cuda::CUDAEvent done;
  done.record(at::cuda::getCurrentCUDAStream(state_->caller.device_index()));
  done.block(state_->caller);
}

void DeviceGraph::capture(const std::function<void()>& record) {
  VIADUCT_CHECK(!impl_->captured, "the CUDA graph is captured already");
  VIADUCT_CHECK(at::cuda::getCurrentCUDAStream(impl_->device) == impl_->stream,
                "a CUDA graph is captured inside its stream_scope()");
  // Blocks cached by the eager steps go back to the driver: the graph's
  // pool takes their place.
  at::cuda::device_synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
  impl_->graph.capture_begin();
  // Ends the failed capture (the stream leaves capture mode); what ending
  // it said, for the message.
  auto end_failed = [this] {
    std::string ended;
    try {
      impl_->graph.capture_end();
    } catch (const std::exception& e) {
      ended = std::string("; ending the capture: ") + e.what();
    }
    (void)cudaGetLastError();  // the capture's error is reported by the caller
    return ended;
  };
  try {
    record();
  } catch (const ConfigError&) {
    end_failed();
    throw;  // a refusal keeps its type (and its message names the key)
  } catch (const std::exception& e) {
    const auto ended = end_failed();
    throw Error(std::string("the step could not be captured as a CUDA graph: ") + e.what() +
                ended);
  }
  impl_->graph.capture_end();
  impl_->captured = true;
}

bool DeviceGraph::captured() const { return impl_->captured; }

void DeviceGraph::replay() {
  VIADUCT_CHECK(impl_->captured, "replay of a CUDA graph that was not captured");
  impl_->graph.replay();
}

#else  // no CUDA in this build

struct DeviceGraph::Impl {};
struct DeviceGraph::StreamScope::State {};

DeviceGraph::DeviceGraph(const at::Device& device) {
  VIADUCT_CHECK(false, "a CUDA graph on ", device, ": this build has no CUDA");
}
DeviceGraph::StreamScope DeviceGraph::stream_scope() { return StreamScope(nullptr); }
DeviceGraph::StreamScope::~StreamScope() = default;
void DeviceGraph::capture(const std::function<void()>&) {}
bool DeviceGraph::captured() const { return false; }
void DeviceGraph::replay() {}

#endif

DeviceGraph::StreamScope::StreamScope(std::unique_ptr<State> state) : state_(std::move(state)) {}
DeviceGraph::StreamScope::StreamScope(StreamScope&&) noexcept = default;
DeviceGraph::~DeviceGraph() = default;

}  // namespace viaduct
