// The CPU stages of DCN v1/v2, one file per stage (deform_conv2d_im2col_cpu.cpp,
// deform_conv2d_fused_forward_cpu.cpp, deform_conv2d_col2im_cpu.cpp,
// deform_conv2d_transpose_cpu.cpp), which deform_conv2d_cpu.cpp gathers into the CPU's launcher
// table (core/deform_conv2d_launchers.h says what each does) with the parts of
// deform_conv2d_single_copy_cpu.h.
//
// Declarations only, into the namespace of the copy being compiled: each kernel file's body
// includes this header once per copy (Note [CPU copies], cpu_copies.h), and its head includes
// what the declarations need (ATen's Tensor, core/deform_conv2d_launchers.h).

namespace deformconv::DEFORMCONV_CPU_COPY {

void make_plans_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                    const Tensor& offset, const Tensor& mask, Tensor& plans);

void im2col_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                const Tensor& input, const WindowSampling& sampling, Tensor& columns);

Tensor fused_forward_weight_cpu(const DeformConv2dGeometry& g, const Tensor& weight);

void fused_forward_cpu(const DeformConv2dGeometry& g, int64_t batch, const Tensor& input,
                       const Tensor& offset, const Tensor& mask, const Tensor& weight_panels,
                       const Tensor& bias, Tensor& output);

bool fused_forward_pays_cpu(const DeformConv2dGeometry& g, ScalarType dtype);

void column_gradients_cpu(const DeformConv2dGeometry& g, const PixelWindow& window, int64_t batch,
                          const Tensor& grad_columns, const Tensor& input,
                          const WindowSampling& sampling, Tensor& grad_input, Tensor& grad_offset,
                          Tensor& grad_mask, bool deterministic);

void transpose_cpu(const Tensor& src, Tensor& dst);

}  // namespace deformconv::DEFORMCONV_CPU_COPY
