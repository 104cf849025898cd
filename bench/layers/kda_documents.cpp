// KDA over documents (ops::kda with ops::Documents: viaduct's kernels with
// their chunks over the documents in place on a GPU they were built for,
// the chunked ATen form over packed documents elsewhere):
// writes one case's inputs, outputs and gradients for an independent client
// (bench/layers/kda_documents_vs_fla.py runs flash-linear-attention's
// chunk_kda with cu_seqlens on the same inputs), and times the op's forward
// + backward three ways in one process: the window as one sequence
// (causal), the documents (one call), and one call per document.
//
// usage: kda_documents_bench --out DIR [--batch B] [--tokens T] [--heads H]
//                            [--head-dim D] [--doc-mean L] [--iters N] [--cpu]
// Defaults: 4 x 2048, 16 heads of 64 (the K3 cell's KDA), documents of
// mean 300 tokens, 20 timed iterations after 3.
//
// DIR gets, as raw little-endian fp32 in [B, T, H, D] ([B, T, H] for beta
// and dbeta): q (scaled), k, v, g (log-decays), beta, do (the output's
// gradient), o, dq, dk, dv, dg, dbeta; and meta.json with the shape, the
// files and cu_seqlens (each document's start in the B x T tokens, then
// B x T).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <malloc.h>
#include <string>
#include <vector>

#include "bench_common.h"
#include "core/device.h"
#include "ops/documents.h"
#include "ops/kda.h"

using namespace viaduct;

namespace {

void write_raw(const std::filesystem::path& path, const at::Tensor& t) {
  auto c = t.detach().to(at::kCPU, at::kFloat).contiguous();
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(c.data_ptr<float>()),
          static_cast<std::streamsize>(c.numel() * sizeof(float)));
  if (!f) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace

int main(int argc, char** argv) {
  int64_t B = 4, T = 2048, H = 16, D = 64;
  double doc_mean = 300;
  int iters = 20;
  bool cpu = false;
  std::string out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool more = i + 1 < argc;
    if (a == "--out" && more) out = argv[++i];
    else if (a == "--batch" && more) B = std::stoll(argv[++i]);
    else if (a == "--tokens" && more) T = std::stoll(argv[++i]);
    else if (a == "--heads" && more) H = std::stoll(argv[++i]);
    else if (a == "--head-dim" && more) D = std::stoll(argv[++i]);
    else if (a == "--doc-mean" && more) doc_mean = std::stod(argv[++i]);
    else if (a == "--iters" && more) iters = std::stoi(argv[++i]);
    else if (a == "--cpu") cpu = true;
    else {
      std::fprintf(stderr, "kda_documents_bench: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (out.empty()) {
    std::fprintf(stderr, "kda_documents_bench: --out DIR is required\n");
    return 2;
  }
  const auto dev = cpu ? at::Device(at::kCPU) : resolve_device("auto");
  // glibc maps each large host block afresh and unmaps it on free, so on
  // the CPU every timed call paid fresh pages for its temporaries, by how
  // the frees of the calls before it fell (one form ran 1.2x or 1.8x the
  // other from run to run). Kept: large blocks stay with the process.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  torch::manual_seed(11);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto nrm = [](const at::Tensor& x) { return x / x.norm(2, -1, true); };
  // The layer's laws: normalised q (scaled) and k, g = -exp(A) softplus(f)
  // with A in [0, log 16] per head, beta in (0, 1).
  std::vector<at::Tensor> x{
      nrm(at::randn({B, T, H, D}, f32)) / std::sqrt(double(D)), nrm(at::randn({B, T, H, D}, f32)),
      at::randn({B, T, H, D}, f32),
      -(at::rand({1, 1, H, 1}, f32) * std::log(16.0)).exp() *
          at::softplus(at::randn({B, T, H, D}, f32) - 3.0),
      at::sigmoid(at::randn({B, T, H}, f32))};
  auto dO = at::randn({B, T, H, D}, f32);
  for (auto& t : x) t = t.to(dev).requires_grad_(true);
  const auto dO_dev = dO.to(dev);
  const ops::Documents docs(bench::document_starts(B, T, doc_mean), true);
  const ops::KernelOptions ko;
  auto run = [&](const ops::Documents* d) {
    return ops::kda(x[0], x[1], x[2], x[3], x[4], 64, ko, {}, d);
  };

  auto o = run(&docs);
  auto grads = torch::autograd::grad({o}, x, {dO_dev});
  const std::filesystem::path dir(out);
  std::filesystem::create_directories(dir);
  const char* in_names[] = {"q", "k", "v", "g", "beta"};
  const char* grad_names[] = {"dq", "dk", "dv", "dg", "dbeta"};
  for (int i = 0; i < 5; ++i) {
    write_raw(dir / (std::string(in_names[i]) + ".f32"), x[i]);
    write_raw(dir / (std::string(grad_names[i]) + ".f32"), grads[i]);
  }
  write_raw(dir / "do.f32", dO);
  write_raw(dir / "o.f32", o);
  {
    const auto cu = docs.cu_seqlens();
    std::ofstream meta(dir / "meta.json");
    meta << "{\"B\": " << B << ", \"T\": " << T << ", \"H\": " << H << ", \"D\": " << D
         << ", \"device\": \"" << device_name(dev) << "\", \"cu_seqlens\": [";
    for (int64_t i = 0; i < cu.numel(); ++i) meta << (i ? ", " : "") << cu[i].item<int32_t>();
    meta << "]}\n";
  }

  double fwd_causal = 0, fwd_docs = 0;
  {
    at::NoGradGuard no_grad;
    fwd_causal = bench::median_ms([&] { run(nullptr); }, iters, dev);
    fwd_docs = bench::median_ms([&] { run(&docs); }, iters, dev);
  }
  auto fwd_bwd = [&](const std::function<at::Tensor()>& f) {
    return [&, f] { torch::autograd::grad({f()}, x, {dO_dev}); };
  };
  const double causal = bench::median_ms(fwd_bwd([&] { return run(nullptr); }), iters, dev);
  const double in_docs = bench::median_ms(fwd_bwd([&] { return run(&docs); }), iters, dev);
  // One call a document: each span's slices through the op alone.
  const double each = bench::median_ms(
      fwd_bwd([&] {
        return docs.per_document(
            x, [&](const std::vector<at::Tensor>& s, const ops::DocumentSpan&) {
              return ops::kda(s[0], s[1], s[2], s[3], s[4], 64, ko);
            });
      }),
      iters, dev);
  // The chunks each row takes over its documents (chunk 64): the kernels'
  // chunk count in place, and the packed rows' in the ATen form.
  const int64_t chunks_per_row = docs.kda_chunks(64, H, at::kCPU).spans.size(1);
  std::printf("kda core, %lld x %lld, %lld heads of %lld, %s, %zu documents (mean %.1f), "
              "%lld chunks of 64 a row over them (%lld causal)\n",
              (long long)B, (long long)T, (long long)H, (long long)D, device_name(dev).c_str(),
              docs.spans().size(), double(B * T) / double(docs.spans().size()),
              (long long)chunks_per_row, (long long)((T + 63) / 64));
  std::printf("| form | forward ms | fwd+bwd ms | fwd+bwd vs causal |\n|---|---|---|---|\n");
  std::printf("| causal (one sequence a row) | %.3f | %.3f | 1.00x |\n", fwd_causal, causal);
  std::printf("| documents, one call | %.3f | %.3f | %.2fx |\n", fwd_docs, in_docs,
              in_docs / causal);
  std::printf("| documents, one call each | | %.3f | %.2fx |\n", each, each / causal);
  return 0;
}
