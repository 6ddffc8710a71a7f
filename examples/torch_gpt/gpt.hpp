// examples/torch_gpt/gpt.hpp: a small character-level GPT written with libtorch,
// and the learner that trains it (the ClusterTrainer of <ddiloco/local_cluster.hpp>).
//
// What it is: a decoder-only transformer (Radford et al. 2019, pre-LayerNorm):
// token + position embeddings, `layers` blocks of causal multi-head
// self-attention and a GELU MLP (4x wide), a final LayerNorm and an untied
// output head; trained with AdamW on next-character prediction over the
// fortunes corpus (<ddiloco/reference/data.hpp>). The defaults (d = 128, 4
// blocks, 4 heads, context 64, 97 symbols) give 0.82 M parameters.
// What it is not: a fast or general GPT (no KV cache, no dropout, no sampling):
// it exists to show ddiloco's OuterLoop inside an ordinary libtorch trainer.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <ddiloco/adapters/torch.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/reference/data.hpp>

namespace torch_gpt {

namespace ref = ddiloco::reference;

struct GptConfig {
  std::int64_t vocab = static_cast<std::int64_t>(ref::CharVocab::kSize);
  std::int64_t context = 64;  ///< T: tokens per sequence
  std::int64_t width = 128;   ///< d_model
  std::int64_t heads = 4;
  std::int64_t layers = 4;
};

/// Causal self-attention: softmax(Q K^T / sqrt(d_head) + mask) V per head.
struct AttentionImpl : torch::nn::Module {
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  torch::Tensor future;  ///< buffer, bool [T, T], true strictly above the diagonal (built once)
  std::int64_t heads;

  explicit AttentionImpl(const GptConfig& c) : heads(c.heads) {
    qkv = register_module("qkv", torch::nn::Linear(c.width, 3 * c.width));
    proj = register_module("proj", torch::nn::Linear(c.width, c.width));
    future = register_buffer("future", torch::triu(torch::ones({c.context, c.context}, torch::kBool), 1));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads;
    auto parts = qkv->forward(x).chunk(3, -1);
    auto split = [&](const torch::Tensor& y) { return y.view({b, t, heads, hd}).transpose(1, 2); };
    const auto q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
    // (Q / sqrt(d_head)) K^T: the scale on the [T, d_head] operand instead of the [T, T] scores,
    // and the precomputed mask filled in place (the scores are not needed by autograd).
    auto att = torch::matmul(q * (1.0 / std::sqrt(static_cast<double>(hd))), k.transpose(-2, -1));
    att.masked_fill_(future.slice(0, 0, t).slice(1, 0, t), -std::numeric_limits<float>::infinity());
    att = torch::softmax(att, -1);
    const auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({b, t, d});
    return proj->forward(y);
  }
};
TORCH_MODULE(Attention);

struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  Attention attn{nullptr};
  torch::nn::Linear fc{nullptr}, out{nullptr};

  explicit BlockImpl(const GptConfig& c) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    attn = register_module("attn", Attention(c));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    fc = register_module("fc", torch::nn::Linear(c.width, 4 * c.width));
    out = register_module("out", torch::nn::Linear(4 * c.width, c.width));
  }

  torch::Tensor forward(torch::Tensor x) {
    x = x + attn->forward(ln1->forward(x));
    return x + out->forward(torch::gelu(fc->forward(ln2->forward(x))));
  }
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptConfig config;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};

  explicit GptImpl(const GptConfig& c) : config(c) {
    tok = register_module("tok_emb", torch::nn::Embedding(c.vocab, c.width));
    pos = register_module("pos_emb", torch::nn::Embedding(c.context, c.width));
    for (std::int64_t i = 0; i < c.layers; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), Block(c)));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.width, c.vocab).bias(false)));
    // GPT-2 initialisation: N(0, 0.02) weights, zero biases (LayerNorms keep 1 and 0).
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      if (p.key().find("ln") != std::string::npos) continue;
      if (p.key().ends_with(".bias")) {
        p.value().zero_();
      } else {
        p.value().normal_(0.0, 0.02);
      }
    }
  }

  /// Logits [B, T, vocab] for token ids [B, T].
  torch::Tensor forward(const torch::Tensor& ids) {
    const auto t = ids.size(1);
    auto x = tok->forward(ids) + pos->forward(torch::arange(t, torch::kLong)).unsqueeze(0);
    for (auto& b : blocks) x = b->forward(x);
    return head->forward(ln_f->forward(x));
  }

  /// The tensor list for make_plan, in parameters() order: token and position
  /// embeddings and the output head (the unembedding) are marked `embedding`,
  /// so the merge averages them plainly (docs/algorithm.md, "Radial-Directional Averaging").
  std::vector<ddiloco::TensorSpec> tensor_specs() {
    std::vector<ddiloco::TensorSpec> specs;
    for (const auto& p : named_parameters()) {
      const std::string& n = p.key();
      const bool embedding = n.starts_with("tok_emb.") || n.starts_with("pos_emb.") || n.starts_with("head.");
      specs.push_back({n, static_cast<std::size_t>(p.value().numel()), embedding});
    }
    return specs;
  }
};
TORCH_MODULE(Gpt);

