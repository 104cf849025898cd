// Config loading: TOML through toml++, overrides, strict keys with "did you
// mean", deprecated aliases and spellings, and print-back as TOML.
#include "config/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <set>
#include <sstream>

#include "config/schema_parts.h"
#include "core/check.h"
#include "core/strings.h"
#include "core/log.h"

namespace viaduct {
namespace {

const ConfigKey* find_key(const std::string& dotted) {
  for (const auto& k : config_schema()) {
    if (k.dotted() == dotted) return &k;
  }
  return nullptr;
}

std::string closest_key(const std::string& dotted) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  const auto dot = dotted.find('.');
  const std::string name = dot == std::string::npos ? dotted : dotted.substr(dot + 1);
  for (const auto& k : config_schema()) {
    // Compare both the whole dotted key and the bare name, so a key put in
    // the wrong section still finds its home.
    size_t d = std::min(edit_distance(dotted, k.dotted()),
                        edit_distance(name, k.name) + 1);
    if (d < best_d) {
      best_d = d;
      best = k.dotted();
    }
  }
  return best;
}

// The schema entry of a key a user gave in `origin` (a file or the command
// line): a removed key says what now happens instead, an unknown one names
// the closest valid key.
const ConfigKey& user_key(const std::string& dotted, const std::string& origin) {
  const auto removed = config_removed_keys().find(dotted);
  if (removed != config_removed_keys().end()) {
    throw ConfigError(str("config key '", dotted, "' in ", origin, " was removed: ",
                          removed->second));
  }
  const ConfigKey* k = find_key(dotted);
  VIADUCT_CHECK_T(ConfigError, k != nullptr, "unknown config key '", dotted, "' in ", origin,
                  " (did you mean '", closest_key(dotted), "'?)");
  return *k;
}

const char* type_name(ConfigType t) {
  switch (t) {
    case ConfigType::kInt: return "an integer";
    case ConfigType::kFloat: return "a number";
    case ConfigType::kBool: return "a boolean";
    case ConfigType::kString: return "a string";
    case ConfigType::kStringList: return "a list of strings";
    case ConfigType::kStringListList: return "a list of lists of strings";
    case ConfigType::kFloatList: return "a list of numbers";
  }
  return "?";
}

[[noreturn]] void type_error(const ConfigKey& k, const std::string& origin,
                             const std::string& got) {
  throw ConfigError(str("key '", k.dotted(), "' in ", origin, " must be ",
                        type_name(k.type), ", got ", got));
}

StringList strings_of(const toml::array& arr, const ConfigKey& k,
                      const std::string& origin) {
  StringList out;
  for (const auto& el : arr) {
    auto s = el.value<std::string>();
    if (!s) type_error(k, origin, "a list with a non-string element");
    out.push_back(*s);
  }
  return out;
}

FloatList numbers_of(const toml::array& arr, const ConfigKey& k,
                     const std::string& origin) {
  FloatList out;
  for (const auto& el : arr) {
    if (el.is_floating_point()) {
      out.push_back(el.value<double>().value());
    } else if (el.is_integer()) {
      out.push_back(static_cast<double>(el.value<int64_t>().value()));
    } else {
      type_error(k, origin, "a list with a non-number element");
    }
  }
  return out;
}

// NaN and the infinities are no setting: a key that could mean "off" by
// them (training.max_norm) would silently mean it, and a sum or ratio of
// them reaches the run as nonsense. Refused wherever a number is read.
ConfigValue finite_numbers(ConfigValue v, const ConfigKey& k, const std::string& origin) {
  auto refuse = [&](double x) {
    throw ConfigError(str("key '", k.dotted(), "' in ", origin, " must be a finite number, got ",
                          std::isnan(x) ? "nan" : (x > 0 ? "inf" : "-inf")));
  };
  if (const auto* d = std::get_if<double>(&v); d && !std::isfinite(*d)) refuse(*d);
  if (const auto* list = std::get_if<FloatList>(&v)) {
    for (double x : *list) {
      if (!std::isfinite(x)) refuse(x);
    }
  }
  return v;
}

ConfigValue from_toml(const toml::node& node, const ConfigKey& k,
                      const std::string& origin) {
  switch (k.type) {
    case ConfigType::kInt:
      if (node.is_integer()) return ConfigValue{node.value<int64_t>().value()};
      break;
    case ConfigType::kFloat:
      if (node.is_floating_point()) return ConfigValue{node.value<double>().value()};
      if (node.is_integer())
        return ConfigValue{static_cast<double>(node.value<int64_t>().value())};
      break;
    case ConfigType::kBool:
      if (node.is_boolean()) return ConfigValue{node.value<bool>().value()};
      break;
    case ConfigType::kString:
      if (node.is_string()) return ConfigValue{node.value<std::string>().value()};
      break;
    case ConfigType::kStringList:
      if (node.is_array()) return ConfigValue{strings_of(*node.as_array(), k, origin)};
      break;
    case ConfigType::kStringListList:
      if (node.is_array()) {
        StringListList out;
        for (const auto& el : *node.as_array()) {
          if (!el.is_array()) type_error(k, origin, "a list with a non-list element");
          out.push_back(strings_of(*el.as_array(), k, origin));
        }
        return ConfigValue{out};
      }
      break;
    case ConfigType::kFloatList:
      if (node.is_array()) return ConfigValue{numbers_of(*node.as_array(), k, origin)};
      break;
  }
  std::ostringstream got;
  got << node.type();
  type_error(k, origin, "a value of TOML type " + got.str());
}

// Parse a command-line value by the key's type.
ConfigValue from_text(const std::string& text, const ConfigKey& k,
                      const std::string& origin) {
#define BAD() type_error(k, origin, "'" + text + "'")
  switch (k.type) {
    case ConfigType::kInt: {
      size_t pos = 0;
      int64_t v = 0;
      try {
        v = std::stoll(text, &pos);
      } catch (...) {
        BAD();
      }
      if (pos != text.size()) BAD();
      return ConfigValue{v};
    }
    case ConfigType::kFloat: {
      size_t pos = 0;
      double v = 0;
      try {
        v = std::stod(text, &pos);
      } catch (...) {
        BAD();
      }
      if (pos != text.size()) BAD();
      return ConfigValue{v};
    }
    case ConfigType::kBool:
      if (text == "true" || text == "1") return ConfigValue{true};
      if (text == "false" || text == "0") return ConfigValue{false};
      BAD();
    case ConfigType::kString:
      if (text.size() >= 2 && text.front() == '"' && text.back() == '"')
        return ConfigValue{text.substr(1, text.size() - 2)};
      return ConfigValue{text};
    case ConfigType::kStringList:
    case ConfigType::kStringListList:
    case ConfigType::kFloatList: {
      if (!text.empty() && text.front() == '[') {
        toml::table t;
        try {
          t = toml::parse("v = " + text);
        } catch (const toml::parse_error& e) {
          throw ConfigError(str("key '", k.dotted(), "' in ", origin,
                                ": cannot parse '", text, "' as a TOML array: ",
                                e.description()));
        }
        return from_toml(*t.get("v"), k, origin);
      }
      if (k.type == ConfigType::kStringListList) BAD();
      // a,b,c
      StringList out;
      std::stringstream ss(text);
      std::string item;
      while (std::getline(ss, item, ',')) {
        if (!item.empty()) out.push_back(item);
      }
      if (k.type == ConfigType::kStringList) return ConfigValue{out};
      FloatList numbers;
      for (const auto& s : out) {
        size_t pos = 0;
        double v = 0;
        try {
          v = std::stod(s, &pos);
        } catch (...) {
          BAD();
        }
        if (pos != s.size()) BAD();
        numbers.push_back(v);
      }
      return ConfigValue{numbers};
    }
  }
  BAD();
#undef BAD
}

std::string toml_quote(const std::string& s) {
  std::ostringstream os;
  os << '"';
  for (char c : s) {
    if (c == '"' || c == '\\') os << '\\';
    if (c == '\n') {
      os << "\\n";
      continue;
    }
    os << c;
  }
  os << '"';
  return os.str();
}

std::string double_to_toml(double d) {
  std::ostringstream os;
  os << std::setprecision(17) << d;
  std::string s = os.str();
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

std::string value_to_toml(const ConfigValue& v) {
  std::ostringstream os;
  if (auto* i = std::get_if<int64_t>(&v)) {
    os << *i;
  } else if (auto* d = std::get_if<double>(&v)) {
    return double_to_toml(*d);
  } else if (auto* fl = std::get_if<FloatList>(&v)) {
    os << '[';
    for (size_t i = 0; i < fl->size(); ++i) os << (i ? ", " : "") << double_to_toml((*fl)[i]);
    os << ']';
  } else if (auto* b = std::get_if<bool>(&v)) {
    os << (*b ? "true" : "false");
  } else if (auto* s = std::get_if<std::string>(&v)) {
    os << toml_quote(*s);
  } else if (auto* l = std::get_if<StringList>(&v)) {
    os << '[';
    for (size_t i = 0; i < l->size(); ++i) os << (i ? ", " : "") << toml_quote((*l)[i]);
    os << ']';
  } else if (auto* ll = std::get_if<StringListList>(&v)) {
    os << '[';
    for (size_t i = 0; i < ll->size(); ++i) {
      os << (i ? ", " : "") << '[';
      for (size_t j = 0; j < (*ll)[i].size(); ++j)
        os << (j ? ", " : "") << toml_quote((*ll)[i][j]);
      os << ']';
    }
    os << ']';
  }
  return os.str();
}

// True when `v` holds something: not unset, not "" and not an empty list.
bool has_content(const ConfigValue& v) {
  if (std::holds_alternative<std::monostate>(v)) return false;
  if (const auto* s = std::get_if<std::string>(&v)) return !s->empty();
  if (const auto* l = std::get_if<StringList>(&v)) return !l->empty();
  if (const auto* ll = std::get_if<StringListList>(&v)) return !ll->empty();
  if (const auto* fl = std::get_if<FloatList>(&v)) return !fl->empty();
  return true;
}

// The value of a numeric key as a double, or nullopt when unset or not
// numeric.
std::optional<double> numeric_value(const ConfigValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  if (const auto* d = std::get_if<double>(&v)) return *d;
  return std::nullopt;
}

std::string number_text(double v) {
  std::ostringstream os;
  os << std::setprecision(17) << v;
  return os.str();
}

}  // namespace

bool ConfigRange::contains(double v) const {
  if (std::isnan(v)) return false;
  if (lo && (lo_open ? !(v > *lo) : !(v >= *lo))) return false;
  if (hi && (hi_open ? !(v < *hi) : !(v <= *hi))) return false;
  return !(std::isinf(v) && (lo || hi));
}

std::string ConfigRange::text() const {
  if (lo && hi) {
    return str(lo_open ? "(" : "[", number_text(*lo), ", ", number_text(*hi),
               hi_open ? ")" : "]");
  }
  if (lo) return str(lo_open ? "> " : ">= ", number_text(*lo));
  if (hi) return str(hi_open ? "< " : "<= ", number_text(*hi));
  return "any value";
}

Config::Config() {
  for (const auto& k : config_schema()) values_[k.dotted()] = k.default_value;
}

void Config::set(const std::string& dotted, ConfigValue value) {
  const ConfigKey* k = find_key(dotted);
  VIADUCT_CHECK_T(ConfigError, k != nullptr, "unknown config key '", dotted,
                  "' (did you mean '", closest_key(dotted), "'?)");
  const bool ok =
      std::holds_alternative<std::monostate>(value) ||
      (k->type == ConfigType::kInt && std::holds_alternative<int64_t>(value)) ||
      (k->type == ConfigType::kFloat && std::holds_alternative<double>(value)) ||
      (k->type == ConfigType::kBool && std::holds_alternative<bool>(value)) ||
      (k->type == ConfigType::kString && std::holds_alternative<std::string>(value)) ||
      (k->type == ConfigType::kStringList && std::holds_alternative<StringList>(value)) ||
      (k->type == ConfigType::kStringListList &&
       std::holds_alternative<StringListList>(value)) ||
      (k->type == ConfigType::kFloatList && std::holds_alternative<FloatList>(value));
  VIADUCT_CHECK_T(ConfigError, ok, "key '", dotted, "' must be ",
                  type_name(k->type));
  values_[dotted] = std::move(value);
  explicit_[dotted] = true;
  sources_[dotted] = "a program";
}

void Config::apply_override(const std::string& assignment,
                            const std::string& origin) {
  const auto eq = assignment.find('=');
  VIADUCT_CHECK_T(ConfigError, eq != std::string::npos,
                  "override '", assignment, "' (", origin,
                  ") must look like section.key=value");
  std::string dotted = assignment.substr(0, eq);
  const std::string text = assignment.substr(eq + 1);
  const auto alias = config_aliases().find(dotted);
  if (alias != config_aliases().end()) {
    log::warn("config key '", dotted, "' is deprecated; use '", alias->second,
              "' (", origin, ")");
    dotted = alias->second;
  }
  const ConfigKey& key = user_key(dotted, origin);
  values_[dotted] = finite_numbers(from_text(text, key, origin), key, origin);
  explicit_[dotted] = true;
  sources_[dotted] = origin;
}

std::string Config::source(const std::string& key) const {
  auto it = sources_.find(key);
  return it == sources_.end() ? "the default" : it->second;
}

Config Config::parse(const std::string& text, const std::string& origin,
                     const std::vector<std::string>& overrides) {
  Config cfg;
  cfg.origin_ = origin;
  toml::table root;
  try {
    root = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    const auto& src = e.source();
    throw ConfigError(str("cannot parse ", origin, " at line ", src.begin.line,
                          ", column ", src.begin.column, ": ", e.description()));
  }
  std::set<std::string> seen_aliases;
  for (const auto& [sec_key, sec_node] : root) {
    const std::string section(sec_key.str());
    if (!sec_node.is_table()) {
      throw ConfigError(str("top-level key '", section, "' in ", origin,
                            " must be a [section] table (did you mean '",
                            closest_key(section), "'?)"));
    }
    for (const auto& [name_key, node] : *sec_node.as_table()) {
      std::string dotted = section + "." + std::string(name_key.str());
      const auto alias = config_aliases().find(dotted);
      if (alias != config_aliases().end()) {
        // The new name given too (before or after) is an error.
        const auto dot = alias->second.find('.');
        const auto* new_sec = root.get(alias->second.substr(0, dot));
        const bool both = new_sec && new_sec->is_table() &&
                          new_sec->as_table()->contains(alias->second.substr(dot + 1));
        VIADUCT_CHECK_T(ConfigError, !both, origin, " gives both '", dotted,
                        "' (deprecated) and its new name '", alias->second,
                        "'; keep only '", alias->second, "'");
        log::warn("config key '", dotted, "' in ", origin,
                  " is deprecated; use '", alias->second, "'");
        dotted = alias->second;
      }
      const ConfigKey& key = user_key(dotted, origin);
      cfg.values_[dotted] = finite_numbers(from_toml(node, key, origin), key, origin);
      cfg.explicit_[dotted] = true;
      cfg.sources_[dotted] = origin;
    }
  }
  // A deprecated name and its new name both on the command line is an error.
  // One key given twice with two values keeps the last (scripts append to a
  // base command line), said in a warning.
  std::set<std::string> given;
  std::map<std::string, std::string> last_value;
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    const std::string name = o.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : o.substr(eq + 1);
    const auto [it, fresh] = last_value.emplace(name, value);
    if (!fresh && it->second != value) {
      log::warn("the command line gives '--", name, "' twice ('", it->second, "', then '",
                value, "'); using the last, '", value, "'");
      it->second = value;
    }
    given.insert(name);
  }
  for (const auto& [old_key, new_key] : config_aliases()) {
    VIADUCT_CHECK_T(ConfigError, !(given.count(old_key) && given.count(new_key)),
                    "the command line gives both '--", old_key,
                    "' (deprecated) and its new name '--", new_key,
                    "'; keep only '--", new_key, "'");
  }
  for (const auto& o : overrides) cfg.apply_override(o, "the command line");
  // A key given on the command line replaces the file's value of the key it
  // supersedes (ConfigKey::replaced_by): `--data.paths` over a config file's
  // data.path. Both in the file, or both on the command line, is an error
  // (validate).
  for (const auto& k : config_schema()) {
    const std::string key = k.dotted();
    if (k.replaced_by.empty() || !given.count(k.replaced_by) || given.count(key) ||
        !cfg.is_set(key) || !has_content(cfg.values_.at(k.replaced_by))) {
      continue;
    }
    log::info(key, " of ", cfg.source(key), " gives way to ", k.replaced_by,
              " from the command line");
    cfg.values_[key] = k.default_value;
    cfg.explicit_.erase(key);
    cfg.sources_.erase(key);
  }
  // Deprecated spellings of several keys together (schema.cpp).
  for (const auto& d : config_deprecated_spellings()) {
    bool given = true;
    for (const auto& [key, value] : d.given) given = given && cfg.get_string(key) == value;
    if (!given) continue;
    std::string was, now;
    for (const auto& [key, value] : d.given) {
      was += str(was.empty() ? "" : " with ", key, " = \"", value, "\"");
    }
    for (const auto& [key, value] : d.becomes) {
      now += str(now.empty() ? "" : ", ", key, " = \"", value, "\"");
      cfg.values_[key] = value;
      cfg.explicit_[key] = true;
      cfg.sources_[key] = origin;
    }
    log::warn(was, " (", origin, ") is deprecated; write ", now);
  }
  // The warmup never outlasts the run (a short smoke run of a long job's
  // config is common); an explicit longer one is clamped with a warning.
  {
    const auto steps = cfg.get_int("training.steps");
    const auto warmup = cfg.get_int("lr_scheduler.warmup_steps");
    if (warmup > steps) {
      if (cfg.is_set("lr_scheduler.warmup_steps")) {
        log::warn("lr_scheduler.warmup_steps (", warmup,
                  ") exceeds training.steps (", steps, "); using ", steps);
      }
      cfg.values_["lr_scheduler.warmup_steps"] = steps;
    }
  }
  cfg.validate();
  return cfg;
}

