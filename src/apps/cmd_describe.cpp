// `viaduct describe`: what a config builds, per layer (attention and FFN
// kind, AttnRes block), with parameter counts and the training FLOPs per
// token that MFU uses. Works for every family through describe_model.
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/command.h"
#include "config/job_config.h"
#include "core/check.h"
#include "model/model.h"

namespace viaduct::apps {
namespace {

constexpr const char* kUsage =
    "usage: viaduct describe --config FILE [--section.key=value ...] [--json]\n"
    "\n"
    "Prints the model the config builds: each layer's attention and FFN kind\n"
    "and AttnRes block, parameter counts and training FLOPs per token.\n"
    "  --json   one JSON object: {\"layers\": [...], \"params\": N, ...}\n";

nlohmann::json to_json(const ModelInfo& info) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& l : info.layers) {
    nlohmann::json j;
    j["layer"] = l.layer;
    j["attention"] = l.attention;
    j["ffn"] = l.ffn;
    if (l.block >= 0) {
      j["block"] = l.block;
      j["opens_block"] = l.opens_block;
    }
    layers.push_back(j);
  }
  nlohmann::json out;
  out["family"] = info.family;
  out["flavor"] = info.flavor;
  out["n_layers"] = info.n_layers;
  out["layers"] = layers;
  out["params"] = info.params;
  out["active_params"] = info.active_params;
  out["embedding_params"] = info.embedding_params;
  out["flops_per_token"] = info.flops_per_token;
  out["flops_per_token_outside_attention"] = info.flops_per_token_outside_attention;
  out["attention_flops_per_pair"] = info.attention_flops_per_pair;
  out["pinned_first"] = info.pinned_first;
  out["pinned_last"] = info.pinned_last;
  out["module_flops_per_token"] = info.module_flops;
  return out;
}

std::string human(double n) {
  const char* units[] = {"", "K", "M", "G", "T", "P"};
  int u = 0;
  while (n >= 1000.0 && u < 5) {
    n /= 1000.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f%s" : "%.2f%s", n, units[u]);
  return buf;
}

void print_text(const ModelInfo& info) {
  std::printf("%s / %s: %lld layers\n", info.family.c_str(),
              info.flavor.c_str(), static_cast<long long>(info.n_layers));
  const bool attn_res = !info.layers.empty() && info.layers[0].block >= 0;
  const bool flops = !info.module_flops.empty();
  std::printf("  layer  attention  ffn     %s%s\n", flops ? "flops/token  " : "",
              attn_res ? "block" : "");
  for (const auto& l : info.layers) {
    std::printf("  %5lld  %-9s  %-6s", static_cast<long long>(l.layer),
                l.attention.c_str(), l.ffn.c_str());
    if (flops) {
      const auto it = info.module_flops.find("layers." + std::to_string(l.layer));
      std::printf("  %-11s", human(it == info.module_flops.end() ? 0.0 : it->second).c_str());
    }
    if (attn_res) {
      std::printf("  %5lld%s", static_cast<long long>(l.block),
                  l.opens_block ? "  (opens)" : "");
    }
    std::printf("\n");
  }
  // The rest of the per-module FLOPs (see Note [Bubble weighted by FLOPs]).
  for (const auto& [fqn, f] : info.module_flops) {
    if (fqn.rfind("layers.", 0) != 0) {
      std::printf("  %-24s %s flops/token\n", fqn.c_str(), human(f).c_str());
    }
  }
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s.empty() ? std::string("-") : s;
  };
  std::printf("  params            %s (%lld)\n", human(info.params).c_str(),
              static_cast<long long>(info.params));
  std::printf("  active params     %s (%lld)\n", human(info.active_params).c_str(),
              static_cast<long long>(info.active_params));
  std::printf("  embedding params  %s\n", human(info.embedding_params).c_str());
  std::printf("  flops per token   %s (training, forward + backward)\n",
              human(info.flops_per_token).c_str());
  std::printf("  pinned first      %s\n", list(info.pinned_first).c_str());
  std::printf("  pinned last       %s\n", list(info.pinned_last).c_str());
}

int describe_main(int argc, char** argv) {
  const auto cmd = parse_config_command(argc, argv, "describe", kUsage, {"--json"});
  if (!cmd) return 0;
  const bool json = cmd->has("--json");
  const auto info = describe_model(cmd->job);
  if (json) {
    std::printf("%s\n", to_json(info).dump().c_str());
  } else {
    print_text(info);
  }
  return 0;
}

}  // namespace

VIADUCT_COMMAND("describe", "summary of the model a config builds", describe_main);

}  // namespace viaduct::apps
