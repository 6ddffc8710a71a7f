// train_reference: the single-learner baseline. Trains the reference character model
// (<ddiloco/reference/char_lm.hpp>) on the fortunes corpus with plain AdamW, no ddiloco, and
// prints progress lines: step, mean train loss since the last line, validation loss of the
// current parameters, and training throughput in tokens (predicted characters) per second.
//
// Usage: train_reference [--steps N] [--seed S] [--batch B] [--lr LR] [--eval-every K]
//                        [--eval-examples E] [--fortunes DIR]
#include <Eigen/Core>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include <ddiloco/reference/char_lm.hpp>

namespace ref = ddiloco::reference;

namespace {

struct Args {
  std::size_t steps = 2000;
  std::uint64_t seed = 1;
  std::size_t batch = ref::TrainerConfig{}.batch_size;
  float lr = ref::AdamWConfig{}.lr;
  std::size_t eval_every = 250;
  std::size_t eval_examples = 8192;
  std::string fortunes = ref::default_fortune_dir().string();
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "train_reference: %s\n"
               "usage: train_reference [--steps N] [--seed S] [--batch B] [--lr LR] [--eval-every K]\n"
               "                       [--eval-examples E] [--fortunes DIR]\n",
               why);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") usage("trains the reference model on fortunes");
    if (i + 1 >= argc) usage("every option takes a value");
    const char* value = argv[++i];
    char* end = nullptr;
    if (flag == "--steps") {
      a.steps = std::strtoull(value, &end, 10);
    } else if (flag == "--seed") {
      a.seed = std::strtoull(value, &end, 10);
    } else if (flag == "--batch") {
      a.batch = std::strtoull(value, &end, 10);
    } else if (flag == "--lr") {
      a.lr = std::strtof(value, &end);
    } else if (flag == "--eval-every") {
      a.eval_every = std::strtoull(value, &end, 10);
    } else if (flag == "--eval-examples") {
      a.eval_examples = std::strtoull(value, &end, 10);
    } else if (flag == "--fortunes") {
      a.fortunes = value;
      continue;
    } else {
      usage("unknown option");
    }
    if (end == value || *end != '\0') usage("option value is not a number");
  }
  if (a.eval_every == 0) a.eval_every = a.steps == 0 ? 1 : a.steps;
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse(argc, argv);
    Eigen::setNbThreads(1);  // determinism and a fair per-core figure (no-op without OpenMP)

    using clock = std::chrono::steady_clock;
    const auto t_load = clock::now();
    const auto corpus = ref::load_fortunes({.dir = args.fortunes});
    std::printf("fortunes: %zu files, %zu train / %zu validation fortunes, %zu / %zu characters (%.2f s)\n",
                corpus.files.size(), corpus.train_fortunes.size(), corpus.validation_fortunes.size(),
                corpus.train.size(), corpus.validation.size(),
                std::chrono::duration<double>(clock::now() - t_load).count());

    ref::TrainerConfig config;
    config.seed = args.seed;
    config.batch_size = args.batch;
    config.optimizer.lr = args.lr;
    ref::Trainer trainer(config, corpus.train);
    ref::CharLm scorer(config.model);
    std::printf("model: %zu parameters, batch %zu, lr %g, seed %llu\n", trainer.model().parameter_count(),
                args.batch, static_cast<double>(args.lr), static_cast<unsigned long long>(args.seed));
    std::printf("%8s %11s %11s %12s %10s\n", "step", "train_loss", "val_loss", "tokens/s", "elapsed_s");
    std::printf("%8d %11s %11.4f %12s %10s\n", 0, "-",
                ref::evaluate(scorer, trainer.params(), corpus.validation, args.eval_examples), "-", "-");

    double train_seconds = 0.0;  // time in step() only, evaluation excluded
    double loss_sum = 0.0;
    std::size_t loss_count = 0;
    std::uint64_t tokens_at_line = 0;
    double seconds_at_line = 0.0;
    for (std::size_t step = 1; step <= args.steps; ++step) {
      const auto t0 = clock::now();
      loss_sum += trainer.step();
      train_seconds += std::chrono::duration<double>(clock::now() - t0).count();
      ++loss_count;
      if (step % args.eval_every == 0 || step == args.steps) {
        const double val = ref::evaluate(scorer, trainer.params(), corpus.validation, args.eval_examples);
        const double tokens_per_s = static_cast<double>(trainer.tokens() - tokens_at_line) /
                                    std::max(1e-9, train_seconds - seconds_at_line);
        std::printf("%8zu %11.4f %11.4f %12.0f %10.2f\n", step, loss_sum / static_cast<double>(loss_count), val,
                    tokens_per_s, train_seconds);
        std::fflush(stdout);
        loss_sum = 0.0;
        loss_count = 0;
        tokens_at_line = trainer.tokens();
        seconds_at_line = train_seconds;
      }
    }
    if (args.steps > 0) {
      std::printf("done: %zu steps, %llu tokens, %.2f s training, %.3f ms/step\n", args.steps,
                  static_cast<unsigned long long>(trainer.tokens()), train_seconds,
                  1000.0 * train_seconds / static_cast<double>(args.steps));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_reference: %s\n", e.what());
    return 1;
  }
}
