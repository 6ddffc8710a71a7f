// ddiloco/reference/char_lm.hpp: a small character-level language model, its AdamW inner
// optimizer and a one-learner trainer, written with Eigen.
//
// What it is: the reference model that lets tests, examples and the demo measure training quality
// (validation loss in nats per character) instead of only counting messages. An MLP language
// model in the style of Bengio et al. (2003):
//
//   x      = [E[:, t_1]; E[:, t_2]; ...; E[:, t_C]]        (concatenated embeddings, C*d)
//   h_0    = act(W_0 x + b_0)                              (act = tanh or ReLU)
//   h_l    = act(W_l h_{l-1} + b_l),  l = 1 .. L-1         (L = hidden.size(), usually 1 or 2)
//   z      = W_o h_{L-1} + b_o                             (V logits)
//   loss   = mean over the batch of -log softmax(z)[target] (cross-entropy, nats)
//
// with hand-written forward and backward passes. Parameters are a `std::vector` of Eigen
// matrices (`Params`), one contiguous column-major tensor each, in a fixed order with fixed names
// (see `BasicCharLm::specs()`), so the list can be handed to ddiloco's fragmenter and outer loop
// as it is (<ddiloco/adapters/eigen.hpp> adapts MatrixXf).
//
// Default size (V = 97, d = 24, C = 16, one hidden layer of 256): 125,817 parameters
//   embedding 24 x 97 = 2,328; hidden0.weight 256 x 384 = 98,304; hidden0.bias 256;
//   output.weight 97 x 256 = 24,832; output.bias 97.
//
// Determinism: every computation is single-threaded (Eigen uses threads only when compiled with
// OpenMP, which ddiloco's targets never enable) and seeded through ddiloco::reference::Rng, so the
// same seed gives bit-identical parameters after N steps with the same binary.
//
// What it is not: a fast or a good language model; not part of ddiloco's core (it needs Eigen);
// not thread-safe per object: a `BasicCharLm` owns its scratch buffers, so give every thread its
// own model object (they are cheap; the parameters live outside it).
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddiloco/error.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/reference/data.hpp>

namespace ddiloco::reference {

/// Hidden-layer non-linearity.
enum class Activation { tanh, relu };

/// Shape of the model.
struct CharLmConfig {
  std::size_t vocab = CharVocab::kSize;  ///< V, number of symbols
  std::size_t embed_dim = 24;            ///< d
  std::size_t context = 16;              ///< C, characters of context
  std::vector<std::size_t> hidden{256};  ///< widths of the hidden layers (at least one)
  Activation activation = Activation::tanh;
};

/// One parameter tensor: its name, its (rows x cols) shape and whether ddiloco should merge it as
/// an embedding (plain weighted average, docs/algorithm.md, "Radial-Directional Averaging"). The
/// input embedding and the output projection (the unembedding) carry the flag; hidden layers and
/// biases do not.
struct ParamSpec {
  std::string name;
  std::size_t rows = 0;
  std::size_t cols = 0;
  bool embedding = false;
  [[nodiscard]] std::size_t numel() const { return rows * cols; }
};

template <class Scalar>
using BasicMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
/// Parameters (or gradients): one contiguous column-major tensor per ParamSpec, same order.
template <class Scalar>
using BasicParams = std::vector<BasicMatrix<Scalar>>;
using Params = BasicParams<float>;

/// The model: shapes, initialisation, loss and gradient. `Scalar` is float for training; double
/// exists so that the gradient can be checked against finite differences to high precision.
template <class Scalar>
class BasicCharLm {
 public:
  using Matrix = BasicMatrix<Scalar>;
  using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
  using ParamList = BasicParams<Scalar>;

