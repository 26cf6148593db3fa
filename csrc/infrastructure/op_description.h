#pragma once

// Note [Op descriptions]
// Each op's argument list is written once in C++: in the schema strings of its description, a
// struct in its core header (DeformConv2dOp in core/deform_conv2d.h, Dcnv3Op and Dcnv4Op in
// core/dcnv3.h, MsDeformAttnOp in core/ms_deform_attn.h). A description gives
//   kName               the op's name in the deformconv namespace, and in messages;
//   kSchema             the op's schema, which returns one Tensor;
//   kBackwardSchema     its backward op's: Tensor grad_output, those of the op's arguments that
//                       it takes, by the op's names and types and in its order, then
//                       bool[N] output_mask and bool deterministic=False; returns N Tensors;
//   kGradientArguments  the places, among the op's arguments, of the N tensors whose gradients
//                       the backward op returns, in output_mask's order;
//   kChecksSchema       where the op has one, that of the op of its argument checks, which the
//                       fake kernels run (deformconv/ops/_common.py): Tensor? grad_output, then
//                       the op's arguments, by its names and in its order (a tensor may be
//                       optional there); returns int[], the output's shape.
// From the schemas, at compile time, come the C++ signatures in the stable ABI's types
// (OpSignature, OpBackwardSignature), the arguments' names in messages (kArgumentNames,
// kBackwardArgumentNames) and the places of the backward op's arguments (kBackwardArguments).
// DescriptionChecks<Op> checks, also at compile time, that the schemas agree as above, and
// register_device_kernels (device_kernels.h) that each driver takes exactly the op's signature
// after its launcher table: a schema and a description that disagree, or a driver whose
// parameters differ from the schema's in type or order, do not compile. The names of C++
// parameters are not checked (C++ cannot read them); those in messages are the schema's.

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "schema_text.h"
#include "stable_tensors.h"

