// ddiloco_export: write the global parameters of a syncer checkpoint to a
// .safetensors file, under the model's tensor names and shapes, for PyTorch,
// Hugging Face or any other safetensors reader (docs/weights.md).
//
// A program of its own, not a syncer flag: it binds no socket and needs no
// keys, runs where the checkpoint files are (also while the syncer is up, or
// long after), and its few flags are all about the model. Checkpoints record
// their tensors' names and shapes, so `--checkpoint DIR --out FILE` is enough;
// for a checkpoint without them (written by an older version) give the
// --init/--tensors/--reference-model and --fragments the syncer ran with. Any
// model flags given are checked against the checkpoint's plan, naming the
// first difference, and nothing is written on a mismatch.
#include <ddiloco/checkpoint.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/safetensors.hpp>

#include <cstdio>
#include <algorithm>
#include <filesystem>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "model_flags.hpp"

using namespace ddiloco;
namespace fs = std::filesystem;

namespace {
/// A checkpoint file, or a directory's newest valid one (as the syncer would resume from).
LoadedCheckpoint load_one(const std::string& ck) {
  if (ck.empty() || !fs::exists(ck))
    throw InvalidArgument("--checkpoint '" + ck + "' does not exist; give a checkpoint file or the syncer's "
                          "--checkpoint-dir (one per syncer shard, comma-separated)");
  if (!fs::is_directory(ck)) return read_checkpoint(ck);
  std::vector<CheckpointProblem> skipped;
  auto loaded = load_newest_valid(ck, skipped);
  for (const auto& p : skipped)
    std::fprintf(stderr, "ddiloco_export: skipped damaged checkpoint %s: %s\n", p.path.string().c_str(),
                 p.reason.c_str());
  if (!loaded)
    throw InvalidArgument("--checkpoint '" + ck + "' holds no valid checkpoint (checkpoint-*.ddck); check the "
                          "directory (the syncer's --checkpoint-dir)");
  return std::move(*loaded);
}
}  // namespace

int main(int argc, char** argv) try {
  cli::Flags f("ddiloco_export", "write a syncer checkpoint's global parameters to a .safetensors file");
  f.add("config", "", "file of `name = value` lines with any of these flags");
  f.add("checkpoint", "",
        "a checkpoint file (checkpoint-*.ddck), or a checkpoint directory: its newest valid checkpoint, as the "
        "syncer would resume from (required); for a syncer sharded by fragment one per shard, comma-separated, "
        "with the model flags (shard checkpoints record no tensor names)");
  f.add("out", "", "the .safetensors file to write (atomically: complete or not at all) (required)");
  cli::add_model_flags(f);
  f.add("fragments", "0",
        "P the syncer ran with, for --init/--tensors/--reference-model (0: the checkpoint's fragment count)");
  f.add("allow-non-finite", "false", "write NaN/Inf values (refused by default, naming the tensor)", true);
  if (!f.parse(argc, argv)) return 0;
  const std::string ck = f.str("checkpoint"), out = f.str("out");
  if (ck.empty()) throw InvalidArgument("give --checkpoint FILE_OR_DIR (the syncer's --checkpoint-dir); see --help");
  if (out.empty()) throw InvalidArgument("give --out FILE.safetensors; see --help");

  // One checkpoint (file or directory) per syncer shard, comma-separated.
  std::vector<LoadedCheckpoint> loaded;
  for (std::size_t at = 0; at <= ck.size();) {
    const std::size_t end = std::min(ck.find(',', at), ck.size());
    loaded.push_back(load_one(ck.substr(at, end - at)));
    at = end + 1;
  }
  LoadedCheckpoint c;
  if (loaded.size() == 1 && loaded[0].snapshot.shard_count > 1)
    throw InvalidArgument(detail::msg("--checkpoint '", ck, "' is of syncer shard ", loaded[0].snapshot.shard_index,
                                      "/", loaded[0].snapshot.shard_count, ": it holds only that shard's fragments; "
                                      "give every shard's checkpoint, comma-separated (--checkpoint ckpt0,ckpt1), "
                                      "with the model flags the shards ran with"));
  c = loaded.size() == 1 ? std::move(loaded[0]) : combine_shards(loaded);

  const bool model_given = f.flag("reference-model") || !f.str("init").empty() || !f.str("tensors").empty();
  std::vector<std::vector<std::uint64_t>> shapes;
  std::optional<Plan> plan;
  if (!c.tensors.empty()) {
    plan = checkpoint_plan(c);
    for (const auto& t : c.tensors) shapes.push_back(t.shape);
  } else if (!model_given) {
    throw InvalidArgument("checkpoint '" + c.path.string() + "' records no tensor names (written by an older "
                          "version); give the --init, --tensors or --reference-model and the --fragments the "
                          "syncer ran with");
  }
  if (model_given) {
    const cli::Model model = cli::model_from_flags(f, /*values=*/false);
    const std::size_t p = f.count("fragments") == 0 ? c.snapshot.fragments.size() : f.count("fragments");
    Plan mine = make_plan(model.specs, p);
    check_checkpoint_plan(c, mine, model.source);
    plan = std::move(mine);
    shapes = model.shapes;  // a safetensors --init has the real shapes; a tensor list [numel]
  }

  std::vector<std::span<const float>> fragments;
  for (const auto& fr : c.snapshot.fragments) fragments.emplace_back(fr.theta);
  const auto views = plan_tensor_views(*plan, fragments, shapes);
  SafetensorsWriteOptions options;
  options.allow_non_finite = f.flag("allow-non-finite");
  std::ostringstream fp;
  fp << std::hex << c.snapshot.fingerprint;
  std::uint64_t merges = 0;
  for (const auto& fr : c.snapshot.fragments) merges += fr.status.merges;
  options.metadata = {{"format", "pt"},
                      {"ddiloco.checkpoint", c.path.filename().string()},
                      {"ddiloco.serial", std::to_string(c.serial)},
                      {"ddiloco.plan_fingerprint", fp.str()},
                      {"ddiloco.merges", std::to_string(merges)}};
  write_safetensors(out, std::span<const SafetensorsView>(views), options);
  std::printf("ddiloco_export: wrote %s: %zu tensors, %zu parameters, the global model of %s (serial %llu, %llu "
              "merges)\n",
              out.c_str(), plan->num_tensors(), plan->total_numel(), c.path.string().c_str(),
              static_cast<unsigned long long>(c.serial), static_cast<unsigned long long>(merges));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ddiloco_export: %s\n", e.what());
  return 1;
}