  explicit BasicCharLm(CharLmConfig config) : config_(std::move(config)) {
    if (config_.vocab < 2 || config_.vocab > 65536) {
      throw InvalidArgument(detail::msg("CharLm: vocab = ", config_.vocab, " must be in [2, 65536]"));
    }
    if (config_.embed_dim == 0) throw InvalidArgument("CharLm: embed_dim = 0; use at least 1");
    if (config_.context == 0) throw InvalidArgument("CharLm: context = 0; use at least 1");
    if (config_.hidden.empty()) {
      throw InvalidArgument("CharLm: no hidden layer; give CharLmConfig::hidden at least one width");
    }
    specs_.push_back({"embedding", config_.embed_dim, config_.vocab, true});
    std::size_t in = config_.context * config_.embed_dim;
    for (std::size_t l = 0; l < config_.hidden.size(); ++l) {
      const std::size_t h = config_.hidden[l];
      if (h == 0) throw InvalidArgument(detail::msg("CharLm: hidden[", l, "] = 0; use a width of at least 1"));
      specs_.push_back({detail::msg("hidden", l, ".weight"), h, in, false});
      specs_.push_back({detail::msg("hidden", l, ".bias"), h, 1, false});
      in = h;
    }
    specs_.push_back({"output.weight", config_.vocab, in, true});
    specs_.push_back({"output.bias", config_.vocab, 1, false});
  }

  [[nodiscard]] const CharLmConfig& config() const { return config_; }
  /// The parameter tensors, in the order of `Params`.
  [[nodiscard]] const std::vector<ParamSpec>& specs() const { return specs_; }

  [[nodiscard]] std::size_t parameter_count() const {
    std::size_t n = 0;
    for (const auto& s : specs_) n += s.numel();
    return n;
  }

  /// The tensor list in the form ddiloco's fragmenter takes (`make_plan`).
  [[nodiscard]] std::vector<ddiloco::TensorSpec> tensor_specs() const {
    std::vector<ddiloco::TensorSpec> out;
    for (const auto& s : specs_) out.push_back({s.name, s.numel(), s.embedding});
    return out;
  }

  /// All-zero tensors of the right shapes (gradient buffers, optimizer state).
  [[nodiscard]] ParamList zeros() const {
    ParamList p;
    for (const auto& s : specs_) p.push_back(Matrix::Zero(static_cast<Eigen::Index>(s.rows), static_cast<Eigen::Index>(s.cols)));
    return p;
  }

  /// Seeded initialisation: embeddings ~ N(0, 1); hidden weights ~ N(0, 1 / fan_in) (unit
  /// pre-activation variance, LeCun); output weights ~ N(0, 0.01 / fan_in), so the untrained model
  /// predicts almost uniformly (loss close to log V); biases 0.
  [[nodiscard]] ParamList init(std::uint64_t seed) const {
    ParamList p = zeros();
    Rng rng(mix_seed(seed, 0x494E4954ULL));
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      const auto& s = specs_[i];
      double std_dev = 0.0;
      if (i == 0) {
        std_dev = 1.0;
      } else if (s.cols > 1) {
        std_dev = 1.0 / std::sqrt(static_cast<double>(s.cols));
        if (i == specs_.size() - 2) std_dev *= 0.1;
      }
      if (std_dev == 0.0) continue;
      Scalar* data = p[i].data();
      for (std::size_t k = 0; k < s.numel(); ++k) data[k] = static_cast<Scalar>(std_dev * rng.normal());
    }
    return p;
  }

