// Position-ordered attention on CPUs with AVX2 and FMA but no AVX512-BF16 (hf_bpd.runtime.ordered_attention): the
// same operator and semantics as csrc/ordered_attention.cpp, in 8-lane vectors.
//
// For each query row: scores over the row's own positions (position p reads cache slot key_slots[row, p], or
// key_slots[sequence, row, p], or slot p), scaled, plus the additive mask by position; softmax over positions; the
// values summed in position order. Every row is computed by the same instructions in the same order whatever the
// number of rows in the call, and positions closed for every row at the end of the cache (mask <= -1e38) are skipped.
// A block's row is therefore bit-identical to a one-token step at its position.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernel_inputs.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kGroup = 4;      // query heads of one key/value head that share each value row's conversion

inline __m256 load_bf16(const at::BFloat16* p) {  // 8 bf16 -> fp32, exact
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline uint16_t to_bf16(float v) {  // round to nearest even, as torch's bf16 conversion
    uint32_t bits;
    __builtin_memcpy(&bits, &v, 4);
    if (std::isnan(v)) return static_cast<uint16_t>((bits >> 16) | 0x40);
    return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// exp for 8 lanes: 2^n * p(r), r = x - n ln2 (Cody-Waite), degree-6 polynomial; 0 below -87 (as csrc/vector_exp.h).
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^n for n in [-126, 127] (x is clamped to [-87, 88]): the exponent field built directly
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

// Lane j of the result is the sum of the 8 lanes of v[j], always added in the same tree.
inline __m256 sum_lanes8(const __m256* v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float sum8(__m256 v) {  // the 8 lanes in a fixed tree
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float max8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

using Problem = hf_bpd::AttentionProblem;

// The attention of query heads [h0, h0 + count) (one key/value head) of row `r` in batch `b` over positions
// [0, length). `weights` holds kGroup rows of the padded length, `query` dim floats.
void attend(const Problem& pr, int64_t b, int64_t r, int64_t h0, int64_t count, int64_t length, float* weights,
            float* query) {
    const int64_t dim = pr.dim, chunks = dim / 8, kvh = h0 / pr.groups, padded = (length + 7) / 8 * 8;
    const at::BFloat16* kbase = pr.k + (b * (pr.heads / pr.groups) + kvh) * pr.slots * dim;
    const at::BFloat16* vbase = pr.v + (b * (pr.heads / pr.groups) + kvh) * pr.slots * dim;
    const at::BFloat16* mrow = pr.mask + (b * pr.rows + r) * pr.slots;
    const int64_t* orow = pr.order ? pr.order + ((pr.order_batched ? b * pr.rows : 0) + r) * pr.slots : nullptr;
    for (int64_t i = 0; i < count; ++i) {  // scores, then softmax weights, per head
        const at::BFloat16* qrow = pr.q + b * pr.q_batch + (h0 + i) * pr.q_head + r * pr.q_row;
        for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(query + c * 8, load_bf16(qrow + c * 8));
        float* w = weights + i * padded;
        __m256 top = _mm256_set1_ps(-INFINITY);
        for (int64_t p0 = 0; p0 < padded; p0 += 8) {
            const int64_t stop = std::min<int64_t>(8, length - p0);
            __m256 parts[8];
            for (int j = 0; j < 8; ++j) {
                const at::BFloat16* krow = kbase + (j < stop ? (orow ? orow[p0 + j] : p0 + j) : 0) * dim;
                __m256 dot = _mm256_setzero_ps();
                for (int64_t c = 0; c < chunks; ++c)
                    dot = _mm256_fmadd_ps(_mm256_loadu_ps(query + c * 8), load_bf16(krow + c * 8), dot);
                parts[j] = dot;
            }
            alignas(32) float mask[8];
            for (int j = 0; j < 8; ++j) mask[j] = j < stop ? static_cast<float>(mrow[p0 + j]) : 0.0f;
            __m256 s = _mm256_fmadd_ps(sum_lanes8(parts), _mm256_set1_ps(pr.scale), _mm256_load_ps(mask));
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, s);
            for (int j = static_cast<int>(stop); j < 8; ++j) lanes[j] = -INFINITY;
            s = _mm256_load_ps(lanes);
            _mm256_storeu_ps(w + p0, s);
            top = _mm256_max_ps(top, s);
        }
        // softmax over positions: lane j adds positions j, j + 8, ... in order
        const __m256 shift = _mm256_set1_ps(max8(top));
        __m256 sums = _mm256_setzero_ps();
        for (int64_t p0 = 0; p0 < padded; p0 += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(w + p0), shift));
            _mm256_storeu_ps(w + p0, e);
            sums = _mm256_add_ps(sums, e);
        }
        const __m256 total = _mm256_set1_ps(sum8(sums));
        for (int64_t p0 = 0; p0 < padded; p0 += 8)
            _mm256_storeu_ps(w + p0, _mm256_div_ps(_mm256_loadu_ps(w + p0), total));
    }
    // values, 16 dims at a time: each head sums weight x value in position order
    for (int64_t d0 = 0; d0 < chunks; d0 += 2) {
        const bool pair = d0 + 1 < chunks;
        __m256 acc[kGroup][2];
        for (int i = 0; i < kGroup; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int64_t p = 0; p < length; ++p) {
            const at::BFloat16* vrow = vbase + (orow ? orow[p] : p) * dim + d0 * 8;
            const __m256 v0 = load_bf16(vrow), v1 = pair ? load_bf16(vrow + 8) : _mm256_setzero_ps();
            for (int i = 0; i < kGroup; ++i) {
                if (i >= count) break;
                const __m256 weight = _mm256_set1_ps(weights[i * padded + p]);
                acc[i][0] = _mm256_fmadd_ps(weight, v0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(weight, v1, acc[i][1]);
            }
        }
        for (int64_t i = 0; i < count; ++i) {
            at::BFloat16* o = pr.out + ((b * pr.rows + r) * pr.heads + h0 + i) * dim + d0 * 8;
            alignas(32) float lanes[16];
            _mm256_store_ps(lanes, acc[i][0]);
            _mm256_store_ps(lanes + 8, acc[i][1]);
            auto* bits = reinterpret_cast<uint16_t*>(o);
            for (int j = 0; j < (pair ? 16 : 8); ++j) bits[j] = to_bf16(lanes[j]);
        }
    }
}

at::Tensor ordered_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& mask, const c10::optional<at::Tensor>& key_slots, double scaling) {
    const hf_bpd::AttentionInputs in = hf_bpd::attention_inputs(query, key, value, mask, key_slots);
    at::Tensor out = at::empty({in.batch, in.rows, in.heads, in.dim}, query.options());
    const Problem pr = hf_bpd::attention_problem(in, out, scaling);
    const int64_t most = (in.longest + 7) / 8 * 8;
    const auto buffers = [&] { return std::make_pair(std::vector<float>(kGroup * most), std::vector<float>(in.dim)); };
    hf_bpd::each_head_group(in, kGroup, buffers,
                            [&](auto& scratch, int64_t b, int64_t r, int64_t h0, int64_t count, int64_t length) {
                                attend(pr, b, r, h0, count, length, scratch.first.data(), scratch.second.data());
                            });
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_bpd_kernels, m) {
    hf_bpd::define_ordered_attention(m);
}

TORCH_LIBRARY_IMPL(hf_bpd_kernels, CPU, m) {
    m.impl("ordered_attention", &ordered_attention);
}
