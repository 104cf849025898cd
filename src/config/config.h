// The job config: a TOML file plus `--section.key=value` overrides, checked
// against one schema (config/schema.cpp). Unknown keys and wrong types are
// errors naming the key, the file and the closest valid key; deprecated keys
// (and deprecated spellings of several keys) map to their new names with one
// warning; cross-field checks run after the overrides. Checks that need a
// layer above (the model-family registry, the schedule table) run where the
// config is used (apps/command.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace viaduct {

using StringList = std::vector<std::string>;
using StringListList = std::vector<std::vector<std::string>>;
using FloatList = std::vector<double>;
// monostate = "unset": the flavor / component decides.
using ConfigValue = std::variant<std::monostate, int64_t, double, bool,
                                 std::string, StringList, StringListList,
                                 FloatList>;

enum class ConfigType {
  kInt,
  kFloat,
  kBool,
  kString,
  kStringList,
  kStringListList,
  kFloatList
};

// The values a numeric key accepts: an interval whose ends may be open,
// closed or absent. A float key with a range must also be finite.
struct ConfigRange {
  std::optional<double> lo, hi;
  bool lo_open = false, hi_open = false;

  bool empty() const { return !lo && !hi; }
  bool contains(double v) const;
  // ">= 0", "> 0", "[0, 1)", "[0, 1]".
  std::string text() const;
};
inline ConfigRange at_least(double lo) { return {lo, std::nullopt, false, false}; }
inline ConfigRange greater_than(double lo) { return {lo, std::nullopt, true, false}; }
// [lo, hi) with hi_open, else [lo, hi].
inline ConfigRange between(double lo, double hi, bool hi_open = false) {
  return {lo, hi, false, hi_open};
}

struct ConfigKey {
  std::string section;
  std::string name;
  ConfigType type;
  ConfigValue default_value;  // monostate: no default (flavor decides)
  std::string help;
  ConfigRange range = {};     // numeric keys: checked on load, naming the source
  // Another dotted key that replaces this one: while that key holds a
  // non-empty value this one is not in effect (to_toml writes it as a
  // comment). Giving both in the file, or both on the command line, is a
  // ConfigError naming the two; that key on the command line replaces this
  // one from the file.
  std::string replaced_by = {};
  std::string dotted() const { return section + "." + name; }
  ConfigKey&& in(ConfigRange r) && {
    range = r;
    return std::move(*this);
  }
  ConfigKey&& replaced_when_set(std::string dotted_key) && {
    replaced_by = std::move(dotted_key);
    return std::move(*this);
  }
};

// The whole schema, in the order print-config writes it.
const std::vector<ConfigKey>& config_schema();
// Deprecated dotted key -> its new dotted key.
const std::map<std::string, std::string>& config_aliases();
// Removed dotted key -> what now always happens; setting one is a
// ConfigError that says so.
const std::map<std::string, std::string>& config_removed_keys();

// A deprecated spelling that spans several keys: when every `given` key holds
// its string value once the overrides are applied, the `becomes` values
// replace them, with one warning that says what to write instead.
struct DeprecatedSpelling {
  std::vector<std::pair<std::string, std::string>> given;    // dotted key, value
  std::vector<std::pair<std::string, std::string>> becomes;  // dotted key, value
};
const std::vector<DeprecatedSpelling>& config_deprecated_spellings();

class Config {
 public:
  // Defaults only.
  Config();

  // Load `path` (empty = defaults only) and apply `overrides` (each
  // "section.key=value" or "section.key" "value" already joined by '=').
  // Runs the cross-field checks. Throws ConfigError.
  static Config load(const std::string& path,
                     const std::vector<std::string>& overrides = {});
  // Parse TOML text (for tests); `origin` names it in errors.
  static Config parse(const std::string& toml_text, const std::string& origin,
                      const std::vector<std::string>& overrides = {});

  // Typed access by dotted key; throws (internal) on a type mismatch and
  // ConfigError when the key is unset and has no default.
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  std::string get_string(const std::string& key) const;
  StringList get_string_list(const std::string& key) const;
  StringListList get_string_list_list(const std::string& key) const;
  FloatList get_float_list(const std::string& key) const;
  std::optional<int64_t> get_int_opt(const std::string& key) const;
  std::optional<double> get_float_opt(const std::string& key) const;
  std::optional<bool> get_bool_opt(const std::string& key) const;

  // True when the file or an override gave the key (not a default).
  bool is_set(const std::string& key) const;
  // True when the key was given a value other than its default (a config
  // written back by to_toml gives every key with a default, so is_set alone
  // cannot tell a choice from a copy).
  bool differs_from_default(const std::string& key) const;
  // Programmatic set with the schema's type check (tests, derived values).
  void set(const std::string& key, ConfigValue value);
  // Apply one "section.key=value" override string.
  void apply_override(const std::string& assignment, const std::string& origin);

  // The effective config as TOML (unset keys are written as comments).
  std::string to_toml() const;
  // Where the config came from (file path or "<defaults>").
  const std::string& origin() const { return origin_; }
  // Where `key`'s value came from: the file's path, "the command line", or
  // "the default".
  std::string source(const std::string& key) const;

  // Cross-field checks; run by load()/parse() after overrides.
  void validate() const;

 private:
  std::map<std::string, ConfigValue> values_;
  std::map<std::string, bool> explicit_;
  std::map<std::string, std::string> sources_;  // keys a file or override set
  std::string origin_ = "<defaults>";
};

// Split a command line into overrides (`--section.key=value` or
// `--section.key value`) and the rest. Only arguments whose name contains a
// dot are treated as overrides.
struct ParsedArgs {
  std::string config_path;
  std::vector<std::string> overrides;
  std::vector<std::string> flags;        // e.g. "--json", "--print-config"
  std::map<std::string, std::string> options;  // e.g. "--svg" -> "out.svg"
  std::vector<std::string> positional;
};
// `valued_options`: flags that take a value (e.g. {"--svg", "--out"}).
ParsedArgs parse_command_line(int argc, char** argv, int first,
                              const std::vector<std::string>& valued_options);

}  // namespace viaduct