  /// Throws ShapeMismatch unless `params` has exactly the tensors of specs().
  void check_params(const ParamList& params, const char* what = "params") const {
    if (params.size() != specs_.size()) {
      throw ShapeMismatch(detail::msg("CharLm: ", what, " has ", params.size(), " tensors, the model has ",
                                      specs_.size(), "; build it with CharLm::init() or zeros()"));
    }
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      if (static_cast<std::size_t>(params[i].rows()) != specs_[i].rows ||
          static_cast<std::size_t>(params[i].cols()) != specs_[i].cols) {
        throw ShapeMismatch(detail::msg("CharLm: ", what, "[", i, "] (", specs_[i].name, ") is ", params[i].rows(),
                                        " x ", params[i].cols(), ", expected ", specs_[i].rows, " x ",
                                        specs_[i].cols));
      }
    }
  }

  /// Mean cross-entropy (nats per predicted character) of the batch; forward pass only.
  double loss(const ParamList& params, const Batch& batch) {
    check_params(params);
    return forward(params, batch);
  }

  /// Mean cross-entropy of the batch and its gradient with respect to every tensor, written into
  /// `grad` (resized to the parameter shapes if needed; previous contents are overwritten).
  double loss_and_gradient(const ParamList& params, const Batch& batch, ParamList& grad) {
    check_params(params);
    if (grad.size() != params.size()) grad = zeros();
    const double mean_loss = forward(params, batch);
    backward(params, batch, grad);
    return mean_loss;
  }

 private:
  [[nodiscard]] std::size_t layers() const { return config_.hidden.size(); }
  [[nodiscard]] const Matrix& weight(const ParamList& p, std::size_t l) const { return p[1 + 2 * l]; }
  [[nodiscard]] const Matrix& bias(const ParamList& p, std::size_t l) const { return p[2 + 2 * l]; }

  // Gathers the embeddings into x_ (C*d x B, one column per example) and runs the layers; leaves
  // the hidden activations in acts_ and the softmax probabilities in probs_.
  double forward(const ParamList& params, const Batch& batch) {
    const std::size_t B = batch.size;
    const std::size_t C = config_.context;
    const std::size_t d = config_.embed_dim;
    if (batch.context != C || batch.contexts.size() != B * C || batch.targets.size() != B || B == 0) {
      throw ShapeMismatch(detail::msg("CharLm: batch of ", B, " examples with context ", batch.context, " (",
                                      batch.contexts.size(), " context tokens, ", batch.targets.size(),
                                      " targets) does not fit a model with context ", C,
                                      "; sample it with BatchSampler(stream, model.config().context, ...)"));
    }
    const auto Bi = static_cast<Eigen::Index>(B);
    const auto di = static_cast<Eigen::Index>(d);
    for (std::size_t k = 0; k < B * C; ++k) check_token(batch.contexts[k]);
    for (std::size_t k = 0; k < B; ++k) check_token(batch.targets[k]);

    const Matrix& E = params[0];
    x_.resize(static_cast<Eigen::Index>(C * d), Bi);
    for (std::size_t b = 0; b < B; ++b) {
      for (std::size_t c = 0; c < C; ++c) {
        x_.col(static_cast<Eigen::Index>(b)).segment(static_cast<Eigen::Index>(c * d), di) =
            E.col(batch.contexts[b * C + c]);
      }
    }
    acts_.resize(layers());
    const Matrix* in = &x_;
    for (std::size_t l = 0; l < layers(); ++l) {
      acts_[l].noalias() = weight(params, l) * (*in);
      acts_[l].colwise() += bias(params, l).col(0);
      if (config_.activation == Activation::tanh) {
        acts_[l] = acts_[l].array().tanh();
      } else {
        acts_[l] = acts_[l].array().max(Scalar(0));
      }
      in = &acts_[l];
    }
    const std::size_t n = params.size();
    probs_.noalias() = params[n - 2] * (*in);
    probs_.colwise() += params[n - 1].col(0);

    // Softmax with the max subtracted; loss_b = log(sum_j exp(z_j - m)) - (z_y - m).
    double total = 0.0;
    for (Eigen::Index b = 0; b < Bi; ++b) {
      auto z = probs_.col(b);
      const Scalar m = z.maxCoeff();
      const Scalar z_target = z(batch.targets[static_cast<std::size_t>(b)]) - m;
      z.array() = (z.array() - m).exp();
      const Scalar s = z.sum();
      total += std::log(static_cast<double>(s)) - static_cast<double>(z_target);
      z /= s;
    }
    return total / static_cast<double>(B);
  }

  // Backpropagation through the graph built by forward():
  //   dz       = (softmax(z) - onehot(y)) / B
  //   dW_o     = dz h^T,            db_o = sum_b dz,         dh = W_o^T dz
  //   da_l     = dh_l * act'(h_l)   (tanh: 1 - h^2; ReLU: [h > 0])
  //   dW_l     = da_l in_l^T,       db_l = sum_b da_l,       d in_l = W_l^T da_l
  //   dE[:, t] = sum of the slices of dx at every place token t was read.
  void backward(const ParamList& params, const Batch& batch, ParamList& grad) {
    const std::size_t B = batch.size;
    const std::size_t C = config_.context;
    const std::size_t d = config_.embed_dim;
    const auto Bi = static_cast<Eigen::Index>(B);
    const auto di = static_cast<Eigen::Index>(d);
    const Scalar inv_b = Scalar(1) / static_cast<Scalar>(B);
    const std::size_t n = params.size();

    for (Eigen::Index b = 0; b < Bi; ++b) probs_(batch.targets[static_cast<std::size_t>(b)], b) -= Scalar(1);
    probs_ *= inv_b;  // probs_ now holds dz
    const Matrix& h_last = acts_[layers() - 1];
    grad[n - 2].noalias() = probs_ * h_last.transpose();
    grad[n - 1] = probs_.rowwise().sum();
    delta_.noalias() = params[n - 2].transpose() * probs_;

    for (std::size_t l = layers(); l-- > 0;) {
      const Matrix& h = acts_[l];
      if (config_.activation == Activation::tanh) {
        delta_.array() *= (Scalar(1) - h.array().square());
      } else {
        delta_.array() *= (h.array() > Scalar(0)).template cast<Scalar>();
      }
      const Matrix& in = l == 0 ? x_ : acts_[l - 1];
      grad[1 + 2 * l].noalias() = delta_ * in.transpose();
      grad[2 + 2 * l] = delta_.rowwise().sum();
      delta_prev_.noalias() = weight(params, l).transpose() * delta_;
      std::swap(delta_, delta_prev_);
    }
    // delta_ is now dx (C*d x B).
    Matrix& gE = grad[0];
    gE.setZero();
    for (std::size_t b = 0; b < B; ++b) {
      for (std::size_t c = 0; c < C; ++c) {
        gE.col(batch.contexts[b * C + c]) +=
            delta_.col(static_cast<Eigen::Index>(b)).segment(static_cast<Eigen::Index>(c * d), di);
      }
    }
  }

  void check_token(Token t) const {
    if (t >= config_.vocab) {
      throw InvalidArgument(detail::msg("CharLm: token ", t, " is outside the vocabulary of ", config_.vocab,
                                        " symbols; encode the text with the model's vocabulary"));
    }
  }

  CharLmConfig config_;
  std::vector<ParamSpec> specs_;
  // Scratch buffers, reused across calls.
  Matrix x_;
  std::vector<Matrix> acts_;
  Matrix probs_;
  Matrix delta_;
  Matrix delta_prev_;
};