namespace deformconv {
namespace op_description_detail {

// The schema types that the ops use.
enum class SchemaType { kTensor, kOptionalTensor, kInt, kFloat, kBool, kIntList, kBoolList,
                        kString, kOther };

constexpr SchemaType schema_type(std::string_view type) {
  using schema_text::begins_with;
  if (type == "Tensor") return SchemaType::kTensor;
  if (type == "Tensor?") return SchemaType::kOptionalTensor;
  if (type == "int" || type == "SymInt") return SchemaType::kInt;
  if (type == "float") return SchemaType::kFloat;
  if (type == "bool") return SchemaType::kBool;
  if (begins_with(type, "int[") || begins_with(type, "SymInt[")) return SchemaType::kIntList;
  if (begins_with(type, "bool[")) return SchemaType::kBoolList;
  if (type == "str") return SchemaType::kString;
  return SchemaType::kOther;
}

// Each type as a stable-ABI kernel takes it; kOther has none, so that a schema with another
// type does not compile.
template <SchemaType>
struct CppArgument;
template <>
struct CppArgument<SchemaType::kTensor> {
  using type = const Tensor&;
};
template <>
struct CppArgument<SchemaType::kOptionalTensor> {
  using type = const std::optional<Tensor>&;
};
template <>
struct CppArgument<SchemaType::kInt> {
  using type = int64_t;
};
template <>
struct CppArgument<SchemaType::kFloat> {
  using type = double;
};
template <>
struct CppArgument<SchemaType::kBool> {
  using type = bool;
};
template <>
struct CppArgument<SchemaType::kIntList> {
  using type = const std::vector<int64_t>&;
};
template <>
struct CppArgument<SchemaType::kBoolList> {
  using type = const std::vector<bool>&;
};
template <>
struct CppArgument<SchemaType::kString> {
  using type = const std::string&;
};

// A struct, not an alias template: nvcc's host pass replaces an alias that ignores its parameter
// with Tensor itself, which leaves the pack expansion below with no pack.
template <size_t>
struct AsTensor {
  using type = Tensor;
};

// The results: one Tensor, int[] (the checks ops'), or a tuple of Tensors.
template <const char* const* kSchema,
          typename Places = std::make_index_sequence<schema_text::result_count(*kSchema)>>
struct CppResult;

template <const char* const* kSchema, size_t... places>
struct CppResult<kSchema, std::index_sequence<places...>> {
  static constexpr std::string_view kFirst = schema_text::result(*kSchema, 0);
  using type = std::conditional_t<
      sizeof...(places) == 1 && kFirst == "Tensor", Tensor,
      std::conditional_t<sizeof...(places) == 1 && kFirst == "int[]", std::vector<int64_t>,
                         std::tuple<typename AsTensor<places>::type...>>>;
};

template <const char* const* kSchema,
          typename Places = std::make_index_sequence<schema_text::argument_count(*kSchema)>>
struct CppSignature;

template <const char* const* kSchema, size_t... places>
struct CppSignature<kSchema, std::index_sequence<places...>> {
  using type = typename CppResult<kSchema>::type(
      typename CppArgument<schema_type(schema_text::argument(*kSchema, places).type)>::type...);
};

template <const char* const* kSchema>
constexpr auto argument_names() {
  std::array<std::string_view, schema_text::argument_count(*kSchema)> names{};
  for (size_t place = 0; place < names.size(); ++place) {
    names[place] = schema_text::argument(*kSchema, place).name;
  }
  return names;
}

template <size_t count>
constexpr size_t place_of(const std::array<std::string_view, count>& names,
                          std::string_view name) {
  for (size_t place = 0; place < count; ++place) {
    if (names[place] == name) {
      return place;
    }
  }
  return schema_text::kNone;
}

// Whether text is the parts one after the other.
constexpr bool is_joined(std::string_view text, std::initializer_list<std::string_view> parts) {
  for (const std::string_view part : parts) {
    if (!schema_text::begins_with(text, part)) {
      return false;
    }
    text.remove_prefix(part.size());
  }
  return text.empty();
}

}  // namespace op_description_detail

// The C++ signatures of a schema, of an op and of its backward op.
template <const char* const* kSchema>
using SchemaSignature = typename op_description_detail::CppSignature<kSchema>::type;

template <typename Op>
using OpSignature = SchemaSignature<&Op::kSchema>;

template <typename Op>
using OpBackwardSignature = SchemaSignature<&Op::kBackwardSchema>;

template <typename Op>
inline constexpr auto kArgumentNames = op_description_detail::argument_names<&Op::kSchema>();

template <typename Op>
inline constexpr auto kBackwardArgumentNames =
    op_description_detail::argument_names<&Op::kBackwardSchema>();

// The places, among the op's arguments, of those that its backward op takes between grad_output
// and output_mask, in its order (kNone for a name that the op has not, which DescriptionChecks
// rejects).
template <typename Op>
inline constexpr auto kBackwardArguments = [] {
  constexpr auto& names = kBackwardArgumentNames<Op>;
  std::array<size_t, names.size() - 3> places{};
  for (size_t index = 0; index < places.size(); ++index) {
    places[index] = op_description_detail::place_of(kArgumentNames<Op>, names[index + 1]);
  }
  return places;
}();

namespace op_description_detail {

template <typename Op>
constexpr bool backward_arguments_are_the_ops() {
  size_t previous = 0;
  for (size_t index = 0; index < kBackwardArguments<Op>.size(); ++index) {
    const size_t place = kBackwardArguments<Op>[index];
    if (place == schema_text::kNone || (index > 0 && place <= previous) ||
        schema_text::argument(Op::kBackwardSchema, index + 1).type !=
            schema_text::argument(Op::kSchema, place).type) {
      return false;
    }
    previous = place;
  }
  return true;
}

template <typename Op>
constexpr bool gradients_are_of_tensors() {
  for (const size_t place : Op::kGradientArguments) {
    if (place >= kArgumentNames<Op>.size()) {
      return false;
    }
    const SchemaType type = schema_type(schema_text::argument(Op::kSchema, place).type);
    if (type != SchemaType::kTensor && type != SchemaType::kOptionalTensor) {
      return false;
    }
  }
  for (size_t slot = 0; slot < schema_text::result_count(Op::kBackwardSchema); ++slot) {
    if (schema_text::result(Op::kBackwardSchema, slot) != "Tensor") {
      return false;
    }
  }
  return schema_text::result_count(Op::kBackwardSchema) == Op::kGradientArguments.size();
}

template <typename Op>
constexpr bool checks_take_the_ops_arguments() {
  constexpr std::string_view schema = Op::kChecksSchema;
  const auto first = schema_text::argument(schema, 0);
  if (first.type != "Tensor?" || first.name != "grad_output" ||
      schema_text::argument_count(schema) != kArgumentNames<Op>.size() + 1 ||
      schema_text::results(schema) != "int[]") {
    return false;
  }
  for (size_t place = 0; place < kArgumentNames<Op>.size(); ++place) {
    const auto checks = schema_text::argument(schema, place + 1);
    const auto op = schema_text::argument(Op::kSchema, place);
    if (checks.name != op.name ||
        !(checks.type == op.type || (op.type == "Tensor" && checks.type == "Tensor?"))) {
      return false;
    }
  }
  return is_joined(schema_text::op_name(schema), {"_check_", Op::kName, "_arguments"});
}

template <typename Op, typename = void>
struct HasChecksSchema : std::false_type {};

template <typename Op>
struct HasChecksSchema<Op, std::void_t<decltype(Op::kChecksSchema)>> : std::true_type {};

}  // namespace op_description_detail

// The checks of Note [Op descriptions], at compile time; each failing one says what disagrees.
template <typename Op>
struct DescriptionChecks {
  static constexpr std::string_view kName = Op::kName;
  static_assert(schema_text::op_name(Op::kSchema) == kName,
                "kSchema is not the schema of the op that kName names");
  static_assert(op_description_detail::is_joined(schema_text::op_name(Op::kBackwardSchema),
                                                 {kName, "_backward"}),
                "kBackwardSchema is not that of the op kName followed by _backward");
  static_assert(schema_text::result_count(Op::kSchema) == 1 &&
                    schema_text::result(Op::kSchema, 0) == "Tensor",
                "kSchema does not return one Tensor");
  static_assert(kBackwardArgumentNames<Op>.size() >= 3 &&
                    schema_text::argument(Op::kBackwardSchema, 0).type == "Tensor" &&
                    kBackwardArgumentNames<Op>.front() == "grad_output",
                "kBackwardSchema does not begin with Tensor grad_output");
  static_assert(op_description_detail::backward_arguments_are_the_ops<Op>(),
                "kBackwardSchema's arguments after grad_output are not among kSchema's, with "
                "their names and types, in its order");
  static_assert(schema_text::argument(Op::kBackwardSchema, kBackwardArgumentNames<Op>.size() - 2)
                            .name == "output_mask" &&
                    schema_text::list_length(
                        schema_text::argument(Op::kBackwardSchema,
                                              kBackwardArgumentNames<Op>.size() - 2)
                            .type) == Op::kGradientArguments.size(),
                "kBackwardSchema's output_mask is not bool[N], N the size of kGradientArguments, "
                "before its last argument");
  static_assert(kBackwardArgumentNames<Op>.back() == "deterministic" &&
                    schema_text::argument(Op::kBackwardSchema,
                                          kBackwardArgumentNames<Op>.size() - 1)
                            .type == "bool",
                "kBackwardSchema does not end with bool deterministic");
  static_assert(op_description_detail::gradients_are_of_tensors<Op>(),
                "kGradientArguments are not places of kSchema's tensors, one for each Tensor "
                "that kBackwardSchema returns");
  static constexpr bool kChecked = [] {
    if constexpr (op_description_detail::HasChecksSchema<Op>::value) {
      static_assert(op_description_detail::checks_take_the_ops_arguments<Op>(),
                    "kChecksSchema is not _check_<kName>_arguments(Tensor? grad_output, then "
                    "kSchema's arguments by their names and in its order) -> int[]");
    }
    return true;
  }();
};

}  // namespace deformconv
