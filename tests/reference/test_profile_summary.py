#!/usr/bin/env python3
"""reference/profile_summary.py on hand-made traces whose answers are known:
device time per phase and source, and the device's idle gaps (union of
kernel spans, the host op open when a gap began, the kernel that ended it)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "reference", "profile_summary.py")


def op(name, ts, dur, ext=None, tid=1):
    e = {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if ext is not None:
        e["args"] = {"External id": ext}
    return e


def shaped(name, ts, dur, ext, dims):
    e = op(name, ts, dur, ext)
    e["args"]["Input Dims"] = dims
    return e


def kernel(name, ts, dur, ext, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 2,
            "tid": stream, "args": {"External id": ext}}


def summarise(events):
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "t.json")
        out = os.path.join(d, "s.json")
        with open(trace, "w") as f:
            json.dump({"traceEvents": events}, f)
        text = subprocess.run([sys.executable, TOOL, trace, "--json", out], check=True,
                              capture_output=True, text=True).stdout
        with open(out) as f:
            return text, json.load(f)


class ProfileSummary(unittest.TestCase):
    def test_phases_sources_and_gaps(self):
        events = [
            # forward: a matmul launched inside the step scope
            op("viaduct::forward_backward", 0, 1000),
            op("aten::mm", 10, 20, ext=1),
            kernel("nvjet_gemm", 20, 300, 1),
            # an overlapping kernel on another stream: no gap between them
            op("aten::add", 40, 10, ext=2),
            kernel("vectorized_elementwise_add", 250, 100, 2, stream=8),
            # the host blocks on a scalar read: the device idles 150 us
            op("aten::_local_scalar_dense", 340, 220),
            op("aten::mul", 560, 10, ext=3),
            kernel("elementwise_mul", 500, 50, 3),
            # the optimizer
            op("viaduct::optimizer", 600, 300),
            op("aten::_fused_adamw_", 610, 50, ext=4),
            kernel("multi_tensor_apply_kernel", 620, 280, 4),
        ]
        text, s = summarise(events)
        self.assertAlmostEqual(s["wall_us"], 1000.0)
        self.assertAlmostEqual(s["busy_us"], 300 + 100 + 50 + 280)
        self.assertEqual(s["phases"]["fwd"][0], 450.0)
        self.assertEqual(s["phases"]["optim"][0], 280.0)
        self.assertEqual(s["sources"]["fwd: aten::mm"][0], 300.0)
        # idle: 20 before the first kernel, 150 (350 -> 500: the host was in
        # the scalar read), 70 (550 -> 620), 100 after the last (900 -> 1000)
        self.assertAlmostEqual(s["idle_us"], 20 + 150 + 70 + 100)
        gaps = {round(g["idle_us"]): g for g in s["gaps"]}
        self.assertEqual(gaps[150]["next"], "fwd: aten::mul")
        self.assertEqual(gaps[150]["host"], "aten::_local_scalar_dense")
        self.assertEqual(gaps[70]["next"], "optim: aten::_fused_adamw_")
        self.assertEqual(gaps[100]["next"], "-")
        self.assertIn("device idle 0.34 ms", text)

    def test_kernel_classes(self):
        # viaduct's norm kernels count as its kernels, ATen's reductions and
        # norms as reductions, viaduct's chunk GEMMs as matmuls.
        names = {
            "void viaduct::cuda::attn_res_read_norm_backward_2pass_kernel<bf16>": "viaduct kernel",
            "void at::native::reduce_kernel<128, 4>": "reduction",
            "void at::native::vectorized_layer_norm_kernel<float>": "reduction",
            "void viaduct::cuda::gemm_kernel<false, true>": "matmul",
            "void at::native::vectorized_elementwise_kernel<8, add>": "elementwise",
        }
        events = [op("viaduct::forward_backward", 0, 1000)]
        for i, name in enumerate(names):
            events += [op("aten::x", 10 + 100 * i, 5, ext=i + 1),
                       kernel(name, 20 + 100 * i, 10 + i, i + 1)]
        _, s = summarise(events)
        want = {}
        for i, cls in enumerate(names.values()):
            want[cls] = want.get(cls, 0) + 10 + i
        self.assertEqual({c: v[0] for c, v in s["classes"].items()}, want)

    def test_glue_by_source(self):
        # ATen's elementwise kernels keyed by the node that launched them and
        # their functor; GEMMs and viaduct's kernels stay out of the table.
        events = [op("viaduct::forward_backward", 0, 1000),
                  op("autograd::engine::evaluate_function: "
                     "torch::autograd::CppNode<viaduct::(anonymous namespace)::ReadFn>", 10, 200),
                  op("aten::add", 20, 5, ext=1),
                  kernel("void at::native::vectorized_elementwise_kernel<8, "
                         "at::native::CUDAFunctor_add<c10::BFloat16> >", 30, 40, 1),
                  op("aten::add", 80, 5, ext=2),
                  kernel("void at::native::vectorized_elementwise_kernel<8, "
                         "at::native::CUDAFunctor_add<c10::BFloat16> >", 90, 30, 2),
                  op("aten::mm", 130, 5, ext=3),
                  kernel("nvjet_gemm", 140, 50, 3),
                  op("aten::copy_", 300, 5, ext=4),
                  kernel("void at::native::unrolled_elementwise_kernel<"
                         "at::native::direct_copy_kernel_cuda(float)>", 310, 20, 4)]
        text, s = summarise(events)
        self.assertEqual(s["glue"], {
            "bwd: viaduct::ReadFn / CUDAFunctor_add (BFloat16)": [70.0, 2],
            "fwd: aten::copy_ / direct_copy_kernel_cuda (float)": [20.0, 1]})
        self.assertIn("ATen glue kernel by source", text)

    def test_gemms_by_shape(self):
        # Each GEMM op's multiply-adds from its recorded shapes, once per op
        # however many kernels it launched, against the kernels' time:
        # mm 2 M K N, addmm's second and third inputs, the grouped GEMM's
        # rows against [G, K, N], its weight-gradient form [K, M] x [M, N],
        # bmm with its batch; a matmul kernel of an op without shapes counts
        # in time only.
        events = [op("viaduct::forward_backward", 0, 10000),
                  shaped("aten::mm", 10, 5, 1, [[8192, 2048], [2048, 6144]]),
                  kernel("nvjet_gemm", 20, 200, 1),
                  kernel("nvjet_gemm_epilogue", 220, 50, 1),
                  shaped("aten::addmm", 300, 5, 2, [[6144], [8192, 2048], [2048, 6144]]),
                  kernel("sm90_xmma_gemm", 310, 300, 2),
                  shaped("aten::_grouped_mm", 700, 5, 3, [[16384, 2048], [8, 2048, 1024], [8]]),
                  kernel("cutlass_grouped", 710, 100, 3),
                  shaped("aten::_grouped_mm", 900, 5, 4, [[2048, 16384], [16384, 1024], [8]]),
                  kernel("cutlass_grouped", 910, 100, 4),
                  shaped("aten::bmm", 1100, 5, 5, [[4, 64, 32], [4, 32, 16]]),
                  kernel("gemm_bmm", 1110, 10, 5),
                  op("viaduct::fused_linear", 1200, 5, ext=6),
                  kernel("nvjet_gemm", 1210, 40, 6)]
        text, s = summarise(events)
        g = s["gemms"]
        rows = g["rows"]
        mm = 2.0 * 8192 * 2048 * 6144
        self.assertEqual(rows["fwd: aten::mm / aten::mm 8192x2048 . 2048x6144"], [250.0, 1, mm])
        self.assertEqual(rows["fwd: aten::addmm / aten::addmm 8192x2048 . 2048x6144"],
                         [300.0, 1, mm])
        grouped = 2.0 * 16384 * 2048 * 1024
        self.assertEqual(
            rows["fwd: aten::_grouped_mm / aten::_grouped_mm 16384x2048 . 2048x1024, 8 groups"],
            [100.0, 1, grouped])
        self.assertEqual(rows["fwd: aten::_grouped_mm / aten::_grouped_mm 2048x16384 . 16384x1024"],
                         [100.0, 1, grouped])
        self.assertEqual(rows["fwd: aten::bmm / aten::bmm 4 x (64x32 . 32x16)"],
                         [10.0, 1, 2.0 * 4 * 64 * 32 * 16])
        self.assertEqual(rows["fwd: viaduct::fused_linear (no shapes)"], [40.0, 1, 0.0])
        self.assertAlmostEqual(g["matmul_us"], 250 + 300 + 100 + 100 + 10 + 40)
        self.assertAlmostEqual(g["shaped_us"], 250 + 300 + 100 + 100 + 10)
        self.assertAlmostEqual(g["flops"], 2 * mm + 2 * grouped + 2.0 * 4 * 64 * 32 * 16)
        # mm: 206 GFLOP in 250 us = 825 TFLOP/s, 83% of 989
        self.assertIn("| fwd: aten::mm / aten::mm 8192x2048 . 2048x6144 | 0.250 | 1 | 825 | 83 |",
                      text)

    def test_device_only_trace(self):
        # metrics.profile_host_ops = false: kernels only; the gaps are named
        # by the kernels around them.
        events = [kernel("gemm_a", 0, 100, 1), kernel("norm_b", 130, 20, 2),
                  kernel("adamw_c", 400, 50, 3)]
        text, s = summarise(events)
        self.assertAlmostEqual(s["busy_us"], 170.0)
        self.assertAlmostEqual(s["idle_us"], 30 + 250)
        gaps = {round(g["idle_us"]): g for g in s["gaps"]}
        self.assertEqual(gaps[250]["host"], "after norm_b")
        self.assertEqual(gaps[250]["next"], "adamw_c")
        self.assertEqual(gaps[30]["host"], "after gemm_a")
        self.assertEqual(s["sources"]["?: (no host op)"][0], 170.0)

    def test_host_only_trace(self):
        # Debian's Kineto-less LibTorch: host ops only, no idle table.
        events = [op("viaduct::forward_backward", 0, 100), op("aten::mm", 10, 50),
                  op("aten::add", 70, 20)]
        text, s = summarise(events)
        self.assertNotIn("idle_us", s)
        self.assertAlmostEqual(s["host_us"], 70.0)
        self.assertIn("no device kernels", text)


if __name__ == "__main__":
    unittest.main()