using CharLm = BasicCharLm<float>;

/// Mean loss (nats per character) of `params` on the fixed evaluation set of `stream`:
/// evaluation_positions(stream.size(), context, max_examples), scored in chunks of 1024.
/// Deterministic; use it to score the global (outer) parameters.
template <class Scalar>
double evaluate(BasicCharLm<Scalar>& model, const BasicParams<Scalar>& params, std::span<const Token> stream,
                std::size_t max_examples = 8192) {
  const auto positions = evaluation_positions(stream.size(), model.config().context, max_examples);
  if (positions.empty()) {
    throw InvalidArgument(detail::msg("evaluate: a stream of ", stream.size(), " tokens has no example for context ",
                                      model.config().context, "; use a longer stream"));
  }
  constexpr std::size_t kChunk = 1024;
  Batch batch;
  double total = 0.0;
  for (std::size_t first = 0; first < positions.size(); first += kChunk) {
    const std::size_t count = std::min(kChunk, positions.size() - first);
    fill_batch(stream, std::span<const std::size_t>(positions).subspan(first, count), model.config().context, batch);
    total += model.loss(params, batch) * static_cast<double>(count);
  }
  return total / static_cast<double>(positions.size());
}

// ---- AdamW ------------------------------------------------------------------------------------

/// AdamW hyper-parameters. Defaults tuned briefly for the default model on fortunes (batch 32,
/// betas (0.9, 0.99), validation loss after 2000 steps): lr 1e-3 2.51, 2e-3 2.52, 3e-3 2.60,
/// 1e-2 3.24 (after 1000), 2e-2 diverges to 4.3; 2e-3 is as good as 1e-3 and faster early.
/// Weight decay 0.01 is mild regularisation.
struct AdamWConfig {
  float lr = 2e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.99f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  /// Linear warm-up: the learning rate of step t (from 1) is lr * min(1, t / warmup_steps);
  /// 0 disables it.
  std::size_t warmup_steps = 0;
};

