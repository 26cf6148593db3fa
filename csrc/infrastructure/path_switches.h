#pragma once

// Note [Path switches]
// Three environment variables turn a launcher's fast path off, each when set to "0" (unset, or
// set to anything else, the launcher chooses as it always does): to compare the two paths in a
// benchmark, or to test the other path on shapes that would take the fast one. They are read at
// every call, so that a test can set them between calls. They stay out of the kernel files:
// each launcher asks here whether its path is switched off.
//   DEFORMCONV_INPUT_GRADIENT_BANDS  DCNv3/DCNv4's CUDA backward sums the input gradient in
//                                    bands of shared memory (cuda/dcnv3_gradient_bands.cuh)
//   DEFORMCONV_ONEDNN_GEMMS          DCN v1/v2's CPU GEMMs run as oneDNN convolutions
//                                    (cpu/deform_conv2d_onednn_gemms_cpu.cpp)
//   DEFORMCONV_FUSED_FORWARD         DCN v1/v2's CPU forward samples and multiplies in one
//                                    pass (cpu/deform_conv2d_fused_forward_cpu.cpp)

#include <cstdlib>
#include <string_view>

namespace deformconv {

inline bool switched_off(const char* variable) {
  const char* setting = std::getenv(variable);
  return setting != nullptr && std::string_view(setting) == "0";
}

inline bool input_gradient_bands_switched_off() {
  return switched_off("DEFORMCONV_INPUT_GRADIENT_BANDS");
}

inline bool onednn_gemms_switched_off() { return switched_off("DEFORMCONV_ONEDNN_GEMMS"); }

inline bool fused_forward_switched_off() { return switched_off("DEFORMCONV_FUSED_FORWARD"); }

}  // namespace deformconv
