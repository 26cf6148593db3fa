#pragma once

// Batched matrix products on any device, for the drivers' GEMMs, through PyTorch's C shim: its
// per-device entry points (aoti_torch_cpu_bmm_out, aoti_torch_cuda_bmm_out, ...) run the device's
// kernel directly, below the dispatcher, so that a call from one of this library's worker threads,
// which do not carry the caller's thread-local state (inference mode, say), runs as it would on
// the caller's. The CPU's are in every torch; the CUDA build registers CUDA's
// (register_cuda_matrix_products), whose symbols only a torch with CUDA has.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>

namespace deformconv {

struct MatrixProducts {
  AOTITorchError (*bmm_out)(AtenTensorHandle out, AtenTensorHandle self, AtenTensorHandle mat2);
  AOTITorchError (*baddbmm_out)(AtenTensorHandle out, AtenTensorHandle self,
                                AtenTensorHandle batch1, AtenTensorHandle batch2, double beta,
                                double alpha);
};

void register_cuda_matrix_products(const MatrixProducts& products);

// out = batch1 @ batch2, matrix by matrix; out may be strided.
void bmm_out(const torch::stable::Tensor& out, const torch::stable::Tensor& batch1,
             const torch::stable::Tensor& batch2);

// out = self + batch1 @ batch2, self broadcast to out's shape; self may be out itself.
void baddbmm_out(const torch::stable::Tensor& out, const torch::stable::Tensor& self,
                 const torch::stable::Tensor& batch1, const torch::stable::Tensor& batch2);

}  // namespace deformconv