/// AdamW (Loshchilov and Hutter, "Decoupled Weight Decay Regularization", 2019, Algorithm 2), in
/// the form of PyTorch's torch.optim.AdamW. For step t = 1, 2, ... and learning rate lr_t:
///
///   theta <- theta * (1 - lr_t * wd)                 (decoupled decay; weight tensors only)
///   m     <- beta1 m + (1 - beta1) g
///   v     <- beta2 v + (1 - beta2) g^2
///   theta <- theta - lr_t * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
///
/// Weight decay applies to the tensors with more than one column (embedding and weight matrices),
/// not to the biases, as nanoGPT does.
class AdamW {
 public:
  AdamW(AdamWConfig config, const std::vector<ParamSpec>& specs) : config_(config) {
    if (!(config.lr >= 0.0f) || !(config.beta1 >= 0.0f && config.beta1 < 1.0f) ||
        !(config.beta2 >= 0.0f && config.beta2 < 1.0f) || !(config.eps > 0.0f) || !(config.weight_decay >= 0.0f)) {
      throw InvalidArgument(detail::msg("AdamW: lr = ", config.lr, ", betas = (", config.beta1, ", ", config.beta2,
                                        "), eps = ", config.eps, ", weight_decay = ", config.weight_decay,
                                        "; need lr >= 0, 0 <= beta < 1, eps > 0, weight_decay >= 0"));
    }
    for (const auto& s : specs) {
      m_.push_back(Eigen::MatrixXf::Zero(static_cast<Eigen::Index>(s.rows), static_cast<Eigen::Index>(s.cols)));
      decay_.push_back(s.cols > 1);
    }
    v_ = m_;
  }

  /// One update of `params` with gradients `grads` (same shapes as the specs given at
  /// construction).
  void step(Params& params, const Params& grads) {
    if (params.size() != m_.size() || grads.size() != m_.size()) {
      throw ShapeMismatch(detail::msg("AdamW::step: ", params.size(), " parameter and ", grads.size(),
                                      " gradient tensors for an optimizer of ", m_.size(), "; pass the model's lists"));
    }
    ++t_;
    const double lr_t = lr_at(t_);
    const double bc1 = 1.0 - std::pow(static_cast<double>(config_.beta1), static_cast<double>(t_));
    const double bc2 = 1.0 - std::pow(static_cast<double>(config_.beta2), static_cast<double>(t_));
    const auto step_size = static_cast<float>(lr_t / bc1);
    const auto inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
    const auto keep = static_cast<float>(1.0 - lr_t * static_cast<double>(config_.weight_decay));
    const float b1 = config_.beta1;
    const float b2 = config_.beta2;
    const float eps = config_.eps;
    for (std::size_t i = 0; i < m_.size(); ++i) {
      if (params[i].rows() != m_[i].rows() || params[i].cols() != m_[i].cols() || grads[i].rows() != m_[i].rows() ||
          grads[i].cols() != m_[i].cols()) {
        throw ShapeMismatch(detail::msg("AdamW::step: tensor ", i, " is ", params[i].rows(), " x ", params[i].cols(),
                                        " (gradient ", grads[i].rows(), " x ", grads[i].cols(), "), expected ",
                                        m_[i].rows(), " x ", m_[i].cols()));
      }
      auto p = params[i].array();
      auto g = grads[i].array();
      auto m = m_[i].array();
      auto v = v_[i].array();
      if (decay_[i]) p *= keep;
      m = b1 * m + (1.0f - b1) * g;
      v = b2 * v + (1.0f - b2) * g.square();
      p -= step_size * m / (v.sqrt() * inv_sqrt_bc2 + eps);
    }
  }

