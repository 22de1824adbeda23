// The main job's GPT-style decoder (integrations/torch/python/tiermem/examples/gpt.py) in
// LibTorch: pre-norm blocks with causal self-attention and a GELU MLP, tied embeddings
// (the head's weight is the token embedding's), GPT-2 initialisation (std 0.02), and optional
// residual dropout (GPT-2's resid_pdrop: after the attention projection and the MLP; 0 by
// default, which draws nothing from the generator). The model
// is split into units for tiermem::torch::ChunkedModel::Run: `embed`, each of `blocks`, `head`.
// Header-only so the example and its test share one definition. It lives outside namespace
// tiermem: inside it, `torch::` would name tiermem::torch (TORCH_MODULE spells it unqualified).
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "integrations/torch/cpp/chunked_model.h"

namespace tiermem_example {

struct GPTConfig {
  int64_t vocab_size = 256;  // bytes
  int64_t block_size = 64;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 256;
  double dropout = 0.0;  // residual dropout probability (training mode only)
};

inline void InitLinear(::torch::nn::Linear& l) {
  ::torch::NoGradGuard g;
  ::torch::nn::init::normal_(l->weight, 0.0, 0.02);
  if (l->bias.defined()) ::torch::nn::init::zeros_(l->bias);
}

struct CausalSelfAttentionImpl : ::torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GPTConfig& c)
      : qkv(register_module("qkv", ::torch::nn::Linear(c.n_embd, 3 * c.n_embd))),
        proj(register_module("proj", ::torch::nn::Linear(c.n_embd, c.n_embd))),
        n_head(c.n_head) {
    InitLinear(qkv);
    InitLinear(proj);
  }
  ::torch::Tensor forward(const ::torch::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / n_head;
    auto parts = qkv(x).split(d, 2);
    auto q = parts[0].view({b, t, n_head, hd}).transpose(1, 2);
    auto k = parts[1].view({b, t, n_head, hd}).transpose(1, 2);
    auto v = parts[2].view({b, t, n_head, hd}).transpose(1, 2);
    auto att = ::torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
    auto mask = ::torch::ones({t, t}, ::torch::TensorOptions().dtype(::torch::kBool)).tril();
    att = att.masked_fill(mask.logical_not(), -INFINITY).softmax(-1);
    auto y = ::torch::matmul(att, v).transpose(1, 2).contiguous().view({b, t, d});
    return proj(y);
  }
  ::torch::nn::Linear qkv, proj;
  int64_t n_head;
};
TORCH_MODULE(CausalSelfAttention);

struct BlockImpl : ::torch::nn::Module {
  explicit BlockImpl(const GPTConfig& c)
      : ln1(register_module("ln1",
                            ::torch::nn::LayerNorm(::torch::nn::LayerNormOptions({c.n_embd})))),
        attn(register_module("attn", CausalSelfAttention(c))),
        ln2(register_module("ln2",
                            ::torch::nn::LayerNorm(::torch::nn::LayerNormOptions({c.n_embd})))),
        fc(register_module("fc", ::torch::nn::Linear(c.n_embd, 4 * c.n_embd))),
        out(register_module("out", ::torch::nn::Linear(4 * c.n_embd, c.n_embd))),
        dropout(c.dropout) {
    InitLinear(fc);
    InitLinear(out);
  }
  ::torch::Tensor forward(::torch::Tensor x) {
    x = x + ::torch::dropout(attn(ln1(x)), dropout, is_training());
    return x + ::torch::dropout(out(::torch::gelu(fc(ln2(x)))), dropout, is_training());
  }
  ::torch::nn::LayerNorm ln1;
  CausalSelfAttention attn;
  ::torch::nn::LayerNorm ln2;
  ::torch::nn::Linear fc, out;
  double dropout;
};
TORCH_MODULE(Block);

struct EmbedImpl : ::torch::nn::Module {
  explicit EmbedImpl(const GPTConfig& c)
      : wte(register_module("wte", ::torch::nn::Embedding(c.vocab_size, c.n_embd))),
        wpe(register_module("wpe", ::torch::nn::Embedding(c.block_size, c.n_embd))) {
    ::torch::NoGradGuard g;
    ::torch::nn::init::normal_(wte->weight, 0.0, 0.02);
    ::torch::nn::init::normal_(wpe->weight, 0.0, 0.02);
  }
  ::torch::Tensor forward(const ::torch::Tensor& idx) {
    auto pos = ::torch::arange(idx.size(1), ::torch::TensorOptions().dtype(::torch::kLong));
    return wte(idx) + wpe(pos);
  }
  ::torch::nn::Embedding wte, wpe;
};
TORCH_MODULE(Embed);

