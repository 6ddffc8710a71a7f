// ddiloco/tensor_list.hpp: read and write a model's tensor list as text.
//
// What it is: the tiny text format that the demo, the syncer program and the
// planner read to learn a model's tensors (examples/models/*.txt), parsed into
// the `TensorSpec`s that `make_plan` takes. One tensor per line, in model order:
//
//     # a comment; blank lines are ignored too
//     tok_embeddings.weight 128256x2048 embedding
//     layers.0.attention_norm.weight 2048
//
// A line is `name size [embedding]`: `name` is any run of non-blank characters
// without `#`; `size` is a positive decimal element count or a shape
// `d0xd1x...` of positive decimal dimensions whose product is the count; the
// optional word `embedding` marks embedding/unembedding tensors (merged with a
// plain weighted average, docs/algorithm.md, "Radial-Directional Averaging"). `#` starts a comment anywhere.
// What it is not: a checkpoint format (no values, dtypes or strides) and not
// the plan: which fragment a tensor goes to is <ddiloco/fragmenter.hpp>.
#pragma once

#include <algorithm>
#include <cstddef>
#include <fstream>
#include <istream>
#include <limits>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <ddiloco/error.hpp>
#include <ddiloco/fragmenter.hpp>

namespace ddiloco {

namespace detail {

inline bool is_blank(char c) noexcept { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; }

/// Splits a line (comment already removed) into blank-separated tokens.
inline std::vector<std::string_view> split_tokens(std::string_view line) {
  std::vector<std::string_view> out;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && is_blank(line[i])) ++i;
    const std::size_t start = i;
    while (i < line.size() && !is_blank(line[i])) ++i;
    if (i > start) out.push_back(line.substr(start, i - start));
  }
  return out;
}

/// Parses `size` (a count or a shape `d0xd1x...`). Throws ProtocolError naming
/// `where` (file:line) and the token.
inline std::size_t parse_size_token(std::string_view token, const std::string& where) {
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  std::size_t product = 1;
  std::size_t start = 0;
  while (true) {
    const std::size_t end = std::min(token.find('x', start), token.size());
    const std::string_view dim = token.substr(start, end - start);
    if (dim.empty()) {
      throw ProtocolError(msg(where, ": bad size '", token,
                              "': expected a positive count such as 4096 or a shape such as 2048x2048"));
    }
    std::size_t value = 0;
    for (char c : dim) {
      if (c < '0' || c > '9') {
        throw ProtocolError(msg(where, ": bad size '", token, "': '", dim,
                                "' is not a decimal number; write a count such as 4096 or a shape such as 2048x2048"));
      }
      const auto digit = static_cast<std::size_t>(c - '0');
      if (value > (max - digit) / 10) {
        throw ProtocolError(msg(where, ": size '", token, "' overflows a 64-bit element count; check the number"));
      }
      value = value * 10 + digit;
    }
    if (value == 0) {
      throw ProtocolError(msg(where, ": size '", token,
                              "' is zero; every tensor needs at least one element, drop the line or fix the size"));
    }
    if (product > max / value) {
      throw ProtocolError(msg(where, ": shape '", token, "' has more elements than a 64-bit count holds; check the dimensions"));
    }
    product *= value;
    if (end == token.size()) break;
    start = end + 1;
  }
  return product;
}

}  // namespace detail

/// Parses a tensor list (format above). `source_name` names the input in
/// error messages ("llama-1b.txt:12: ..."). Throws ProtocolError for a
/// malformed line, a zero or overflowing size, a duplicate name, a total that
/// overflows, a read error, or a list without any tensor.
inline std::vector<TensorSpec> parse_tensor_list(std::istream& in, std::string_view source_name) {
  std::vector<TensorSpec> out;
  std::unordered_map<std::string, std::size_t> line_of;  // name -> line, for duplicates
  std::size_t total = 0;
  std::string line;
  std::size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    const std::string where = detail::msg(source_name, ':', line_no);
    std::string_view content(line);
    content = content.substr(0, std::min(content.find('#'), content.size()));
    const auto tokens = detail::split_tokens(content);
    if (tokens.empty()) continue;
    if (tokens.size() == 1) {
      throw ProtocolError(detail::msg(where, ": tensor '", tokens[0],
                                      "' has no size; write `name numel [embedding]` or `name d0xd1x... [embedding]`"));
    }
    if (tokens.size() > 3) {
      throw ProtocolError(detail::msg(where, ": unexpected token '", tokens[3],
                                      "'; a line is `name size [embedding]`, use # for comments"));
    }
    TensorSpec spec;
    spec.name = std::string(tokens[0]);
    spec.numel = detail::parse_size_token(tokens[1], where);
    if (tokens.size() == 3) {
      if (tokens[2] != "embedding") {
        throw ProtocolError(detail::msg(where, ": unexpected token '", tokens[2],
                                        "' after the size; the only flag is `embedding`"));
      }
      spec.embedding = true;
    }
    if (spec.numel > std::numeric_limits<std::size_t>::max() - total) {
      throw ProtocolError(detail::msg(where, ": the total element count overflows at tensor '", spec.name,
                                      "'; check the sizes"));
    }
    total += spec.numel;
    auto [it, inserted] = line_of.emplace(spec.name, line_no);
    if (!inserted) {
      throw ProtocolError(detail::msg(where, ": tensor name '", spec.name, "' already used at line ", it->second,
                                      "; names must be unique"));
    }
    out.push_back(std::move(spec));
  }
  if (in.bad()) {
    throw ProtocolError(detail::msg(source_name, ':', line_no + 1, ": read error; check the file is readable"));
  }
  if (out.empty()) {
    throw ProtocolError(detail::msg(source_name, ": no tensors found (", line_no,
                                    " lines, all blank or comments); write one `name size [embedding]` per line"));
  }
  return out;
}

/// Reads a tensor list file. Throws InvalidArgument if the file cannot be
/// opened, ProtocolError (naming path:line) if its content is malformed.
inline std::vector<TensorSpec> read_tensor_list_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    throw InvalidArgument(detail::msg("read_tensor_list_file: cannot open '", path,
                                      "'; check the path (examples/models/ has sample lists)"));
  }
  return parse_tensor_list(in, path);
}

/// Writes `name numel [embedding]` lines that `parse_tensor_list` reads back
/// to the same specs. Throws InvalidArgument for a spec that would not round
/// trip: an empty name, a name with a blank or `#`, or numel = 0.
inline void write_tensor_list(std::ostream& out, std::span<const TensorSpec> tensors) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const bool bad_name = t.name.empty() || t.name.find('#') != std::string::npos ||
                          std::any_of(t.name.begin(), t.name.end(), [](char c) { return detail::is_blank(c) || c == '\n'; });
    if (bad_name) {
      throw InvalidArgument(detail::msg("write_tensor_list: tensor ", i, " has name '", t.name,
                                        "', which cannot be written; use a non-empty name without blanks or '#'"));
    }
    if (t.numel == 0) {
      throw InvalidArgument(detail::msg("write_tensor_list: tensor '", t.name,
                                        "' has numel = 0; every tensor needs at least one element"));
    }
    out << t.name << ' ' << t.numel << (t.embedding ? " embedding\n" : "\n");
  }
}

}  // namespace ddiloco