  /// Learning rate of step t (t = 1 is the first step): lr * min(1, t / warmup_steps).
  [[nodiscard]] double lr_at(std::uint64_t t) const {
    const double lr = static_cast<double>(config_.lr);
    if (config_.warmup_steps == 0 || t >= config_.warmup_steps) return lr;
    return lr * static_cast<double>(t) / static_cast<double>(config_.warmup_steps);
  }

  [[nodiscard]] std::uint64_t steps() const { return t_; }
  [[nodiscard]] const AdamWConfig& config() const { return config_; }
  [[nodiscard]] const Params& first_moment() const { return m_; }
  [[nodiscard]] const Params& second_moment() const { return v_; }

 private:
  AdamWConfig config_;
  Params m_;
  Params v_;
  std::vector<bool> decay_;
  std::uint64_t t_ = 0;
};

// ---- One learner ------------------------------------------------------------------------------

/// Everything a learner needs to train the model.
struct TrainerConfig {
  CharLmConfig model{};
  AdamWConfig optimizer{};
  /// Examples per step. At 32 a step of the default model takes about 1.05 ms of CPU on one core
  /// of the 2-core Xeon development machine (16: 0.65 ms, 64: 1.9 ms; RelWithDebInfo, SSE only).
  std::size_t batch_size = 32;
  /// Seeds the initial parameters (the same for every shard, so all learners start from the same
  /// point, as DiLoCo requires) and, mixed with the shard index, the data order.
  std::uint64_t seed = 1;
};

/// One learner: a model, its parameters, AdamW and a batch sampler over its shard.
/// Counts steps and tokens, where a token is one predicted character: a step adds batch_size.
class Trainer {
 public:
  Trainer(TrainerConfig config, std::span<const Token> train, Shard shard = {})
      : config_(std::move(config)),
        model_(config_.model),
        params_(model_.init(config_.seed)),
        grads_(model_.zeros()),
        optimizer_(config_.optimizer, model_.specs()),
        sampler_(train, config_.model.context, config_.batch_size, mix_seed(config_.seed, 0x44415441ULL), shard) {}

  /// One inner step: draw a batch, compute loss and gradient, apply AdamW. Returns the batch's
  /// mean loss before the update (nats per character).
  double step() {
    sampler_.next(batch_);
    const double loss = model_.loss_and_gradient(params_, batch_, grads_);
    optimizer_.step(params_, grads_);
    ++steps_;
    tokens_ += batch_.size;
    return loss;
  }

  [[nodiscard]] std::uint64_t steps() const { return steps_; }
  [[nodiscard]] std::uint64_t tokens() const { return tokens_; }
  [[nodiscard]] std::size_t tokens_per_step() const { return config_.batch_size; }

  /// The learner's parameters: ddiloco reads them to send fragments and overwrites them with
  /// merged ones. Shapes must not change.
  [[nodiscard]] Params& params() { return params_; }
  [[nodiscard]] const Params& params() const { return params_; }
  [[nodiscard]] CharLm& model() { return model_; }
  [[nodiscard]] AdamW& optimizer() { return optimizer_; }
  [[nodiscard]] const TrainerConfig& config() const { return config_; }

 private:
  TrainerConfig config_;
  CharLm model_;
  Params params_;
  Params grads_;
  AdamW optimizer_;
  BatchSampler sampler_;
  Batch batch_;
  std::uint64_t steps_ = 0;
  std::uint64_t tokens_ = 0;
};

}  // namespace ddiloco::reference
