// A sequence of device work recorded once as a CUDA graph and replayed as
// one launch, on a stream of its own. CUDA builds only: elsewhere the
// constructor throws. The train step's use of it:
// see Note [The step as one CUDA graph] (train/step_graph.h).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>

namespace viaduct {

class DeviceGraph {
 public:
  // While alive, the graph's stream is the current stream of its device:
  // it starts after the work the caller's stream had queued, and the
  // caller's stream waits for it again when the scope ends. Work queued
  // in the scope, captured or not, is ordered like work on one stream.
  class StreamScope {
   public:
    StreamScope(StreamScope&&) noexcept;
    StreamScope& operator=(StreamScope&&) = delete;
    ~StreamScope();

   private:
    friend class DeviceGraph;
    struct State;
    explicit StreamScope(std::unique_ptr<State> state);
    std::unique_ptr<State> state_;
  };

  explicit DeviceGraph(const at::Device& device);
  ~DeviceGraph();
  DeviceGraph(const DeviceGraph&) = delete;
  DeviceGraph& operator=(const DeviceGraph&) = delete;

  [[nodiscard]] StreamScope stream_scope();

  // Records the device work `record` queues, inside a stream_scope(),
  // without running it. Tensors it allocates come from the graph's own
  // memory pool and keep their addresses: what the caller keeps of them
  // holds each replay's values. The allocator's cached blocks are released
  // first, so the pool does not start beside the eager steps' cached
  // activations. A failure (an op that waits for the device, reads a
  // device value on the host or is not capturable) ends the capture and
  // throws with the op's message; a ConfigError from `record` is rethrown
  // as it is.
  void capture(const std::function<void()>& record);
  bool captured() const;
  // Queues the recorded work once on the current stream (a stream_scope()).
  void replay();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace viaduct
