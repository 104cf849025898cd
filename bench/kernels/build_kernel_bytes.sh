#!/usr/bin/env bash
# Builds the kernel bench (kernel_bytes.cu) against one tree's src/kernels
# with nvcc alone: no LibTorch, no GPU needed to build. The one recipe that
# ab_kernels.sh (per tree) and the CUDA compile test use.
#
#   bash bench/kernels/build_kernel_bytes.sh TREE OUT_BINARY
#
# TREE: a folder holding src/kernels. Environment: NVCC (nvcc, else
# /usr/local/cuda/bin/nvcc), ARCH (sm_90a, the product's architecture).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 TREE OUT_BINARY" >&2; exit 2; }
bench_src=$(cd "$(dirname "$0")" && pwd)/kernel_bytes.cu
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || NVCC=/usr/local/cuda/bin/nvcc
ARCH=${ARCH:-sm_90a}
k=$1/src/kernels
# The kernels the bench times, and common.cu for what they share.
"$NVCC" -O3 -std=c++20 -arch="$ARCH" -I "$1/src" "$bench_src" "$k/rope.cu" \
  "$k/cross_entropy.cu" "$k/rms_norm.cu" "$k/swiglu.cu" "$k/adamw.cu" "$k/moe_router.cu" \
  "$k/attn_res_read.cu" "$k/attn_res_read_norm.cu" "$k/kda.cu" "$k/common.cu" -o "$2"