Config Config::load(const std::string& path,
                    const std::vector<std::string>& overrides) {
  if (path.empty()) return parse("", "<defaults>", overrides);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    std::vector<std::string> tomls;
    for (const auto& de : std::filesystem::directory_iterator(path, ec)) {
      if (de.path().extension() == ".toml") tomls.push_back(de.path().string());
    }
    std::sort(tomls.begin(), tomls.end());
    std::string hint;
    for (const auto& t : tomls) hint += (hint.empty() ? " (one of: " : ", ") + t;
    if (!hint.empty()) hint += ")";
    throw ConfigError(str("--config '", path, "' is a folder; give a config file", hint));
  }
  std::ifstream in(path, std::ios::binary);
  VIADUCT_CHECK_T(ConfigError, in.good(), "cannot open config file '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  VIADUCT_CHECK_T(ConfigError, !in.bad(), "cannot read config file '", path, "'");
  return parse(ss.str(), path, overrides);
}

void Config::validate() const {
  // Every numeric key's range (the schema's), before the cross-field checks.
  for (const auto& k : config_schema()) {
    if (k.range.empty()) continue;
    const auto v = numeric_value(values_.at(k.dotted()));
    if (!v || k.range.contains(*v)) continue;
    throw ConfigError(str(k.dotted(), " = ", value_to_toml(values_.at(k.dotted())), " (from ",
                          source(k.dotted()), ") is out of range: it must be ",
                          k.range.lo && k.range.hi ? "in " : "", k.range.text()));
  }
  // Keys replaced by another (ConfigKey::replaced_by): never both.
  for (const auto& k : config_schema()) {
    if (k.replaced_by.empty() || !is_set(k.dotted())) continue;
    const auto& other = values_.at(k.replaced_by);
    if (!has_content(other)) continue;
    throw ConfigError(str(k.dotted(), " = ", value_to_toml(values_.at(k.dotted())), " (from ",
                          source(k.dotted()), ") and ", k.replaced_by, " = ",
                          value_to_toml(other), " (from ", source(k.replaced_by),
                          ") are mutually exclusive: give only one of them"));
  }
  validate_core(*this);
  validate_data(*this);
  validate_parallelism(*this);
}

