#include "matrix_products.h"

#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>

#include <stdexcept>
#include <string>

#include "tensor_text.h"

namespace deformconv {
namespace {

constexpr MatrixProducts kCpuProducts{aoti_torch_cpu_bmm_out, aoti_torch_cpu_baddbmm_out};

const MatrixProducts*& cuda_products() {
  static const MatrixProducts* products = nullptr;
  return products;
}

const MatrixProducts& products_for(const torch::stable::Tensor& tensor) {
  if (tensor.is_cpu()) {
    return kCpuProducts;
  }
  if (tensor.is_cuda() && cuda_products() != nullptr) {
    return *cuda_products();
  }
  throw std::logic_error("deformconv: no matrix products for tensors on " +
                         device_text(tensor.device()));
}

}  // namespace

void register_cuda_matrix_products(const MatrixProducts& products) { cuda_products() = &products; }

void bmm_out(const torch::stable::Tensor& out, const torch::stable::Tensor& batch1,
             const torch::stable::Tensor& batch2) {
  STABLE_TORCH_ERROR_CODE_CHECK(products_for(out).bmm_out(out.get(), batch1.get(), batch2.get()));
}

void baddbmm_out(const torch::stable::Tensor& out, const torch::stable::Tensor& self,
                 const torch::stable::Tensor& batch1, const torch::stable::Tensor& batch2) {
  STABLE_TORCH_ERROR_CODE_CHECK(
      products_for(out).baddbmm_out(out.get(), self.get(), batch1.get(), batch2.get(), 1.0, 1.0));
}

}  // namespace deformconv
