// Device facts for metrics: which device to run on, its peak FLOPs for MFU,
// and memory high-water marks.
#pragma once

#include <torch/torch.h>

#include <optional>
#include <string>

namespace viaduct {

// "auto" -> cuda when available, else cpu. "cuda" without a GPU is an error.
// On CUDA the device is cuda:<local_rank % device count> and becomes current.
at::Device resolve_device(const std::string& requested, int local_rank = 0);
std::string device_name(const at::Device& device);
// Dense peak FLOP/s of `device` for `dtype` from a table of known GPUs
// (H200, H100, A100, ...); nullopt when unknown (CPU).
std::optional<double> peak_flops(const at::Device& device, at::ScalarType dtype);
// Peak memory so far: CUDA allocator peak, or the process's peak RSS on CPU.
double peak_memory_bytes(const at::Device& device);
// The memory a run on `device` can have now: the GPU's free memory
// (cudaMemGetInfo), or on CPU the host's MemAvailable (/proc/meminfo);
// nullopt when unknown.
std::optional<double> device_memory_bytes(const at::Device& device);
void reset_peak_memory(const at::Device& device);
void synchronize(const at::Device& device);
// A host tensor on `device`; to a GPU through pinned memory without blocking
// the host (the copy is ordered on the current stream), else a plain copy.
at::Tensor to_device_async(const at::Tensor& t, const at::Device& device);

}  // namespace viaduct
