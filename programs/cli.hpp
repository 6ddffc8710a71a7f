// programs/cli.hpp: the small flag parser the ddiloco programs (and the examples) share.
//
// Flags are `--name value` or `--name=value`, booleans `--name`; a config file
// (`--config FILE`) holds `name = value` lines with `#` comments, and flags on
// the command line win. Every flag is declared with a default and a help
// line, so `--help` documents all of them. `--version` prints the program's
// name and the ddiloco version (<ddiloco/version.hpp>). Unknown flags and bad
// values are errors that name the flag.
#pragma once

#include <ddiloco/version.hpp>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddiloco::cli {

class Flags {
 public:
  explicit Flags(std::string program, std::string summary) : program_(std::move(program)), summary_(std::move(summary)) {}

  void add(const std::string& name, const std::string& default_value, const std::string& help, bool boolean = false) {
    order_.push_back(name);
    specs_[name] = {default_value, help, boolean};
    values_[name] = default_value;
  }

  /// Parses argv (and a --config file). Returns false after printing --help or --version.
  bool parse(int argc, char** argv) {
    std::map<std::string, std::string> from_cli;
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        print_help(std::cout);
        return false;
      }
      if (a == "--version") {
        std::cout << program_ << ' ' << DDILOCO_VERSION_STRING << '\n';
        return false;
      }
      if (a.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument '" + a + "' (flags start with --)");
      a = a.substr(2);
      std::string value;
      if (auto eq = a.find('='); eq != std::string::npos) {
        value = a.substr(eq + 1);
        a = a.substr(0, eq);
        check_known(a);
      } else {
        check_known(a);
        if (specs_[a].boolean) {
          value = "true";
        } else {
          if (i + 1 >= argc) throw std::invalid_argument("flag --" + a + " needs a value");
          value = argv[++i];
        }
      }
      from_cli[a] = value;
    }
    if (auto it = from_cli.find("config"); it != from_cli.end() && !it->second.empty()) read_config(it->second);
    for (auto& [k, v] : from_cli) values_[k] = v;
    return true;
  }

  [[nodiscard]] const std::string& str(const std::string& name) const { return values_.at(name); }
  [[nodiscard]] bool flag(const std::string& name) const { return str(name) == "true" || str(name) == "1"; }
  [[nodiscard]] double num(const std::string& name) const {
    const std::string& s = str(name);
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    if (s.empty() || end == nullptr || *end != '\0') throw std::invalid_argument("--" + name + " = '" + s + "' is not a number");
    return v;
  }
  [[nodiscard]] long long integer(const std::string& name) const {
    const double v = num(name);
    if (v != static_cast<double>(static_cast<long long>(v))) throw std::invalid_argument("--" + name + " must be an integer");
    return static_cast<long long>(v);
  }
  [[nodiscard]] std::size_t count(const std::string& name) const {
    const auto v = integer(name);
    if (v < 0) throw std::invalid_argument("--" + name + " = " + std::to_string(v) + " must be >= 0");
    return static_cast<std::size_t>(v);
  }

  void print_help(std::ostream& os) const {
    os << program_ << " " << DDILOCO_VERSION_STRING << ": " << summary_
       << "\n\nFlags (also `name = value` lines in --config FILE; --version prints the version):\n";
    for (const auto& n : order_) {
      const auto& s = specs_.at(n);
      os << "  --" << n << (s.boolean ? "" : " VALUE") << "\n      " << s.help << " (default: "
         << (s.default_value.empty() ? "none" : s.default_value) << ")\n";
    }
  }

 private:
  struct Spec {
    std::string default_value, help;
    bool boolean = false;
  };
  void check_known(const std::string& name) const {
    if (!specs_.count(name)) throw std::invalid_argument("unknown flag --" + name + "; see --help");
  }
  void read_config(const std::string& path) {
    std::ifstream in(path);
    if (!in) throw std::invalid_argument("cannot read --config file '" + path + "'");
    std::string line;
    int n = 0;
    while (std::getline(in, line)) {
      ++n;
      if (auto hash = line.find('#'); hash != std::string::npos) line = line.substr(0, hash);
      const auto eq = line.find('=');
      auto trim = [](std::string s) {
        s.erase(0, s.find_first_not_of(" \t"));
        s.erase(s.find_last_not_of(" \t\r") + 1);
        return s;
      };
      if (trim(line).empty()) continue;
      if (eq == std::string::npos) throw std::invalid_argument(path + ":" + std::to_string(n) + ": expected 'name = value'");
      const std::string k = trim(line.substr(0, eq));
      check_known(k);
      values_[k] = trim(line.substr(eq + 1));
    }
  }

  std::string program_, summary_;
  std::vector<std::string> order_;
  std::map<std::string, Spec> specs_;
  std::map<std::string, std::string> values_;
};

}  // namespace ddiloco::cli
