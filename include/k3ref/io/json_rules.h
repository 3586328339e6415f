// The JSON rules every reader of the project's files shares (k3ref._bounded in Python): no
// byte-order mark, no value nested deeper than a limit, at most so many values, no key twice
// in one object (nlohmann keeps the last silently) and, where the keys are names messages
// quote, no control character in a key. One SAX pass checks them before any document is
// built, so no deep or huge value reaches a recursive copy, dump or destructor.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace k3ref::io {

struct JsonRules {
  int max_depth = 64;
  std::size_t max_values = static_cast<std::size_t>(-1);
  bool printable_keys = true;  // refuse keys holding a character io::printable would escape
};

// What a broken rule is, for each reader to word in its own voice.
struct JsonRuleBreak {
  enum class Kind { none, byte_order_mark, invalid, too_deep, too_many_values, duplicate_key, control_key };
  Kind kind = Kind::none;
  std::string detail;  // the parser's message (invalid), the key (duplicate_key, control_key)
  explicit operator bool() const { return kind != Kind::none; }
};

JsonRuleBreak check_json_rules(std::string_view text, const JsonRules& rules);

}  // namespace k3ref::io
