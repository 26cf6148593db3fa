#pragma once

// Argument errors. Every bad argument, a wrong dtype included, throws std::invalid_argument,
// which PyTorch raises in Python as ValueError with the message alone, and LibTorch passes on
// as it is. Not c10::Error: its types live in libtorch's C++ ABI, which the library does not
// depend on, and a kernel can raise no TypeError through the ABI that it does depend on
// (PyTorch's stable ABI).

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace deformconv {

template <typename... Parts>
[[noreturn]] void throw_argument_error(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::invalid_argument(message.str());
}

}  // namespace deformconv

// Throws std::invalid_argument with the parts of the message, streamed one after the other,
// unless condition holds.
#define DEFORMCONV_CHECK_ARGUMENT(condition, ...)           \
  do {                                                      \
    if (!(condition)) {                                     \
      ::deformconv::throw_argument_error(__VA_ARGS__);      \
    }                                                       \
  } while (false)

namespace deformconv {

// A backward op's output_mask, one entry per gradient: the schema's bool[N] reaches the
// kernels as a list of any length.
inline void check_output_mask(const char* op, const std::vector<bool>& output_mask,
                              size_t gradients) {
  DEFORMCONV_CHECK_ARGUMENT(output_mask.size() == gradients, op, ": expected output_mask to have ",
                            gradients, " entries, but got ", output_mask.size());
}

}  // namespace deformconv
