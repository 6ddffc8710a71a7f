// programs/model_flags.hpp: the model a program serves or exports, from its flags.
//
// ddiloco_syncer and ddiloco_export take the model the same way (the user
// guide is docs/weights.md):
//   --init model.safetensors   tensor names, shapes and initial values from
//                              the file (F32/BF16), in the file's data order;
//                              embeddings by --embedding-pattern; no tensor
//                              list needed. With --tensors too, the list
//                              gives the order and the embedding flags and the
//                              file must hold exactly its tensors (by name).
//   --tensors list.txt [--init values.f32]   a tensor list (tensor_list.hpp),
//                              values raw little-endian fp32 in list order
//                              (or none: zeros, which the syncer refuses
//                              unless --allow-zero-init).
//   --reference-model [--seed N]   the reference character LM.
// A file is read as safetensors when its name ends in ".safetensors".
#pragma once

#include <ddiloco/error.hpp>
#include <ddiloco/fragmenter.hpp>
#include <ddiloco/reference/char_lm.hpp>
#include <ddiloco/safetensors.hpp>
#include <ddiloco/tensor_list.hpp>

#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "cli.hpp"

namespace ddiloco::cli {

/// The model: its tensors in plan order, their shapes, and initial values.
struct Model {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::uint64_t>> shapes;  ///< one per tensor; [numel] when the source has no shapes
  std::vector<float> init;                         ///< plan order; empty when no values were given
  std::string source;                              ///< where the tensors came from, for messages
};

inline void add_model_flags(Flags& f) {
  f.add("tensors", "",
        "the model's tensor list (name numel [embedding] per line); not needed with --init FILE.safetensors or "
        "--reference-model");
  f.add("reference-model", "false", "serve the reference character LM (tensors and seeded initial values)", true);
  f.add("seed", "1", "initial-value seed of the reference model");
  f.add("init", "",
        "initial parameters: FILE.safetensors (tensor names, shapes and F32/BF16 values: the plan comes from it, in "
        "the file's data order) or a raw little-endian fp32 file in --tensors order");
  f.add("embedding-pattern", std::string(kDefaultEmbeddingPattern),
        "ECMAScript regex; tensors of an --init .safetensors file whose name it matches anywhere are embeddings "
        "(averaged plainly); '' marks none. A --tensors list's own `embedding` marks win");
}

inline bool is_safetensors_path(const std::string& path) {
  constexpr std::string_view ext = ".safetensors";
  return path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
}

inline std::vector<float> read_raw_fp32(const std::string& path, std::size_t n) {
  std::vector<float> v(n, 0.0f);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument("--init: cannot read '" + path + "'; check the path");
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  if (in.gcount() != static_cast<std::streamsize>(n * sizeof(float)) || in.peek() != EOF)
    throw ShapeMismatch(detail::msg("--init '", path, "' must hold exactly ", n, " little-endian fp32 values (", n * 4,
                                    " bytes) in --tensors order; a safetensors file must be named *.safetensors"));
  return v;
}

/// The model the flags describe. `values`: read initial values (the export
/// needs only names and shapes). Throws a ddiloco::Error naming the flag.
inline Model model_from_flags(const Flags& f, bool values) {
  Model m;
  const std::string init = f.str("init"), list = f.str("tensors");
  if (f.flag("reference-model")) {
    if (!list.empty() || !init.empty())
      throw InvalidArgument("--reference-model brings its own tensors and values; drop --tensors and --init");
    reference::TrainerConfig tc;
    tc.seed = static_cast<std::uint64_t>(f.integer("seed"));
    reference::CharLm model(tc.model);
    m.specs = model.tensor_specs();
    if (values)
      for (const auto& t : model.init(tc.seed)) m.init.insert(m.init.end(), t.data(), t.data() + t.size());
    m.source = "the reference model";
  } else if (is_safetensors_path(init)) {
    const SafetensorsFile file = read_safetensors(init);
    if (list.empty()) {
      m.specs = safetensors_specs(file, EmbeddingRule(f.str("embedding-pattern")), init);
      for (const auto& t : file.tensors) {
        m.shapes.push_back(t.shape);
        if (values) m.init.insert(m.init.end(), t.values.begin(), t.values.end());
      }
      m.source = init;
    } else {
      // The list gives the order and the flags; the file, by name, the values.
      m.specs = read_tensor_list_file(list);
      std::map<std::string, const SafetensorsTensor*> by_name;
      for (const auto& t : file.tensors) by_name[t.name] = &t;
      for (const auto& s : m.specs) {
        const auto it = by_name.find(s.name);
        if (it == by_name.end())
          throw ShapeMismatch(detail::msg("--tensors '", list, "' has tensor '", s.name, "' that --init '", init,
                                          "' lacks; the file must hold every tensor of the list"));
        if (it->second->values.size() != s.numel)
          throw ShapeMismatch(detail::msg("tensor '", s.name, "' has ", s.numel, " elements in --tensors '", list,
                                          "' but shape ", detail::shape_string(it->second->shape), " (",
                                          it->second->values.size(), " elements) in --init '", init, "'"));
        m.shapes.push_back(it->second->shape);
        if (values) m.init.insert(m.init.end(), it->second->values.begin(), it->second->values.end());
        by_name.erase(it);
      }
      if (!by_name.empty())
        throw ShapeMismatch(detail::msg("--init '", init, "' has tensor '", by_name.begin()->first, "' (and ",
                                        by_name.size() - 1, " more) that --tensors '", list,
                                        "' lacks; list every tensor of the file, or drop --tensors"));
      m.source = "--tensors " + list;
    }
  } else {
    if (list.empty() && !init.empty())
      throw InvalidArgument("--init '" + init + "' is not named *.safetensors, so it is read as raw fp32, which "
                            "needs --tensors FILE to say which tensors it holds; rename a safetensors file to "
                            "end in .safetensors, or add --tensors");
    if (list.empty())
      throw InvalidArgument("give the model: --init FILE.safetensors, --tensors FILE (with --init FILE.f32 for its "
                            "values) or --reference-model; see --help");
    m.specs = read_tensor_list_file(list);
    std::size_t total = 0;
    for (const auto& s : m.specs) total += s.numel;
    if (values && !init.empty()) m.init = read_raw_fp32(init, total);
    m.source = "--tensors " + list;
  }
  if (m.shapes.empty())
    for (const auto& s : m.specs) m.shapes.push_back({s.numel});
  return m;
}

}  // namespace ddiloco::cli
