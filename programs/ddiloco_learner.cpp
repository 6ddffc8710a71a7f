// ddiloco_learner: one learner training the reference character LM with
// Decoupled DiLoCo over ZeroMQ (the syncer is ddiloco_syncer --reference-model).
//
// It joins (receives the global state), trains its data shard with AdamW and
// calls OuterLoop::step after every inner step; it never waits for the syncer.
// Prints progress lines: step, train loss, validation loss of its local
// parameters, tokens/s, sends/applies. `--help` lists every flag.
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/adapters/eigen.hpp>
#include <ddiloco/outer_loop.hpp>
#include <ddiloco/reference/char_lm.hpp>
#include <ddiloco/transport/zmq.hpp>

#include <chrono>
#include <cstdio>

#include "cli.hpp"

using namespace ddiloco;
namespace ref = ddiloco::reference;

int main(int argc, char** argv) try {
  cli::Flags f("ddiloco_learner", "a Decoupled DiLoCo learner training the reference model over ZeroMQ");
  f.add("config", "", "file of `name = value` lines with any of these flags");
  f.add("connect", "tcp://127.0.0.1:5555", "the syncer's endpoint");
  f.add("id", "0", "this learner's id (unique; the allow-list binds it to this learner's key)");
  f.add("shard", "0", "data shard index of this learner");
  f.add("shards", "1", "number of data shards (usually the number of learners)");
  f.add("steps", "1000", "inner-step budget");
  f.add("seed", "1", "seed of the model's initial values (must match the syncer's)");
  f.add("fragments", "5", "P (must match the syncer)");
  f.add("sync-every", "24", "H: inner steps between two syncs of a fragment");
  f.add("overlap", "2", "tau: steps between a send and the application of its result");
  f.add("codec", "fp32", "codec of the outer gradients sent: fp32, bf16, fp16, int8, int4");
  f.add("error-feedback", "false", "carry the quantisation residual into the next send", true);
  f.add("keys", "", "this learner's key file (from ddiloco_keygen)");
  f.add("server-key", "", "the syncer's public key file");
  f.add("plaintext", "false", "connect WITHOUT encryption or authentication (explicit choice)", true);
  f.add("join-timeout-ms", "60000", "give up joining after this long");
  f.add("lock-step", "false",
        "wait at send + tau for each fragment's merged result (synchronous / Streaming DiLoCo baseline)", true);
  f.add("lock-step-timeout-ms", "60000", "in lock-step mode, stop waiting for a result after this long");
  f.add("eval-every", "200", "print a progress line every this many steps");
  f.add("eval-examples", "2048", "validation examples per progress line");
  if (!f.parse(argc, argv)) return 0;

  const auto corpus = ref::load_fortunes();
  ref::TrainerConfig tc;
  tc.seed = static_cast<std::uint64_t>(f.integer("seed"));
  ref::Trainer trainer(tc, corpus.train, ref::Shard{f.count("shard"), f.count("shards")});
  ref::CharLm scorer(tc.model);
  const Plan plan = make_plan(trainer.model().tensor_specs(), f.count("fragments"));

  SteadyClock clock;
  ZmqLearnerConfig zc;
  zc.connect = f.str("connect");
  zc.id = static_cast<LearnerId>(f.integer("id"));
  zc.error_feedback = f.flag("error-feedback");
  zc.codec = parse_codec(f.str("codec"));
  if (f.flag("plaintext")) {
    zc.security = ZmqSecurity::plaintext();
  } else {
    if (f.str("keys").empty() || f.str("server-key").empty())
      throw InvalidArgument("CURVE security needs --keys and --server-key; pass --plaintext to run unencrypted");
    zc.security.own = read_key_file(f.str("keys"));
    zc.security.server_public_key = read_key_file(f.str("server-key")).public_key;
  }
  ZmqLearnerTransport link(zc, clock);
  OuterLoopConfig oc;
  oc.id = zc.id;
  oc.sync_every = f.count("sync-every");
  oc.overlap = f.count("overlap");
  oc.join_timeout = std::chrono::milliseconds(f.integer("join-timeout-ms"));
  oc.lock_step = f.flag("lock-step");
  oc.lock_step_timeout = std::chrono::milliseconds(f.integer("lock-step-timeout-ms"));
  OuterLoop<ZmqLearnerTransport, Eigen::MatrixXf> outer(plan, link, oc);
  auto& params = trainer.params();
  std::printf("learner %u: joining %s (plan %016llx, %zu parameters)\n", zc.id, zc.connect.c_str(),
              static_cast<unsigned long long>(plan.fingerprint()), trainer.model().parameter_count());
  std::fflush(stdout);
  outer.join(params);
  std::printf("learner %u: joined\n", zc.id);
  const std::size_t steps = f.count("steps"), every = std::max<std::size_t>(1, f.count("eval-every"));
  const auto t0 = std::chrono::steady_clock::now();
  double loss_sum = 0;
  for (std::size_t s = 1; s <= steps; ++s) {
    const auto before = trainer.tokens();
    loss_sum += trainer.step();
    outer.step(params, static_cast<std::int64_t>(trainer.tokens() - before));
    if (s % every == 0 || s == steps) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const auto& st = outer.status();
      std::printf("learner %u: step %zu train %.4f val %.4f tokens/s %.0f sends %llu applies %llu failed-sends %llu\n",
                  zc.id, s, loss_sum / static_cast<double>(every),
                  ref::evaluate(scorer, params, corpus.validation, f.count("eval-examples")),
                  static_cast<double>(trainer.tokens()) / secs, static_cast<unsigned long long>(st.sends),
                  static_cast<unsigned long long>(st.applies), static_cast<unsigned long long>(st.send_failures));
      std::fflush(stdout);
      loss_sum = 0;
    }
  }
  outer.leave();
  std::printf("learner %u: done\n", zc.id);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ddiloco_learner: %s\n", e.what());
  return 1;
}
