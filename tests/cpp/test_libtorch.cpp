// A LibTorch program that uses deformconv through TorchScript: loads the model that
// make_fixture.py scripted, runs forward and backward in C++ (the autograd of the op is a C++
// kernel, so no Python is involved), and compares with the values Python computed.

#include <torch/script.h>
#include <torch/torch.h>

#include <iostream>
#include <string>

namespace {

bool check_close(const std::string& what, const torch::Tensor& actual,
                 const torch::Tensor& expected) {
  const bool ok = actual.sizes() == expected.sizes() &&
                  torch::allclose(actual, expected, /*rtol=*/1e-9, /*atol=*/1e-10);
  const double error = actual.sizes() == expected.sizes()
      ? (actual - expected).abs().max().item<double>()
      : -1.0;
  std::cout << (ok ? "ok   " : "FAIL ") << what << " (max abs error " << error << ")\n";
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " <fixture folder>\n";
    return 2;
  }
  const std::string folder = argv[1];
  torch::jit::Module model = torch::jit::load(folder + "/model.pt");
  torch::jit::Module fixture = torch::jit::load(folder + "/fixture.pt");
  const auto expected = [&](const char* name) { return fixture.attr(name).toTensor(); };

  const torch::Tensor input = expected("input").clone().requires_grad_(true);
  const torch::Tensor output = model.forward({input}).toTensor();
  output.pow(2).sum().backward();

  const auto parameter_grad = [&](const std::string& name) {
    for (const auto& parameter : model.named_parameters()) {
      if (parameter.name == name) return parameter.value.grad();
    }
    throw std::runtime_error("no parameter " + name);
  };

  bool ok = true;
  ok &= check_close("output", output, expected("expected_output"));
  ok &= check_close("input gradient", input.grad(), expected("expected_input_grad"));
  ok &= check_close("v2_pack.weight gradient", parameter_grad("v2_pack.weight"),
                    expected("expected_v2_pack_weight_grad"));
  ok &= check_close("v2_pack.conv_offset.weight gradient",
                    parameter_grad("v2_pack.conv_offset.weight"),
                    expected("expected_v2_pack_offset_weight_grad"));
  return ok ? 0 : 1;
}