bool Config::is_set(const std::string& key) const {
  auto it = explicit_.find(key);
  return it != explicit_.end() && it->second;
}

bool Config::differs_from_default(const std::string& key) const {
  if (!is_set(key)) return false;
  const ConfigKey* k = find_key(key);
  const auto it = values_.find(key);
  return k == nullptr || it == values_.end() || !(it->second == k->default_value);
}

namespace {
template <typename T>
const T* get_typed(const std::map<std::string, ConfigValue>& values,
                   const std::string& key) {
  auto it = values.find(key);
  VIADUCT_ASSERT(it != values.end(), "no config key ", key);
  if (std::holds_alternative<std::monostate>(it->second)) return nullptr;
  const T* v = std::get_if<T>(&it->second);
  VIADUCT_ASSERT(v != nullptr, "config key ", key, " read with the wrong type");
  return v;
}
template <typename T>
T get_required(const std::map<std::string, ConfigValue>& values,
               const std::string& key) {
  const T* v = get_typed<T>(values, key);
  VIADUCT_CHECK_T(ConfigError, v != nullptr, "config key '", key,
                  "' is not set and has no default");
  return *v;
}
}  // namespace

int64_t Config::get_int(const std::string& k) const { return get_required<int64_t>(values_, k); }
double Config::get_float(const std::string& k) const { return get_required<double>(values_, k); }
bool Config::get_bool(const std::string& k) const { return get_required<bool>(values_, k); }
std::string Config::get_string(const std::string& k) const { return get_required<std::string>(values_, k); }
StringList Config::get_string_list(const std::string& k) const { return get_required<StringList>(values_, k); }
StringListList Config::get_string_list_list(const std::string& k) const {
  return get_required<StringListList>(values_, k);
}
FloatList Config::get_float_list(const std::string& k) const {
  return get_required<FloatList>(values_, k);
}
std::optional<int64_t> Config::get_int_opt(const std::string& k) const {
  const auto* v = get_typed<int64_t>(values_, k);
  return v ? std::optional<int64_t>(*v) : std::nullopt;
}
std::optional<double> Config::get_float_opt(const std::string& k) const {
  const auto* v = get_typed<double>(values_, k);
  return v ? std::optional<double>(*v) : std::nullopt;
}
std::optional<bool> Config::get_bool_opt(const std::string& k) const {
  const auto* v = get_typed<bool>(values_, k);
  return v ? std::optional<bool>(*v) : std::nullopt;
}

