// Keys of [job], [training], [optimizer], [lr_scheduler], [checkpoint],
// [metrics], [activation_checkpoint], [model], and their cross-field checks. model.family and
// model.flavor are only typed here: the model-family registry
// (model/family.h) checks their values and the model keys' cross-field
// rules when a command loads the config.
#include "config/config.h"
#include "config/schema_parts.h"
#include "core/check.h"

namespace viaduct {
namespace {
using T = ConfigType;
ConfigKey key(const char* s, const char* n, T t, ConfigValue d, const char* h) {
  return ConfigKey{s, n, t, std::move(d), h};
}
const ConfigValue kUnset{};
}  // namespace

void add_core_keys(std::vector<ConfigKey>& k) {
  k.push_back(key("job", "dump_folder", T::kString, std::string("./outputs"), "folder for metrics.jsonl and checkpoints"));
  k.push_back(key("job", "description", T::kString, std::string(""), "free text"));
  k.push_back(key("job", "log_level", T::kString, std::string("info"), "debug | info | warning | error"));

  k.push_back(key("training", "steps", T::kInt, int64_t{200}, "optimizer steps").in(greater_than(0)));
  k.push_back(key("training", "seed", T::kInt, int64_t{42}, "seed of weights and data order"));
  k.push_back(key("training", "local_batch_size", T::kInt, int64_t{8}, "sequences per data-parallel rank per step").in(greater_than(0)));
  k.push_back(key("training", "seq_len", T::kInt, int64_t{128}, "tokens per sequence").in(greater_than(0)));
  k.push_back(key("training", "gradient_accumulation_steps", T::kInt, int64_t{1}, "batches accumulated per optimizer step").in(greater_than(0)));
  k.push_back(key("training", "max_norm", T::kFloat, 1.0, "global gradient-norm clip (<= 0: off)"));
  k.push_back(key("training", "dtype", T::kString, std::string("auto"), "auto | float32 | bfloat16 (bf16 = mixed precision with fp32 master weights)"));
  k.push_back(key("training", "device", T::kString, std::string("auto"), "auto | cpu | cuda"));
  k.push_back(key("training", "deterministic", T::kBool, true, "deterministic kernels on CUDA (bitwise-reproducible runs and layouts; off can be faster)"));
  k.push_back(key("training", "cuda_graphs", T::kBool, kUnset, "replay the step's forward, backward and gradient clip as one CUDA graph, captured after two eager steps, with the same bits as eager steps and without their per-kernel launches; unset: on where the run allows it (one process on one GPU, fixed shapes: no pipeline stages, data parallelism, block_causal documents or images; AdamW and the clip on the device; no metrics.profile_step), eager elsewhere; true: on, refused where it cannot run; false: eager"));
  k.push_back(key("training", "num_threads", T::kInt, int64_t{2}, "CPU intra-op threads (same default launched or alone)").in(greater_than(0)));
  k.push_back(key("training", "eval_interval", T::kInt, int64_t{50}, "evaluate on held-out tokens every N steps (0: never); step 0 included").in(at_least(0)));

  k.push_back(key("optimizer", "name", T::kString, std::string("AdamW"), "AdamW | SGD"));
  k.push_back(key("optimizer", "lr", T::kFloat, 8e-4, "peak learning rate").in(at_least(0)));
  k.push_back(key("optimizer", "beta1", T::kFloat, 0.9, "AdamW beta1").in(between(0, 1, /*hi_open=*/true)));
  k.push_back(key("optimizer", "beta2", T::kFloat, 0.95, "AdamW beta2").in(between(0, 1, /*hi_open=*/true)));
  k.push_back(key("optimizer", "eps", T::kFloat, 1e-8, "AdamW epsilon").in(greater_than(0)));
  k.push_back(key("optimizer", "weight_decay", T::kFloat, 0.1, "decoupled weight decay (not on norms, biases, embeddings)").in(at_least(0)));

  k.push_back(key("lr_scheduler", "warmup_steps", T::kInt, int64_t{20}, "linear warmup steps").in(at_least(0)));
  k.push_back(key("lr_scheduler", "decay_type", T::kString, std::string("cosine"), "cosine | linear | constant"));
  k.push_back(key("lr_scheduler", "min_lr_factor", T::kFloat, 0.1, "final lr as a fraction of the peak").in(between(0, 1)));

  k.push_back(key("checkpoint", "enable", T::kBool, false, "save checkpoints"));
  k.push_back(key("checkpoint", "folder", T::kString, std::string("checkpoint"), "relative to job.dump_folder unless absolute"));
  k.push_back(key("checkpoint", "interval", T::kInt, int64_t{100}, "save every N steps (and at the last step)").in(greater_than(0)));
  k.push_back(key("checkpoint", "keep_latest_k", T::kInt, int64_t{3}, "keep the newest k checkpoints (0: all)").in(at_least(0)));
  k.push_back(key("checkpoint", "resume", T::kBool, true, "resume from the latest checkpoint in the folder; false starts a fresh run, refused where job.dump_folder already holds a run (see move_old_run_aside)"));
  k.push_back(key("checkpoint", "move_old_run_aside", T::kBool, false, "with resume = false on a job.dump_folder that holds a run (metrics, checkpoints): move that run's files into <dump_folder>/old-run-<UTC time>/ (and an outside checkpoint.folder's into <folder>/old-run-<UTC time>/) before starting; false refuses"));
  k.push_back(key("checkpoint", "resume_with_new_optimizer", T::kBool, false, "resume a checkpoint saved under another optimizer.name: the weights, step and data cursor load and the new optimizer starts fresh, its saved state dropped with a warning; false refuses"));
  k.push_back(key("checkpoint", "save_initial", T::kBool, false, "also save the initial weights as step-0"));
  k.push_back(key("checkpoint", "save_final", T::kBool, true, "save at the last step even off the interval"));
  k.push_back(key("checkpoint", "async_mode", T::kString, std::string("disabled"), "disabled | async: copy the state to host memory at the step and write it from a background thread while training goes on"));
  k.push_back(key("checkpoint", "initial_load_path", T::kString, std::string(""), "warm start: a viaduct checkpoint (a step-N folder or a checkpoint folder: its latest) or a Hugging Face model folder, loaded when the checkpoint folder has none of its own"));
  k.push_back(key("checkpoint", "initial_load_in_hf", T::kBool, false, "read initial_load_path as a Hugging Face model folder (found by its config.json without this)"));
  k.push_back(key("checkpoint", "initial_load_model_only", T::kBool, true, "warm start with the weights only: step 0, a fresh optimizer and data cursor; false: the whole training state but exclude_from_loading"));
  k.push_back(key("checkpoint", "exclude_from_loading", T::kStringList, StringList{}, "what a full-state warm start leaves fresh: any of optimizer, data, step"));
  k.push_back(key("checkpoint", "last_save_in_hf", T::kBool, false, "at the end of training also write the final weights as a Hugging Face model folder, <checkpoint.folder>/hf-step-<N>"));

  k.push_back(key("metrics", "log_freq", T::kInt, int64_t{1}, "log every N steps").in(greater_than(0)));
  k.push_back(key("metrics", "enable_jsonl", T::kBool, true, "append a JSON object per step to <dump_folder>/metrics.jsonl"));
  k.push_back(key("metrics", "progress_bar", T::kBool, true, "draw a progress bar when stdout is a terminal"));
  k.push_back(key("metrics", "pipeline_timing", T::kBool, true, "time each rank's pipeline compute actions and P2P waits: pipeline_* and bubble_measured* per step in metrics.jsonl (CUDA: timing events, no extra sync)"));
  k.push_back(key("metrics", "profile_step", T::kInt, int64_t{0}, "profile this step (1-based; 0: off) into <dump_folder>/profile/").in(at_least(0)));
  k.push_back(key("metrics", "profile_host_ops", T::kBool, true, "the profile records every host op (which op launched each kernel); false: device kernels only (needs training.device = cuda): no attribution, but no host cost per op either, so the idle gaps come closer to an unprofiled step's"));
  k.push_back(key("metrics", "loss_spike_factor", T::kFloat, 1.35, "the run report marks a loss spike where a step's loss is above this factor times its running mean (decay 0.9) and counts them in its summary").in(greater_than(1)));
  // See Note [Activation checkpointing] (ops/recompute.h); torchtitan's keys.
  k.push_back(key("activation_checkpoint", "mode", T::kString, std::string("none"), "none | full | selective: recompute a layer's forward in its backward instead of keeping its activations (full: every transformer layer; selective: every selective_ac_option-th, or with \"op\" every layer keeping its matmul outputs); same bits as none"));
  k.push_back(key("activation_checkpoint", "selective_ac_option", T::kString, std::string("2"), "selective mode: N (a positive integer) checkpoints every N-th layer, counted by global layer id (layers N-1, 2N-1, ...); \"op\" (torchtitan's per-op policy) checkpoints every layer but keeps the outputs of its linear projections, MoE expert GEMMs, KDA's chunk scan and (where flash runs) attention's core, so the backward recomputes only the cheap ops (norms, activations, rope, residual adds); same bits as none"));
  (void)kUnset;
}

void add_model_keys(std::vector<ConfigKey>& k) {
  k.push_back(key("model", "family", T::kString, std::string("llama"), "llama | gpt2 | kimi_k3 | exact16 (docs/models.md)"));
  k.push_back(key("model", "flavor", T::kString, std::string("debugmodel"), "size preset of the family (every family has debugmodel)"));
  k.push_back(key("model", "n_layers", T::kInt, kUnset, "transformer layers (flavor default)").in(greater_than(0)));
  k.push_back(key("model", "dim", T::kInt, kUnset, "model width (flavor default)").in(greater_than(0)));
  k.push_back(key("model", "n_heads", T::kInt, kUnset, "attention heads (flavor default)").in(greater_than(0)));
  k.push_back(key("model", "n_kv_heads", T::kInt, kUnset, "key/value heads for GQA (flavor default)").in(greater_than(0)));
  k.push_back(key("model", "vocab_size", T::kInt, kUnset, "vocabulary (flavor default)").in(greater_than(0)));
  k.push_back(key("model", "ffn_hidden_dim", T::kInt, kUnset, "FFN hidden width (flavor default)").in(greater_than(0)));
  k.push_back(key("model", "max_seq_len", T::kInt, kUnset, "longest sequence (RoPE table / learned positions)").in(greater_than(0)));
  k.push_back(key("model", "norm_eps", T::kFloat, kUnset, "norm epsilon (flavor default)").in(greater_than(0)));
  k.push_back(key("model", "rope_theta", T::kFloat, kUnset, "RoPE base (flavor default)").in(greater_than(0)));
  k.push_back(key("model", "rope_scaling_factor", T::kFloat, 0.0, "llama: llama-3.1/3.2 RoPE frequency scaling factor (HF rope_scaling of type llama3; 8 for 3.1, 32 for 3.2); 0: none").in(at_least(0)));
  k.push_back(key("model", "rope_scaling_low_freq_factor", T::kFloat, 1.0, "llama: the scaling's low_freq_factor").in(greater_than(0)));
  k.push_back(key("model", "rope_scaling_high_freq_factor", T::kFloat, 4.0, "llama: the scaling's high_freq_factor (above low_freq_factor)").in(greater_than(0)));
  k.push_back(key("model", "rope_scaling_original_max_seq_len", T::kInt, int64_t{8192}, "llama: the scaling's original_max_position_embeddings").in(greater_than(0)));
  k.push_back(key("model", "cuda_kernels", T::kBool, true, "use viaduct's CUDA kernels (RMSNorm, RoPE, SwiGLU, the chunked loss) where the GPU has them; false: ATen ops only"));
  k.push_back(key("model", "swiglu_recompute", T::kBool, false, "fused SwiGLU (CUDA kernels): recompute silu(w1 x) * w3 x in the backward instead of keeping it; saves tokens x ffn_hidden_dim x 2 bytes per layer for one more elementwise pass"));
  k.push_back(key("model", "loss_chunk_tokens", T::kInt, int64_t{-1}, "> 0: fuse head and cross-entropy in chunks of this many tokens (no full logits); 0: plain; -1: auto (4096 where the fused CUDA kernels run, else plain)").in(at_least(-1)));
  k.push_back(key("model", "attn_mask_type", T::kString, std::string("causal"), "causal: every token sees the whole window before it; block_causal: documents packed into a window do not see each other (attention, KDA's state and short convolutions restart at each document start, found from the token files' document marker) and the first token of a document is not trained on the previous one's last"));
  k.push_back(key("model", "reset_position_ids", T::kBool, kUnset, "block_causal: positions (RoPE, gpt2's learned positions) restart at 0 at each document (default true); false: positions run through the window"));
  k.push_back(key("model", "tie_embeddings", T::kBool, kUnset, "share tok_embeddings and lm_head (gpt2 default true)"));
  // Kimi-K3 hybrid keys (used by family kimi_k3 only).
  k.push_back(key("model", "attn_res_block_size", T::kInt, kUnset, "AttnRes layers per block").in(greater_than(0)));
  k.push_back(key("model", "first_k_dense", T::kInt, kUnset, "leading layers with a dense FFN").in(at_least(0)));
  k.push_back(key("model", "mla_interval", T::kInt, kUnset, "kimi_k3: MLA (full attention) at every N-th layer and the last, KDA elsewhere (the flavor: 4; 1: MLA everywhere)").in(greater_than(0)));
  k.push_back(key("model", "n_routed_experts", T::kInt, kUnset, "MoE routed experts").in(greater_than(0)));
  k.push_back(key("model", "n_activated_experts", T::kInt, kUnset, "MoE experts per token (top-k)").in(greater_than(0)));
  k.push_back(key("model", "moe_hidden_dim", T::kInt, kUnset, "MoE expert hidden width").in(greater_than(0)));
  k.push_back(key("model", "moe_ffn", T::kBool, kUnset, "MoE FFN after the dense layers (false: dense SwiGLU)"));
  k.push_back(key("model", "vision", T::kBool, kUnset, "include the vision tower"));
  k.push_back(key("model", "attn_res", T::kBool, true, "kimi_k3 only: Block AttnRes reads between sublayers (false: plain residuals h = h + sublayer(h), a chain model)"));
  // Kimi-K3: KDA, MLA, MoE and the vision tower.
  k.push_back(key("model", "kda_head_dim", T::kInt, kUnset, "KDA head width (dk = dv; also the rank of its decay and gate maps)").in(greater_than(0)));
  k.push_back(key("model", "kda_chunk_size", T::kInt, kUnset, "KDA chunk length of the chunked form").in(greater_than(0)));
  k.push_back(key("model", "kda_conv_size", T::kInt, kUnset, "KDA short causal convolution kernel").in(greater_than(0)));
  k.push_back(key("model", "mla_q_lora_rank", T::kInt, kUnset, "MLA query compression rank (0: full-rank query)").in(at_least(0)));
  k.push_back(key("model", "mla_kv_lora_rank", T::kInt, kUnset, "MLA joint key/value compression rank").in(greater_than(0)));
  k.push_back(key("model", "mla_qk_nope_head_dim", T::kInt, kUnset, "MLA per-head query/key width without rotary").in(at_least(0)));
  k.push_back(key("model", "mla_qk_rope_head_dim", T::kInt, kUnset, "MLA per-head decoupled rotary width (shared key)").in(at_least(0)));
  k.push_back(key("model", "mla_v_head_dim", T::kInt, kUnset, "MLA per-head value width").in(greater_than(0)));
  k.push_back(key("model", "mla_rope", T::kBool, kUnset, "rotate MLA's rotary channels (false: NoPE, as Kimi Linear)"));
  k.push_back(key("model", "n_shared_experts", T::kInt, kUnset, "MoE shared experts (each moe_hidden_dim wide)").in(at_least(0)));
  k.push_back(key("model", "moe_route_scale", T::kFloat, kUnset, "MoE routed output scale (routed_scaling_factor)").in(greater_than(0)));
  k.push_back(key("model", "moe_bias_update_rate", T::kFloat, kUnset, "MoE balancing bias step per optimizer step (0: frozen)").in(at_least(0)));
  k.push_back(key("model", "moe_capacity_factor", T::kFloat, 0.0, "MoE: each expert takes at most ceil(factor x tokens x top-k / experts) copies of a micro-batch's tokens, the rest dropped in token order and counted (moe_dropped_tokens); 0: dropless").in(at_least(0)));
  k.push_back(key("model", "vision_image_size", T::kInt, kUnset, "vision tower image side in pixels").in(greater_than(0)));
  k.push_back(key("model", "vision_patch_size", T::kInt, kUnset, "vision tower patch side in pixels").in(greater_than(0)));
  k.push_back(key("model", "vision_dim", T::kInt, kUnset, "vision tower width").in(greater_than(0)));
  k.push_back(key("model", "image_token_id", T::kInt, kUnset, "placeholder token id of an image patch (default vocab_size - 1)").in(at_least(0)));
  k.push_back(key("model", "synthetic_images", T::kBool, kUnset, "demo: feed one synthetic image per sequence over its first patches"));
}

void validate_core(const Config& c) {
  // Numeric ranges are the schema's (ConfigKey::range), checked before this.
  const auto dtype = c.get_string("training.dtype");
  VIADUCT_CHECK_T(ConfigError,
                  dtype == "auto" || dtype == "float32" || dtype == "bfloat16",
                  "training.dtype must be auto, float32 or bfloat16, got '",
                  dtype, "'");
  const auto device = c.get_string("training.device");
  VIADUCT_CHECK_T(ConfigError,
                  device == "auto" || device == "cpu" || device == "cuda",
                  "training.device must be auto, cpu or cuda, got '", device, "'");
  const auto opt = c.get_string("optimizer.name");
  VIADUCT_CHECK_T(ConfigError, opt == "AdamW" || opt == "SGD",
                  "optimizer.name must be AdamW or SGD, got '", opt, "'");
  const auto decay = c.get_string("lr_scheduler.decay_type");
  VIADUCT_CHECK_T(ConfigError,
                  decay == "cosine" || decay == "linear" || decay == "constant",
                  "lr_scheduler.decay_type must be cosine, linear or constant, got '",
                  decay, "'");
  const auto async_mode = c.get_string("checkpoint.async_mode");
  VIADUCT_CHECK_T(ConfigError, async_mode == "disabled" || async_mode == "async",
                  "checkpoint.async_mode must be disabled or async, got '", async_mode,
                  "' (from ", c.source("checkpoint.async_mode"), ")");
  for (const auto& item : c.get_string_list("checkpoint.exclude_from_loading")) {
    VIADUCT_CHECK_T(ConfigError, item == "optimizer" || item == "data" || item == "step",
                    "checkpoint.exclude_from_loading: '", item,
                    "' is none of optimizer, data, step (from ",
                    c.source("checkpoint.exclude_from_loading"), ")");
  }
  const auto ac_mode = c.get_string("activation_checkpoint.mode");
  VIADUCT_CHECK_T(ConfigError, ac_mode == "none" || ac_mode == "full" || ac_mode == "selective",
                  "activation_checkpoint.mode must be none, full or selective, got '", ac_mode,
                  "' (from ", c.source("activation_checkpoint.mode"), ")");
  if (ac_mode == "selective") {
    const auto opt = c.get_string("activation_checkpoint.selective_ac_option");
    bool digits = !opt.empty() && opt.size() <= 9;
    for (char ch : opt) digits = digits && ch >= '0' && ch <= '9';
    VIADUCT_CHECK_T(ConfigError, opt == "op" || (digits && std::stoll(opt) > 0),
                    "activation_checkpoint.selective_ac_option must be a positive integer N "
                    "(checkpoint every N-th layer) or \"op\" (every layer, keeping the "
                    "outputs of its matmuls), got '", opt, "' (from ",
                    c.source("activation_checkpoint.selective_ac_option"), ")");
  }
  const auto mask = c.get_string("model.attn_mask_type");
  VIADUCT_CHECK_T(ConfigError, mask == "causal" || mask == "block_causal",
                  "model.attn_mask_type must be causal or block_causal, got '", mask, "' (from ",
                  c.source("model.attn_mask_type"), ")");
  VIADUCT_CHECK_T(ConfigError,
                  mask == "block_causal" || !c.get_bool_opt("model.reset_position_ids").value_or(false),
                  "model.reset_position_ids = true needs model.attn_mask_type = \"block_causal\" "
                  "(positions restart at documents only when documents are kept apart; from ",
                  c.source("model.reset_position_ids"), ")");
  if (c.get_bool_opt("training.cuda_graphs").value_or(false)) {
    // See Note [The step as one CUDA graph] (train/step_graph.h): one
    // process, one stage, the same shapes every step.
    auto refuse = [&](bool bad, const std::string& what) {
      VIADUCT_CHECK_T(ConfigError, !bad, "training.cuda_graphs = true (from ",
                      c.source("training.cuda_graphs"), ") ", what,
                      "; set training.cuda_graphs = false");
    };
    refuse(c.get_string("training.device") == "cpu", "needs a CUDA device, but training.device = \"cpu\"");
    refuse(c.get_int("parallelism.pipeline_parallel_degree") > 1,
           "runs one process: parallelism.pipeline_parallel_degree must be 1");
    refuse(c.get_int("parallelism.data_parallel_degree") > 1,
           "runs one process: parallelism.data_parallel_degree must be 1");
    refuse(mask == "block_causal",
           "needs the same shapes every step, but model.attn_mask_type = \"block_causal\" "
           "sizes each step's attention and KDA work by its documents");
  }
  const auto lvl = c.get_string("job.log_level");
  VIADUCT_CHECK_T(ConfigError,
                  lvl == "debug" || lvl == "info" || lvl == "warning" || lvl == "error",
                  "job.log_level must be debug, info, warning or error");
}

}  // namespace viaduct
