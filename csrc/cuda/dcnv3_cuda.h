#pragma once

// The CUDA launchers of DCNv3 (dcnv3_cuda.cu) and the CUDA kernels of its ops
// (ops_cuda.cpp), apart so that the test suite's CUDA emulation can run the kernels with the
// launchers.

#include <ATen/core/Tensor.h>

#include <array>
#include <tuple>

#include "../core/dcnv3.h"

namespace deformconv {

const Dcnv3Launchers& dcnv3_cuda_launchers();

// The ops' CUDA kernels (Dcnv3Forward, Dcnv3Backward), with dcnv3_cuda_launchers().
at::Tensor dcnv3_cuda(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,
                      const Dcnv3Arguments& args);

std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, const Dcnv3Arguments& args, std::array<bool, 3> output_mask);

}  // namespace deformconv
