// A LibTorch program that runs the AOTInductor package that make_fixture.py compiled from the
// exported model (model.pt2), with deformconv linked: the package's code calls the ops through
// the dispatcher, which holds them once the library is loaded. Compares with the output Python
// computed in eager mode.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <iostream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " <fixture folder>\n";
    return 2;
  }
  const std::string folder = argv[1];
  torch::jit::Module fixture = torch::jit::load(folder + "/fixture.pt");
  const torch::Tensor input = fixture.attr("input").toTensor();
  const torch::Tensor expected = fixture.attr("expected_output").toTensor();

  torch::inductor::AOTIModelPackageLoader loader(folder + "/model.pt2");
  const std::vector<torch::Tensor> outputs = loader.run({input});
  if (outputs.size() != 1 || outputs[0].sizes() != expected.sizes()) {
    std::cout << "FAIL the package returned " << outputs.size() << " outputs, the first of shape "
              << (outputs.empty() ? torch::IntArrayRef() : outputs[0].sizes()) << ", expected "
              << expected.sizes() << "\n";
    return 1;
  }
  // Inductor compiles the elementwise ops around deformconv's into its own loops, which may
  // round differently from eager in the last bits of float64.
  const bool ok = torch::allclose(outputs[0], expected, /*rtol=*/1e-9, /*atol=*/1e-10);
  std::cout << (ok ? "ok   " : "FAIL ") << "AOTInductor package output (max abs error "
            << (outputs[0] - expected).abs().max().item<double>() << ")\n";
  return ok ? 0 : 1;
}
