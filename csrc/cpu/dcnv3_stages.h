// The CPU launchers of DCNv3 and DCNv4 (core/dcnv3.h's Dcnv3Launchers): the forward
// (dcnv3_forward_cpu.cpp) and the gradients (dcnv3_backward_cpu.cpp). Every task writes
// outputs of its own, so the results, the input gradient included, do not depend on the
// number of threads.
//
// Declarations only, into the namespace of the copy being compiled: each kernel file's body
// includes this header once per copy (Note [CPU copies], cpu_copies.h), and its head includes
// what the declarations need (core/dcnv3.h).

namespace deformconv::DEFORMCONV_CPU_COPY {

void dcnv3_forward_cpu(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                       const Tensor& input, const Tensor& offset, const Tensor& mask,
                       Tensor& output);

void dcnv3_gradients_cpu(const Dcnv3Geometry& g, const Dcnv3Fields& f, int64_t batch,
                         const Tensor& grad_output, const Tensor& input, const Tensor& offset,
                         const Tensor& mask, Tensor& grad_input, Tensor& grad_offset,
                         Tensor& grad_mask, bool deterministic);

}  // namespace deformconv::DEFORMCONV_CPU_COPY
