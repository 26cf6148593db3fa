// Note [Fused forward]
// The forward as im2col and GEMMs writes every sampled value to the columns, and the GEMM then
// reads them back (a BLAS packing them first), window by window, each stage a parallel region of
// its own; with conv groups, the GEMMs are many small products that a BLAS runs far below its
// speed. The fused forward writes no columns: a task samples one tap of a few blocks of pixels into
// a buffer that stays in the L1 cache, and at once adds the products of those values with the tap's
// weights into the pixels' output sums, which it writes when every tap is summed for its stretch of
// pixels. The whole forward of a block is one parallel region. Each output is summed over (tap,
// input channel) in that order, as the GEMM over a columns row sums it, whichever thread runs it.
// Each run of blocks reads the whole weight, in panels (Note [Weight panels], simd_blocks.h), which
// must stay in cache: the fused forward runs for weights up to 4 MiB (fused_forward_pays_cpu; about
// a core's L2 cache or its share of L3). ResNet's 512-channel stage (9 MiB) runs as GEMMs: fused,
// on a Zen 5 with a 32 MiB L3, one image ran level with the GEMMs in the AVX2 copy and 10% faster
// in the AVX-512 one, but 8 images, whose input shares the L3 with the weight, ran from 7% faster
// to 19% slower than the GEMMs in the AVX2 copy over three runs.

#if !defined(DEFORMCONV_CPU_COPY)  // the head (Note [CPU copies], cpu_copies.h)


#include <algorithm>
#include <cstdint>
#include <vector>

#include "../core/deform_conv2d_launchers.h"
#include "../infrastructure/path_switches.h"
#include "deform_conv2d_single_copy_cpu.h"
#include "simd_blocks.h"
#include "deform_conv2d_window_tasks.h"

#define DEFORMCONV_CPU_COPY_BODY "deform_conv2d_fused_forward_cpu.cpp"
#include "cpu_copies.h"

#else  // the body, once per copy

#include "deform_conv2d_stages.h"

