#pragma once

// The parts of an operator schema string, read at compile time, for op_description.h: an op's
// name, its arguments (type and name, a default left out) and its results. A schema is
// "name(Type name, Type name=default, ...) -> Result" or "-> (Result, Result, ...)"; a default
// may hold brackets and a quoted string, whose commas and parentheses are not separators.

#include <cstddef>
#include <string_view>

namespace deformconv::schema_text {

inline constexpr size_t kNone = std::string_view::npos;

constexpr std::string_view trimmed(std::string_view text) {
  while (!text.empty() && text.front() == ' ') {
    text.remove_prefix(1);
  }
  while (!text.empty() && text.back() == ' ') {
    text.remove_suffix(1);
  }
  return text;
}

constexpr bool begins_with(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

// The place of the first `wanted` in text from `from` on that is outside brackets, parentheses
// and quotes, or kNone.
constexpr size_t find_outside(std::string_view text, char wanted, size_t from = 0) {
  int depth = 0;
  bool quoted = false;
  for (size_t place = from; place < text.size(); ++place) {
    const char c = text[place];
    if (quoted) {
      quoted = c != '"';
    } else if (c == wanted && depth == 0) {
      return place;
    } else if (c == '"') {
      quoted = true;
    } else if (c == '[' || c == '(') {
      ++depth;
    } else if (c == ']' || c == ')') {
      --depth;
    }
  }
  return kNone;
}

// A comma-separated list's items.
constexpr size_t item_count(std::string_view list) {
  if (trimmed(list).empty()) {
    return 0;
  }
  size_t count = 1;
  for (size_t comma = find_outside(list, ','); comma != kNone;
       comma = find_outside(list, ',', comma + 1)) {
    ++count;
  }
  return count;
}

constexpr std::string_view item(std::string_view list, size_t index) {
  size_t begin = 0;
  for (size_t skipped = 0; skipped < index; ++skipped) {
    begin = find_outside(list, ',', begin) + 1;
  }
  const size_t end = find_outside(list, ',', begin);
  return trimmed(list.substr(begin, end == kNone ? kNone : end - begin));
}

constexpr std::string_view op_name(std::string_view schema) {
  return trimmed(schema.substr(0, schema.find('(')));
}

// The places of the argument list's parentheses.
constexpr size_t arguments_open(std::string_view schema) { return schema.find('('); }

constexpr size_t arguments_close(std::string_view schema) {
  return find_outside(schema, ')', arguments_open(schema) + 1);
}

constexpr std::string_view arguments(std::string_view schema) {
  const size_t open = arguments_open(schema);
  return schema.substr(open + 1, arguments_close(schema) - open - 1);
}

// What follows "->": one result, or a parenthesised list.
constexpr std::string_view results(std::string_view schema) {
  const std::string_view after =
      trimmed(schema.substr(schema.find("->", arguments_close(schema)) + 2));
  return after.front() == '(' ? after.substr(1, after.size() - 2) : after;
}

struct Argument {
  std::string_view type;
  std::string_view name;
};

constexpr size_t argument_count(std::string_view schema) { return item_count(arguments(schema)); }

constexpr Argument argument(std::string_view schema, size_t index) {
  std::string_view text = item(arguments(schema), index);
  text = trimmed(text.substr(0, find_outside(text, '=')));
  const size_t space = text.rfind(' ');
  return {text.substr(0, space), text.substr(space + 1)};
}

constexpr size_t result_count(std::string_view schema) { return item_count(results(schema)); }

constexpr std::string_view result(std::string_view schema, size_t index) {
  return item(results(schema), index);
}

// N of a list type "T[N]", or kNone where it gives no length.
constexpr size_t list_length(std::string_view type) {
  const size_t open = type.find('[');
  if (open == kNone || type[open + 1] == ']') {
    return kNone;
  }
  size_t length = 0;
  for (size_t place = open + 1; type[place] != ']'; ++place) {
    length = length * 10 + static_cast<size_t>(type[place] - '0');
  }
  return length;
}

}  // namespace deformconv::schema_text