// Final LayerNorm and the LM head, whose weight is the token embedding (tied).
struct HeadImpl : ::torch::nn::Module {
  HeadImpl(const GPTConfig& c, const ::torch::Tensor& tied)
      : ln_f(register_module("ln_f",
                             ::torch::nn::LayerNorm(::torch::nn::LayerNormOptions({c.n_embd})))),
        weight(register_parameter("weight", tied)) {}
  ::torch::Tensor forward(const ::torch::Tensor& x) {
    return ::torch::nn::functional::linear(ln_f(x), weight);
  }
  ::torch::nn::LayerNorm ln_f;
  ::torch::Tensor weight;
};
TORCH_MODULE(Head);

struct GPTImpl : ::torch::nn::Module {
  explicit GPTImpl(const GPTConfig& c) : config(c) {
    embed = register_module("embed", Embed(c));
    for (int64_t i = 0; i < c.n_layer; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), Block(c)));
    }
    head = register_module("head", Head(c, embed->wte->weight));
  }
  // Plain LibTorch forward: logits [b, t, vocab].
  ::torch::Tensor forward(const ::torch::Tensor& idx) {
    auto x = embed(idx);
    for (auto& b : blocks) x = b(x);
    return head(x);
  }
  // The same forward through tiermem, one unit per submodule.
  tiermem::StatusOr<::torch::Tensor> forward(tiermem::torch::ChunkedModel& engine,
                                             const ::torch::Tensor& idx) {
    TIERMEM_ASSIGN_OR_RETURN(::torch::Tensor x,
                             engine.Run(*embed, [&](const auto&) { return embed(idx); }));
    for (auto& b : blocks) {
      TIERMEM_ASSIGN_OR_RETURN(x, engine.Run(*b, [&](const auto& in) { return b(in[0]); }, {x}));
    }
    return engine.Run(*head, [&](const auto& in) { return head(in[0]); }, {x});
  }
  GPTConfig config;
  Embed embed{nullptr};
  std::vector<Block> blocks;
  Head head{nullptr};
};
TORCH_MODULE(GPT);

inline ::torch::Tensor LmLoss(const ::torch::Tensor& logits, const ::torch::Tensor& targets) {
  return ::torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}),
                                                targets.view({-1}));
}

// Deterministic byte-level text: a corpus of 200 pseudo-random words repeated in a random
// order (learnable), then `steps` batches of (input, target) windows, like gpt.py's.
inline std::vector<std::pair<::torch::Tensor, ::torch::Tensor>> SyntheticBatches(
    const GPTConfig& c, int64_t batch, int steps, uint64_t seed = 0) {
  auto g = ::at::make_generator<::at::CPUGeneratorImpl>(seed);
  std::vector<std::vector<int64_t>> words;
  auto lens = ::torch::randint(2, 8, {200}, g);
  for (int64_t i = 0; i < 200; ++i) {
    auto w = ::torch::randint(97, 123, {lens[i].item<int64_t>()}, g);
    words.emplace_back(w.data_ptr<int64_t>(), w.data_ptr<int64_t>() + w.numel());
  }
  auto order = ::torch::randint(0, 200, {20000}, g);
  std::vector<int64_t> text;
  for (int64_t i = 0; i < order.numel(); ++i) {
    if (i) text.push_back(' ');
    const auto& w = words[order[i].item<int64_t>()];
    text.insert(text.end(), w.begin(), w.end());
  }
  auto corpus = ::torch::tensor(text, ::torch::kLong);
  std::vector<std::pair<::torch::Tensor, ::torch::Tensor>> out;
  for (int s = 0; s < steps; ++s) {
    auto starts = ::torch::randint(0, corpus.numel() - c.block_size - 1, {batch}, g);
    std::vector<::torch::Tensor> xs, ys;
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t st = starts[i].item<int64_t>();
      xs.push_back(corpus.narrow(0, st, c.block_size));
      ys.push_back(corpus.narrow(0, st + 1, c.block_size));
    }
    out.emplace_back(::torch::stack(xs), ::torch::stack(ys));
  }
  return out;
}

}  // namespace tiermem_example