/// A batch of B windows of T + 1 tokens: inputs [B, T] and next-token targets [B, T].
struct SequenceBatch {
  torch::Tensor inputs, targets;
};

/// Draws windows of T + 1 consecutive tokens from one shard of a stream: the
/// reference BatchSampler with context T gives T tokens and the one after them.
class SequenceSampler {
 public:
  SequenceSampler(std::span<const ref::Token> stream, std::int64_t context, std::int64_t batch, std::uint64_t seed,
                  ref::Shard shard)
      : sampler_(stream, static_cast<std::size_t>(context), static_cast<std::size_t>(batch), seed, shard),
        context_(context),
        batch_size_(batch) {}

  SequenceBatch next() {
    sampler_.next(batch_);
    auto window = torch::empty({batch_size_, context_ + 1}, torch::kLong);
    auto* w = window.data_ptr<std::int64_t>();
    const auto t = static_cast<std::size_t>(context_);
    for (std::size_t b = 0; b < batch_.size; ++b) {
      for (std::size_t i = 0; i < t; ++i) w[b * (t + 1) + i] = batch_.contexts[b * t + i];
      w[b * (t + 1) + t] = batch_.targets[b];
    }
    return {window.slice(1, 0, context_), window.slice(1, 1, context_ + 1)};
  }

 private:
  ref::BatchSampler sampler_;
  ref::Batch batch_;
  std::int64_t context_, batch_size_;
};

/// Mean cross-entropy (nats per character) of `model` on fixed batches.
inline double evaluate(Gpt& model, const std::vector<SequenceBatch>& batches) {
  torch::NoGradGuard no_grad;
  model->eval();
  double sum = 0.0;
  for (const auto& b : batches) {
    const auto logits = model->forward(b.inputs);
    sum += torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), b.targets.reshape({-1}))
               .item<double>();
  }
  model->train();
  return batches.empty() ? 0.0 : sum / static_cast<double>(batches.size());
}

struct TrainerConfig {
  GptConfig model{};
  std::int64_t batch = 16;
  double lr = 3e-3;
  double weight_decay = 0.01;
  std::int64_t warmup = 20;  ///< linear learning-rate warm-up, inner steps
  double clip = 1.0;         ///< gradient-norm clipping
  std::uint64_t seed = 1;    ///< initial parameters (the same on every learner)
};

/// Seconds spent in each phase of inner steps (summed over the steps timed).
struct StepTimes {
  double data = 0, forward = 0, backward = 0, clip = 0, adamw = 0;
  double total() const { return data + forward + backward + clip + adamw; }
};

/// Adds the time since the previous lap to one field of a StepTimes (no-op without one).
class PhaseTimer {
 public:
  explicit PhaseTimer(StepTimes* t) : times_(t), last_(std::chrono::steady_clock::now()) {}
  void lap(double StepTimes::*field) {
    if (times_ == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    times_->*field += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  StepTimes* times_;
  std::chrono::steady_clock::time_point last_;
};

/// One learner: the model, its AdamW and its data shard. `parameters()` is the
/// model's own parameter list, handed to ddiloco without a copy.
class Learner {
 public:
  using tensor_type = torch::Tensor;

  Learner(const TrainerConfig& c, std::span<const ref::Token> train, ref::Shard shard, std::uint64_t data_seed)
      : config_(c),
        model_(seeded_model(c)),
        params_(model_->parameters()),
        adamw_(model_->parameters(), torch::optim::AdamWOptions(c.lr).betas({0.9, 0.95}).weight_decay(c.weight_decay)),
        sampler_(train, c.model.context, c.batch, data_seed, shard) {}

  /// The initial parameters are a function of the seed: the same on every learner.
  static Gpt seeded_model(const TrainerConfig& c) {
    torch::manual_seed(c.seed);
    return Gpt(c.model);
  }

  std::span<torch::Tensor> parameters() { return params_; }
  Gpt& model() { return model_; }
  double last_loss() const { return last_loss_; }

  /// One AdamW step on one batch; returns the tokens it predicted (B x T).
  /// With `times`, adds the seconds spent in each phase to it (torch_gpt --profile).
  std::int64_t inner_step(StepTimes* times = nullptr) {
    PhaseTimer timer(times);
    ++step_;
    const double scale = step_ < config_.warmup ? static_cast<double>(step_) / static_cast<double>(config_.warmup) : 1.0;
    for (auto& group : adamw_.param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(config_.lr * scale);
    const auto batch = sampler_.next();
    adamw_.zero_grad();
    timer.lap(&StepTimes::data);
    const auto logits = model_->forward(batch.inputs);
    const auto loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), batch.targets.reshape({-1}));
    timer.lap(&StepTimes::forward);
    loss.backward();
    timer.lap(&StepTimes::backward);
    (void)torch::nn::utils::clip_grad_norm_(params_, config_.clip);
    timer.lap(&StepTimes::clip);
    adamw_.step();
    last_loss_ = loss.item<double>();
    timer.lap(&StepTimes::adamw);
    return batch.inputs.numel();
  }

 private:
  TrainerConfig config_;
  Gpt model_;
  std::vector<torch::Tensor> params_;
  torch::optim::AdamW adamw_;
  SequenceSampler sampler_;
  std::int64_t step_ = 0;
  double last_loss_ = 0.0;
};

}  // namespace torch_gpt
