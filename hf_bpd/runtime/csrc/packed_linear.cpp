// Row-invariant linear layers for bf16 and int8-weight bases on CPUs with AVX512-BF16 (hf_bpd.runtime.packed_linear).
//
// y = x @ W^T for bf16 activations x (M, K) and a weight W (N, K) stored as bf16, or as int8 with one bf16 scale per
// output row, packed as (N / 16, K / 2, 16, 2): one 64-byte vector holds 16 outputs' weights for a pair of inputs.
// Each output sums its K products in one SIMD lane, pair after pair (vdpbf16ps), from zero: the same instructions in
// the same order whatever the number of rows M and however the rows are split into register tiles. A block's row is
// therefore bit-identical to the same row computed alone, which is what makes drafting exact in half precision.
// Rounding points follow the eager layers: bf16 (+ bias) -> bf16 for nn.Linear; for int8 weights, as
// Int8WeightLinear: bf16(sum) * scale -> bf16, + bias -> bf16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kLanes = 16;  // outputs per packed block

inline __m512bh load_weights(const uint16_t* w) {
    return (__m512bh)_mm512_loadu_si512(w);
}

inline __m512bh load_weights(const int8_t* w) {  // 32 int8 -> 32 bf16, exact (|w| <= 127)
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

inline float bf16_to_float(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

inline __m512 round_bf16(__m512 v) {  // fp32 -> bf16 (round to nearest even) -> fp32
    __m256bh h = _mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

// MR rows x NB blocks of 16 outputs: accumulate over all K/2 pairs, then round and store.
template <int MR, int NB, typename W>
inline void tile(const uint32_t* x, int64_t ldx, const W* w, int64_t block_stride, int64_t pairs,
                 const float* scale, const float* bias, uint16_t* y, int64_t ldy) {
    __m512 acc[MR][NB];
    for (int m = 0; m < MR; ++m)
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < pairs; ++k) {
        __m512bh wv[NB];
        for (int b = 0; b < NB; ++b) wv[b] = load_weights(w + b * block_stride + k * 2 * kLanes);
        for (int m = 0; m < MR; ++m) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + k]));
            for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
        }
    }
    for (int b = 0; b < NB; ++b) {
        __m512 s = scale ? _mm512_loadu_ps(scale + b * kLanes) : _mm512_setzero_ps();
        __m512 c = bias ? _mm512_loadu_ps(bias + b * kLanes) : _mm512_setzero_ps();
        for (int m = 0; m < MR; ++m) {
            __m512 v = acc[m][b];
            if (scale) v = round_bf16(_mm512_mul_ps(round_bf16(v), s));
            if (bias) v = _mm512_add_ps(v, c);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + b * kLanes), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

template <int NB, typename W>
void rows_tile(int64_t rows, const uint32_t* x, int64_t ldx, const W* w, int64_t block_stride, int64_t pairs,
               const float* scale, const float* bias, uint16_t* y, int64_t ldy) {
    constexpr int MR = NB >= 4 ? 4 : 8;
    int64_t m = 0;
    for (; m + MR <= rows; m += MR)
        tile<MR, NB>(x + m * ldx, ldx, w, block_stride, pairs, scale, bias, y + m * ldy, ldy);
    switch (rows - m) {
#define HF_BPD_TAIL(R) \
    case R: tile<R, NB>(x + m * ldx, ldx, w, block_stride, pairs, scale, bias, y + m * ldy, ldy); break;
        HF_BPD_TAIL(1) HF_BPD_TAIL(2) HF_BPD_TAIL(3) HF_BPD_TAIL(4) HF_BPD_TAIL(5) HF_BPD_TAIL(6) HF_BPD_TAIL(7)
#undef HF_BPD_TAIL
        default: break;
    }
}

template <typename W>
void run(int64_t rows, const uint32_t* x, int64_t pairs, const W* w, int64_t blocks, const float* scale,
         const float* bias, uint16_t* y, int64_t n) {
    const int64_t block_stride = pairs * 2 * kLanes;  // elements per packed block
    const int nb = rows <= 4 ? 4 : 2;                 // blocks per tile: <= 16 accumulators
    const int64_t groups = (blocks + nb - 1) / nb;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; ++g) {
            const int64_t b0 = g * nb;
            const int64_t count = std::min<int64_t>(nb, blocks - b0);
            const W* wg = w + b0 * block_stride;
            const float* sg = scale ? scale + b0 * kLanes : nullptr;
            const float* cg = bias ? bias + b0 * kLanes : nullptr;
            uint16_t* yg = y + b0 * kLanes;
            if (count == 4) rows_tile<4>(rows, x, pairs, wg, block_stride, pairs, sg, cg, yg, n);
            else if (count == 2) rows_tile<2>(rows, x, pairs, wg, block_stride, pairs, sg, cg, yg, n);
            else {
                for (int64_t b = 0; b < count; ++b)
                    rows_tile<1>(rows, x, pairs, wg + b * block_stride, block_stride, pairs,
                                 sg ? sg + b * kLanes : nullptr, cg ? cg + b * kLanes : nullptr, yg + b * kLanes, n);
            }
        }
    });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "packed_linear: x must be bf16, got ", x.scalar_type());
    TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == 2 && packed.is_contiguous(),
                "packed_linear: the weight must be packed as (N / 16, K / 2, 16, 2)");
    const int64_t blocks = packed.size(0), pairs = packed.size(1), k = pairs * 2, n = blocks * kLanes;
    TORCH_CHECK(x.size(-1) == k, "packed_linear: x has ", x.size(-1), " features, the weight ", k);
    const bool int8 = packed.scalar_type() == at::kChar;
    TORCH_CHECK(int8 || packed.scalar_type() == at::kBFloat16, "packed_linear: the weight must be bf16 or int8");
    TORCH_CHECK(int8 == (scale.has_value() && scale->defined()), "packed_linear: int8 weights take a scale, bf16 none");
    auto lead = x.sizes().vec();
    lead.pop_back();
    at::Tensor rows = x.reshape({-1, k}).contiguous();
    const int64_t m = rows.size(0);
    auto out_sizes = lead;
    out_sizes.push_back(n);
    at::Tensor y = at::empty({m, n}, x.options());
    at::Tensor s, c;  // fp32 (PackedLinear stores them so: a conversion per call cost ~1 ms per SmolLM2 step)
    if (int8) s = scale->scalar_type() == at::kFloat ? scale->contiguous() : scale->to(at::kFloat).contiguous();
    if (bias.has_value() && bias->defined())
        c = bias->scalar_type() == at::kFloat ? bias->contiguous() : bias->to(at::kFloat).contiguous();
    if (m > 0) {
        const auto* xp = reinterpret_cast<const uint32_t*>(rows.data_ptr<at::BFloat16>());
        auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
        const float* sp = int8 ? s.data_ptr<float>() : nullptr;
        const float* cp = c.defined() ? c.data_ptr<float>() : nullptr;
        if (int8) run(m, xp, pairs, packed.data_ptr<int8_t>(), blocks, sp, cp, yp, n);
        else run(m, xp, pairs, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), blocks, sp, cp, yp, n);
    }
    return y.view(out_sizes);
}

}  // namespace

TORCH_LIBRARY(hf_bpd_kernels, m) {
    m.def("packed_linear(Tensor x, Tensor packed, Tensor? scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_bpd_kernels, CPU, m) {
    m.impl("packed_linear", &packed_linear);
}
