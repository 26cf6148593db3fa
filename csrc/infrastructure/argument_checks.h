#pragma once

// Argument errors. Every bad argument, a wrong dtype included, throws std::invalid_argument,
// which PyTorch raises in Python as ValueError with the message alone, and LibTorch passes on
// as it is. Not c10::Error: its types live in libtorch's C++ ABI, which the library does not
// depend on, and a kernel can raise no TypeError through the ABI that it does depend on
// (PyTorch's stable ABI).

#include <sstream>
#include <stdexcept>

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
