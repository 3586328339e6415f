#include "k3ref/io/json_rules.h"

#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "k3ref/io/file.h"

namespace k3ref::io {
namespace {

using json = nlohmann::json;

class RuleCheck final : public json::json_sax_t {
 public:
  explicit RuleCheck(const JsonRules& rules) : rules_(rules) {}
  JsonRuleBreak broken;

  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override { return open(); }
  bool start_array(std::size_t) override { return open(); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool key(string_t& key) override {
    if (rules_.printable_keys && printable(key) != key) return fail(JsonRuleBreak::Kind::control_key, key);
    if (!keys_.back().insert(key).second) return fail(JsonRuleBreak::Kind::duplicate_key, key);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const json::exception& e) override {
    return fail(JsonRuleBreak::Kind::invalid, e.what());
  }

 private:
  bool fail(JsonRuleBreak::Kind kind, std::string detail) {
    broken = {kind, std::move(detail)};
    return false;
  }
  bool value() {
    return ++values_ <= rules_.max_values || fail(JsonRuleBreak::Kind::too_many_values, "");
  }
  bool open() {
    keys_.emplace_back();  // an array's level holds no keys
    if (static_cast<int>(keys_.size()) > rules_.max_depth) return fail(JsonRuleBreak::Kind::too_deep, "");
    return value();
  }
  bool close() {
    keys_.pop_back();
    return true;
  }
  const JsonRules& rules_;
  std::vector<std::set<std::string>> keys_;
  std::size_t values_ = 0;
};

}  // namespace

JsonRuleBreak check_json_rules(std::string_view text, const JsonRules& rules) {
  if (text.substr(0, 3) == "\xEF\xBB\xBF") return {JsonRuleBreak::Kind::byte_order_mark, ""};  // nlohmann skips it
  RuleCheck check(rules);
  if (!json::sax_parse(text.begin(), text.end(), &check) && !check.broken)
    check.broken = {JsonRuleBreak::Kind::invalid, "not valid JSON"};
  return check.broken;
}

}  // namespace k3ref::io