std::string Config::to_toml() const {
  std::ostringstream os;
  os << "# effective config (from " << origin_ << ")\n";
  std::string section;
  for (const auto& k : config_schema()) {
    if (k.section != section) {
      os << (section.empty() ? "" : "\n") << '[' << k.section << "]\n";
      section = k.section;
    }
    const auto& v = values_.at(k.dotted());
    if (std::holds_alternative<std::monostate>(v)) {
      os << "# " << k.name << " = (unset: " << k.help << ")\n";
    } else if (!k.replaced_by.empty() && has_content(values_.at(k.replaced_by))) {
      // Not in effect: a comment, so the text parses back without a conflict.
      os << "# " << k.name << " = " << value_to_toml(v) << "  (not in effect: "
         << k.replaced_by << " is set)\n";
    } else {
      os << k.name << " = " << value_to_toml(v) << '\n';
    }
  }
  return os.str();
}

ParsedArgs parse_command_line(int argc, char** argv, int first,
                              const std::vector<std::string>& valued_options) {
  ParsedArgs out;
  auto takes_value = [&](const std::string& name) {
    return std::find(valued_options.begin(), valued_options.end(), name) !=
           valued_options.end();
  };
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
      out.positional.push_back(a);
      continue;
    }
    std::string name = a, value;
    bool has_value = false;
    if (auto eq = a.find('='); eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
      has_value = true;
    }
    if (name == "--config" || name == "--job.config_file") {
      if (!has_value) {
        VIADUCT_CHECK_T(ConfigError, i + 1 < argc, "--config needs a file");
        value = argv[++i];
      }
      // One file: a second one would silently replace the first.
      VIADUCT_CHECK_T(ConfigError, out.config_path.empty(), "--config given twice ('",
                      out.config_path, "' and '", value,
                      "'); give one file and put other settings on the command line as "
                      "--section.key=value");
      out.config_path = value;
    } else if (name.find('.') != std::string::npos) {
      if (!has_value) {
        VIADUCT_CHECK_T(ConfigError, i + 1 < argc, name, " needs a value");
        value = argv[++i];
      }
      out.overrides.push_back(name.substr(2) + "=" + value);
    } else if (takes_value(name)) {
      if (!has_value) {
        VIADUCT_CHECK_T(ConfigError, i + 1 < argc, name, " needs a value");
        value = argv[++i];
      }
      out.options[name] = value;
    } else {
      VIADUCT_CHECK_T(ConfigError, !has_value, "option ", name,
                      " takes no value");
      out.flags.push_back(name);
    }
  }
  return out;
}

}  // namespace viaduct
