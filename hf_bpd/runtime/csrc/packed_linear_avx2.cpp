// Row-invariant linear layers for bf16 and int8-weight bases on CPUs with AVX2 and FMA but no AVX512-BF16
// (hf_bpd.runtime.packed_linear): the same operator, weight layout and rounding points as csrc/packed_linear.cpp.
//
// y = x @ W^T for bf16 activations x (M, K) and a weight W (N, K) stored as bf16, or as int8 with one scale per output
// row, packed as (N / 16, K / 2, 16, 2). A 32-byte half of a packed block holds 8 outputs' weights for a pair of
// inputs; its even and odd inputs are widened to fp32 exactly (bf16: a shift or a mask; int8: sign extension). Each
// output sums its K products in one SIMD lane from zero, input after input (two FMAs per pair), whatever the number
// of rows M and however the rows are split into register tiles: a block's row is bit-identical to the same row
// computed alone. The sums differ from the AVX512-BF16 kernel's (vdpbf16ps rounds otherwise), so a base decodes
// exactly against its plain decoding on the same machine, as everywhere.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernel_inputs.h"

#include <algorithm>
#include <cstdint>
#include <string>

namespace {

constexpr int64_t kLanes = hf_bpd::kPackedLanes;  // outputs per packed block (two 8-lane halves)

struct Pair {
    __m256 even, odd;  // 8 outputs' weights for inputs 2k and 2k + 1, as fp32
};

inline Pair widen(const uint16_t* w) {  // 8 outputs x 2 bf16 inputs
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}

inline Pair widen(const int8_t* w) {  // 8 outputs x 2 int8 inputs, exact
    const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    return {_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16)),
            _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16))};
}

inline __m256i to_bf16_bits(__m256 v) {  // fp32 -> bf16 (round to nearest even) in the low 16 bits of each lane
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // NaN stays a (quiet) NaN
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40)), nan);
}

inline __m256 round_bf16(__m256 v) {  // fp32 -> bf16 -> fp32
    return _mm256_castsi256_ps(_mm256_slli_epi32(to_bf16_bits(v), 16));
}

inline void store_bf16(__m256 v, uint16_t* y) {  // 8 lanes -> 8 bf16
    const __m256i bits = to_bf16_bits(v);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), packed);
}

// One row's 8 sums -> bf16 outputs, rounding where the eager layer rounds (as csrc/packed_linear.cpp's `finish`).
inline void finish(__m256 v, const float* scale, const float* bias, uint16_t* y) {
    if (scale) v = round_bf16(_mm256_mul_ps(round_bf16(v), _mm256_loadu_ps(scale)));
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    store_bf16(v, y);
}

// MR rows x one block of 16 outputs (two halves): accumulate over all K/2 pairs, then round and store. `x` holds the
// rows' inputs as fp32 (row stride ldx).
template <int MR, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t pairs, const float* scale, const float* bias,
                 uint16_t* y, int64_t ldy) {
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < pairs; ++k) {
        const Pair lo = widen(w + k * 2 * kLanes), hi = widen(w + k * 2 * kLanes + kLanes);
        for (int m = 0; m < MR; ++m) {
            const __m256 even = _mm256_broadcast_ss(x + m * ldx + 2 * k);
            acc[m][0] = _mm256_fmadd_ps(even, lo.even, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(even, hi.even, acc[m][1]);
            const __m256 odd = _mm256_broadcast_ss(x + m * ldx + 2 * k + 1);
            acc[m][0] = _mm256_fmadd_ps(odd, lo.odd, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(odd, hi.odd, acc[m][1]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int h = 0; h < 2; ++h)
            finish(acc[m][h], scale ? scale + h * 8 : nullptr, bias ? bias + h * 8 : nullptr, y + m * ldy + h * 8);
}

template <typename W>
void block_rows(int64_t rows, const float* x, int64_t ldx, const W* w, int64_t pairs, const float* scale,
                const float* bias, uint16_t* y, int64_t ldy) {
    constexpr int MR = 4;  // 8 accumulators, 4 widened weight vectors and a broadcast input: 13 of 16 registers
    int64_t m = 0;
    for (; m + MR <= rows; m += MR) tile<MR>(x + m * ldx, ldx, w, pairs, scale, bias, y + m * ldy, ldy);
    switch (rows - m) {
        case 3: tile<3>(x + m * ldx, ldx, w, pairs, scale, bias, y + m * ldy, ldy); break;
        case 2: tile<2>(x + m * ldx, ldx, w, pairs, scale, bias, y + m * ldy, ldy); break;
        case 1: tile<1>(x + m * ldx, ldx, w, pairs, scale, bias, y + m * ldy, ldy); break;
        default: break;
    }
}

template <typename W>
void run(int64_t rows, const float* x, int64_t pairs, const W* w, int64_t blocks, const float* scale,
         const float* bias, uint16_t* y, int64_t n) {
    const int64_t block_stride = pairs * 2 * kLanes;  // elements per packed block
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b)
            block_rows(rows, x, pairs * 2, w + b * block_stride, pairs, scale ? scale + b * kLanes : nullptr,
                       bias ? bias + b * kLanes : nullptr, y + b * kLanes, n);
    });
}

std::string packed_linear_engine(const c10::optional<std::string>& choose) {
    TORCH_CHECK(!choose.has_value() || *choose == "avx2", "packed_linear_engine: this CPU runs 'avx2' only, got ",
                choose.value_or(""));
    return "avx2";
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias) {
    const hf_bpd::PackedInputs in = hf_bpd::packed_inputs(x, packed, scale, bias);
    const at::Tensor rows = in.rows.to(at::kFloat);  // bf16 -> fp32 is exact
    const int64_t m = rows.size(0);
    at::Tensor y = at::empty({m, in.n}, x.options());
    if (m > 0) {
        const float* xp = rows.data_ptr<float>();
        auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
        const float* sp = in.int8 ? in.scale.data_ptr<float>() : nullptr;
        const float* cp = in.bias.defined() ? in.bias.data_ptr<float>() : nullptr;
        if (in.int8) run(m, xp, in.pairs, packed.data_ptr<int8_t>(), in.blocks, sp, cp, yp, in.n);
        else run(m, xp, in.pairs, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), in.blocks, sp,
                 cp, yp, in.n);
    }
    return y.view(in.out_sizes);
}

}  // namespace

TORCH_LIBRARY(hf_bpd_kernels, m) {
    hf_bpd::define_packed_linear(m);
    m.def("packed_linear_engine(str? choose=None) -> str", &packed_linear_engine);
}

TORCH_LIBRARY_IMPL(hf_bpd_kernels, CPU, m) {
    m.impl("packed_linear", &packed_linear);
}
