// What the chain families' Hugging Face adapters share (see hf_adapter.h):
// the rotary row permutation, tensor and config.json lookups, and the
// model_type check against the registry.
#include "model/hf_adapter.h"

#include <vector>

#include "model/family.h"

namespace viaduct {

using json = nlohmann::json;

at::Tensor interleaved_to_half_rows(const at::Tensor& w, int64_t n_heads) {
  const int64_t rows = w.size(0);
  const int64_t hd = rows / n_heads;
  auto rest = w.sizes().slice(1).vec();
  std::vector<int64_t> view{n_heads, hd / 2, 2};
  view.insert(view.end(), rest.begin(), rest.end());
  return w.reshape(view).transpose(1, 2).reshape(w.sizes()).contiguous();
}

at::Tensor half_to_interleaved_rows(const at::Tensor& w, int64_t n_heads) {
  const int64_t rows = w.size(0);
  const int64_t hd = rows / n_heads;
  auto rest = w.sizes().slice(1).vec();
  std::vector<int64_t> view{n_heads, 2, hd / 2};
  view.insert(view.end(), rest.begin(), rest.end());
  return w.reshape(view).transpose(1, 2).reshape(w.sizes()).contiguous();
}

namespace hf {

std::string layer(int64_t i) {
  return "layers." + std::to_string(i) + ".";
}

const at::Tensor& need(const TensorMap& m, const std::string& name,
                       const std::string& source) {
  auto it = m.find(name);
  VIADUCT_CHECK_T(FileError, it != m.end(), source, ": tensor '", name,
                  "' is missing");
  return it->second;
}

void expect_shape(const at::Tensor& t, const std::vector<int64_t>& shape,
                  const std::string& name, const std::string& source) {
  VIADUCT_CHECK_T(FileError, t.sizes().vec() == shape, source, ": tensor '",
                  name, "' has shape ", t.sizes(), ", expected ",
                  at::IntArrayRef(shape));
}

at::Tensor cpu(const at::Tensor& t) {
  return t.detach().to(at::kCPU).contiguous();
}

Taker::Taker(const TensorMap& tensors, std::string source)
    : tensors_(tensors), source_(std::move(source)) {}

at::Tensor Taker::operator()(const std::string& name, const std::vector<int64_t>& shape) {
  const at::Tensor& t = need(tensors_, name, source_);
  expect_shape(t, shape, name, source_);
  taken_.insert(name);
  return t.to(at::kFloat).contiguous();
}

void Taker::take_tied_head(const std::string& head, const at::Tensor& embedding,
                           const std::string& embedding_name) {
  if (!has(head)) return;
  const auto& t = need(tensors_, head, source_);
  taken_.insert(head);
  // The HF head may have fewer rows than viaduct's padded embedding.
  const bool same = t.dim() == 2 && t.size(0) <= embedding.size(0) &&
                    t.to(at::kFloat).equal(embedding.narrow(0, 0, t.size(0)));
  VIADUCT_CHECK_T(FileError, same, source_, ": ", head, " differs from ", embedding_name,
                  ", but model.tie_embeddings = true ties them");
}

void Taker::expect_all_taken(const std::function<bool(const std::string&)>& ignorable) const {
  std::vector<std::string> left;
  for (const auto& [name, t] : tensors_) {
    if (!taken_.count(name) && !(ignorable && ignorable(name))) left.push_back(name);
  }
  if (left.empty()) return;
  std::string listed;
  for (size_t i = 0; i < left.size() && i < 5; ++i) listed += (i ? ", " : "") + left[i];
  if (left.size() > 5) listed += ", ...";
  VIADUCT_CHECK_T(FileError, false, source_, ": ", left.size(),
                  " tensor(s) that this model does not have (", listed,
                  "): a checkpoint of another size or architecture?");
}

int64_t get_int(const json& c, const std::string& key,
                const std::string& source) {
  VIADUCT_CHECK_T(ConfigError, c.contains(key) && c[key].is_number_integer(),
                  source, ": config.json has no integer '", key, "'");
  return c[key].get<int64_t>();
}

double get_number(const json& c, const std::string& key, double fallback) {
  return c.contains(key) && c[key].is_number() ? c[key].get<double>()
                                               : fallback;
}

void check_model_type(const json& c, const std::string& model_type,
                      const std::string& family, const std::string& folder) {
  const std::string source = folder + "/config.json";
  VIADUCT_CHECK_T(ConfigError, c.is_object(), source,
                  ": config.json is not an object");
  const std::string type = c.value("model_type", std::string());
  if (type == model_type) return;
  std::string known;
  bool read_by_a_family = false;
  for (const auto& f : model_families()) {
    if (f.hf_model_type.empty()) continue;
    known += str(known.empty() ? "" : ", ", f.hf_model_type);
    read_by_a_family = read_by_a_family || f.hf_model_type == type;
  }
  if (read_by_a_family)
    differ(folder, "model_type", type, "model.family", family);
  throw ConfigError(
      str(source, ": model_type '", type, "' is not supported (", known, ")"));
}

std::string override_of(const std::string& key, const json& value) {
  return key + "=" + value.dump();
}

std::vector<std::string> chain_overrides(const std::string& family, const ChainSpec& h) {
  return {override_of("model.family", family),
          override_of("model.n_layers", h.n_layers),
          override_of("model.dim", h.dim),
          override_of("model.n_heads", h.n_heads),
          override_of("model.n_kv_heads", h.n_kv_heads),
          override_of("model.vocab_size", h.vocab_size),
          override_of("model.ffn_hidden_dim", h.ffn_hidden),
          override_of("model.max_seq_len", h.max_seq_len),
          override_of("model.norm_eps", h.norm_eps),
          override_of("model.tie_embeddings", h.tie_embeddings)};
}

void check_chain_fields(const std::string& folder, const ChainFieldNames& names,
                        const ChainSpec& h, const ChainSpec& v) {
  if (h.n_layers != v.n_layers)
    differ(folder, names.n_layers, h.n_layers, "model.n_layers", v.n_layers);
  if (h.dim != v.dim) differ(folder, names.dim, h.dim, "model.dim", v.dim);
  if (h.n_heads != v.n_heads) differ(folder, names.n_heads, h.n_heads, "model.n_heads", v.n_heads);
  if (h.n_kv_heads != v.n_kv_heads)
    differ(folder, names.n_kv_heads, h.n_kv_heads, "model.n_kv_heads", v.n_kv_heads);
  if (h.ffn_hidden != v.ffn_hidden)
    differ(folder, names.ffn_hidden, h.ffn_hidden, "model.ffn_hidden_dim", v.ffn_hidden);
  if (h.vocab_size > v.vocab_size)
    differ(folder, names.vocab_size, h.vocab_size, "model.vocab_size (at least as large)",
           v.vocab_size);
  if (!names.max_seq_len.empty() && h.max_seq_len != v.max_seq_len)
    differ(folder, names.max_seq_len, h.max_seq_len, "model.max_seq_len", v.max_seq_len);
  if (h.norm_eps != v.norm_eps)
    differ(folder, names.norm_eps, h.norm_eps, "model.norm_eps", v.norm_eps);
  if (h.tie_embeddings != v.tie_embeddings)
    differ(folder, "tie_word_embeddings", h.tie_embeddings, "model.tie_embeddings",
           v.tie_embeddings);
}

at::Tensor padded_embedding(Taker& take, const std::string& name, int64_t hf_vocab,
                            int64_t vocab, int64_t dim) {
  at::Tensor e = take(name, {hf_vocab, dim});
  if (hf_vocab == vocab) return e;
  at::Tensor padded = at::zeros({vocab, dim}, e.options());
  padded.narrow(0, 0, hf_vocab).copy_(e);
  return padded;
}

void take_head(Taker& take, TensorMap& v, bool tied, const std::string& head,
               const std::string& embedding_name, int64_t hf_vocab, int64_t vocab,
               int64_t dim) {
  const at::Tensor& embedding = v.at("tok_embeddings.weight");
  if (tied) {
    take.take_tied_head(head, embedding, embedding_name);
    return;
  }
  // A tied HF checkpoint loaded untied starts its head from the embedding.
  v["lm_head.weight"] = take.has(head) ? padded_embedding(take, head, hf_vocab, vocab, dim)
                                       : embedding.clone();
}

}  // namespace hf
}  // namespace viaduct