namespace deformconv::DEFORMCONV_CPU_COPY {
namespace {

template <typename scalar_t>
struct FusedForwardTask {
  const DeformConv2dGeometry& g;
  PixelWindow image;  // every output pixel of an image
  PixelStretches stretches;
  const scalar_t* offset;
  const scalar_t* mask;
  const scalar_t* input;
  const opmath_type<scalar_t>* weight_panels;
  const scalar_t* bias;
  scalar_t* output;
};

// Tasks [begin, end) of the fused forward, task = a stretch of one image's output pixels, tap
// by tap: the tap's samples of every deform group are located at once, then sampled into
// `values` (pixel, input channel) a run of blocks of pixels at a time and multiplied into the
// sums, conv group by conv group, a panel of output channels for all the run's blocks at a
// time: Note [Fused forward].
template <int kVectorBytes, typename scalar_t>
void fused_forward_tasks(const FusedForwardTask<scalar_t>& t, int64_t begin, int64_t end) {
  using opmath_t = opmath_type<scalar_t>;
  const DeformConv2dGeometry& g = t.g;
  const int64_t in_per_offset_group = g.channels_per_offset_group();
  const int64_t in_per_group = g.channels_per_group();
  const int64_t out_per_group = g.out_channels / g.groups;
  const std::vector<scalar_t> zeros(g.in_channels, scalar_t(0));
  constexpr int64_t kBlockPixels = kFusedPixels<kVectorBytes>;
  // Blocks whose values are sampled at once: as many as fit in 16 KiB, at least one. Each
  // panel's slice then serves them all from the L1 cache, while their values stay there too:
  // sampled for the whole stretch, 64 KiB of 512 channels, the values went out to the L2 cache
  // and back, which a grouped convolution (few products per value) felt: the AVX-512 copy's
  // forward of the benchmark's grouped shape took 11.5-13.4 ms on 1 thread, 10.1-10.3 now.
  const int64_t run_blocks = std::max<int64_t>(
      1, 16384 / (kBlockPixels * g.in_channels * static_cast<int64_t>(sizeof(opmath_t))));
  // (run pixel, input channel) and (stretch pixel, output channel), for whole blocks of
  // pixels: a stretch's short last block (an image's last stretch) is multiplied as a whole
  // one, by the one register-blocked kernel, its missing pixels' values left from before and
  // their sums never stored.
  std::vector<opmath_t> values(run_blocks * kBlockPixels * g.in_channels);
  std::vector<opmath_t> sums(t.stretches.pixels * g.out_channels);
  std::vector<StretchSamples<opmath_t>> samples(g.offset_groups,
                                                StretchSamples<opmath_t>(g, t.stretches.pixels));
  for (int64_t task = begin; task < end; ++task) {
    const auto [n, first_pixel, pixels] = stretch_of(t.image, t.stretches, task);
    const scalar_t* image = channel_of(g, t.input, n, 0);
    const int64_t blocks = (pixels + kBlockPixels - 1) / kBlockPixels;
    std::fill(sums.begin(), sums.end(), opmath_t(0));
    for (StretchSamples<opmath_t>& group_samples : samples) {
      group_samples.start(g, first_pixel, pixels);
    }
    for (int64_t tap = 0; tap < g.taps(); ++tap) {
      for (int64_t group = 0; group < g.offset_groups; ++group) {
        samples[group].locate(g, n, group, tap, t.offset, t.mask);
      }
      for (int64_t first_block = 0; first_block < blocks; first_block += run_blocks) {
        const int64_t run = std::min(run_blocks, blocks - first_block);
        const int64_t run_pixel = first_block * kBlockPixels;
        const int64_t run_end = std::min(pixels, run_pixel + run * kBlockPixels);
        for (int64_t p = run_pixel; p < run_end; ++p) {
          for (int64_t group = 0; group < g.offset_groups; ++group) {
            const int64_t first = first_channel(g, group);
            opmath_t weight[4];
            const scalar_t* rows[4];
            samples[group].corner_rows(p, image + first, g.in_channels, zeros.data() + first,
                                       weight, rows);
            sum_corner_rows(rows, weight, in_per_offset_group,
                            values.data() + (p - run_pixel) * g.in_channels + first);
          }
        }
        for (int64_t conv_group = 0; conv_group < g.groups; ++conv_group) {
          multiply_add_blocks<kVectorBytes>(
              values.data() + conv_group * in_per_group, g.in_channels, run, in_per_group,
              t.weight_panels + (conv_group * g.taps() + tap) * in_per_group * out_per_group,
              out_per_group, sums.data() + run_pixel * g.out_channels + conv_group * out_per_group,
              g.out_channels);
        }
      }
    }
    store_sums(sums.data(), pixels, g.out_channels, t.bias,
               t.output + n * g.out_channels * g.out_pixels() + first_pixel, g.out_pixels());
  }
}

}  // namespace

// The weight (C_out, C_in / G, kh, kw) in panels (Note [Weight panels], simd_blocks.h) as wide
// as the registers of the copy that runs, in opmath_type, (conv group, tap) after (conv
// group, tap): scratch memory, kept from call to call, which a weight of megabytes would
// otherwise fault in afresh at every call.
Tensor fused_forward_weight_cpu(const DeformConv2dGeometry& g, const Tensor& weight) {
  const Tensor source = as_contiguous(weight);
  Tensor panels = scratch_cpu(weight, {weight.numel()}, opmath_dtype(weight.scalar_type()));
  const int64_t count = g.channels_per_group();
  const int64_t out_per_group = g.out_channels / g.groups;
  const int64_t taps = g.taps();
  DEFORMCONV_DISPATCH(weight.scalar_type(), "deform_conv2d_fused_forward_weight_cpu", [&] {
    using opmath_t = opmath_type<scalar_t>;
    const scalar_t* from = source.const_data_ptr<scalar_t>();
    opmath_t* to = panels.mutable_data_ptr<opmath_t>();
    with_register_bytes<kRegisterBytes>([&](auto register_bytes) {
      parallel_tasks(g.groups * taps, [&](int64_t begin, int64_t end) {
        for (int64_t matrix = begin; matrix < end; ++matrix) {
          const int64_t group = matrix / taps;
          const int64_t tap = matrix % taps;
          opmath_t* matrix_panels = to + matrix * count * out_per_group;
          for (int64_t first = 0; first < out_per_group;) {
            const int64_t width =
                weight_panel_width<register_bytes, opmath_t>(first, out_per_group);
            for (int64_t c = 0; c < count; ++c) {
              for (int64_t i = 0; i < width; ++i) {
                matrix_panels[first * count + c * width + i] = static_cast<opmath_t>(
                    from[((group * out_per_group + first + i) * count + c) * taps + tap]);
              }
            }
            first += width;
          }
        }
      });
    });
  });
  return panels;
}

void fused_forward_cpu(const DeformConv2dGeometry& g, int64_t batch, const Tensor& input,
                       const Tensor& offset, const Tensor& mask, const Tensor& weight_panels,
                       const Tensor& bias, Tensor& output) {
  const PixelWindow image{0, g.out_pixels()};
  DEFORMCONV_DISPATCH(input.scalar_type(), "deform_conv2d_fused_forward_cpu", [&] {
    // Multiply-adds as wide as a register of the copy that runs.
    with_register_bytes<kRegisterBytes>([&](auto register_bytes) {
      const PixelStretches stretches =
          pixel_stretches(g, image, kFusedPixels<register_bytes>);
      const FusedForwardTask<scalar_t> t{g,
                                         image,
                                         stretches,
                                         offset.const_data_ptr<scalar_t>(),
                                         data_or_null<scalar_t>(mask),
                                         input.const_data_ptr<scalar_t>(),
                                         weight_panels.const_data_ptr<opmath_type<scalar_t>>(),
                                         data_or_null<scalar_t>(bias),
                                         output.mutable_data_ptr<scalar_t>()};
      constexpr int64_t kWidth = register_bytes / sizeof(opmath_type<scalar_t>);
      record_channel_loops("deform_conv2d.cpu.fused_forward", g.out_channels / g.groups,
                           {2 * kWidth, kWidth});
      parallel_tasks(batch * stretches.per_image, [&](int64_t begin, int64_t end) {
        fused_forward_tasks<register_bytes>(t, begin, end);
      });
    });
  });
}

// Switched off (Note [Path switches]), every forward takes im2col and the GEMMs.
bool fused_forward_pays_cpu(const DeformConv2dGeometry& g, ScalarType dtype) {
  if (fused_forward_switched_off()) {
    return false;
  }
  constexpr int64_t kCachedWeightBytes = int64_t(4) << 20;
  const int64_t weight_bytes =
      g.out_channels * g.channels_per_group() * g.taps() * element_size(opmath_dtype(dtype));
  return weight_bytes <= kCachedWeightBytes;
}

}  // namespace deformconv::DEFORMCONV_CPU_COPY

#endif
