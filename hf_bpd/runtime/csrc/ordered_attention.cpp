// Position-ordered attention on the CPU (hf_bpd.runtime.ordered_attention), reading only the cache slots in use.
//
// For each query row: scores over the row's own positions (position p reads cache slot key_slots[row, p], or
// key_slots[sequence, row, p] when each sequence of a batch has its own map, or slot p),
// scaled, plus the additive mask by position; softmax over positions; the values summed in position order. Every row
// is computed by the same instructions in the same order whatever the number of rows in the call, and positions
// closed for every row at the end of the cache (mask <= -1e38) are skipped: they would add exact zeros. A block's row
// is therefore bit-identical to a one-token step at its position, and a step costs what the context holds, not the
// static cache's length.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernel_inputs.h"
#include "vector_exp.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace {



inline __m512 load_bf16(const at::BFloat16* p) {  // 16 bf16 -> fp32
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m512 load_bf16(const at::BFloat16* p, __mmask16 keep) {  // the lanes in `keep`, others 0
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p)), 16));
}

// Lane j of the result is the sum of the 16 lanes of v[j], always added in the same tree (pairs of lanes, then
// 128-bit halves, then across 128-bit blocks).
inline __m512 sum_lanes16(const __m512* v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; ++i)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int64_t kGroup = 4;  // query heads of one key/value head that share each value row's conversion

using Problem = hf_bpd::AttentionProblem;

// The attention of query heads [h0, h0 + count) (one key/value head) of row `r` in batch `b`, over positions
// [0, length): NC chunks of 16 dims. Each head's arithmetic is the same whatever else shares the call, so a block's
// row is bit-identical to that row alone.
template <int NC>
void attend(const Problem& pr, int64_t b, int64_t r, int64_t h0, int64_t count, int64_t length, float* weights) {
    constexpr int NP = NC / 2, TAIL = NC % 2;  // 32 dims per vdpbf16ps; a 16-dim tail in the low half
    constexpr int64_t dim = NC * 16;
    const int64_t kvh = h0 / pr.groups, padded = (length + 15) / 16 * 16;
    const at::BFloat16* kbase = pr.k + (b * (pr.heads / pr.groups) + kvh) * pr.slots * dim;
    const at::BFloat16* vbase = pr.v + (b * (pr.heads / pr.groups) + kvh) * pr.slots * dim;
    const at::BFloat16* mrow = pr.mask + (b * pr.rows + r) * pr.slots;
    const int64_t* orow = pr.order ? pr.order + ((pr.order_batched ? b * pr.rows : 0) + r) * pr.slots : nullptr;
    for (int64_t i = 0; i < count; ++i) {  // scores, then softmax weights, per head
        const at::BFloat16* qrow = pr.q + b * pr.q_batch + (h0 + i) * pr.q_head + r * pr.q_row;
        __m512bh qv[NP + TAIL];
        for (int c = 0; c < NP; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qrow + c * 32);
        if (TAIL) qv[NP] = (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, qrow + NP * 32);
        float* w = weights + i * padded;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t p0 = 0; p0 < padded; p0 += 16) {
            const int64_t stop = std::min<int64_t>(16, length - p0);
            __m512 parts[16];
            for (int j = 0; j < 16; ++j) {
                const at::BFloat16* krow = kbase + (j < stop ? (orow ? orow[p0 + j] : p0 + j) : 0) * dim;
                __m512 dot = _mm512_setzero_ps();
                for (int c = 0; c < NP; ++c)
                    dot = _mm512_dpbf16_ps(dot, qv[c], (__m512bh)_mm512_loadu_si512(krow + c * 32));
                if (TAIL)
                    dot = _mm512_dpbf16_ps(dot, qv[NP], (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, krow + NP * 32));
                parts[j] = dot;
            }
            const __mmask16 open = stop >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << stop) - 1);
            __m512 s = _mm512_fmadd_ps(sum_lanes16(parts), _mm512_set1_ps(pr.scale), load_bf16(mrow + p0, open));
            s = _mm512_mask_blend_ps(open, _mm512_set1_ps(-INFINITY), s);
            _mm512_storeu_ps(w + p0, s);
            top = _mm512_max_ps(top, s);
        }
        // softmax over positions: lane j adds positions j, j + 16, ... in order
        const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 sums = _mm512_setzero_ps();
        for (int64_t p0 = 0; p0 < padded; p0 += 16) {
            __m512 e = hf_bpd::exp16(_mm512_sub_ps(_mm512_loadu_ps(w + p0), shift));
            _mm512_storeu_ps(w + p0, e);
            sums = _mm512_add_ps(sums, e);
        }
        const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sums));
        for (int64_t p0 = 0; p0 < padded; p0 += 16)
            _mm512_storeu_ps(w + p0, _mm512_div_ps(_mm512_loadu_ps(w + p0), total));
    }
    // values, 64 dims at a time: each head sums weight x value in position order
    for (int d0 = 0; d0 < NC; d0 += 4) {
        constexpr int W4 = NC < 4 ? NC : 4;
        const int width = NC - d0 < W4 ? NC - d0 : W4;
        __m512 acc[kGroup][W4];
        for (int i = 0; i < kGroup; ++i)
            for (int c = 0; c < W4; ++c) acc[i][c] = _mm512_setzero_ps();
        for (int64_t p = 0; p < length; ++p) {
            const at::BFloat16* vrow = vbase + (orow ? orow[p] : p) * dim + d0 * 16;
            __m512 val[W4];
            for (int c = 0; c < W4; ++c) val[c] = c < width ? load_bf16(vrow + c * 16) : _mm512_setzero_ps();
            for (int i = 0; i < kGroup; ++i) {
                if (i >= count) break;
                const __m512 weight = _mm512_set1_ps(weights[i * padded + p]);
                for (int c = 0; c < W4; ++c) acc[i][c] = _mm512_fmadd_ps(weight, val[c], acc[i][c]);
            }
        }
        for (int64_t i = 0; i < count; ++i) {
            at::BFloat16* o = pr.out + ((b * pr.rows + r) * pr.heads + h0 + i) * dim + d0 * 16;
            for (int c = 0; c < width; ++c)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * 16), (__m256i)_mm512_cvtneps_pbh(acc[i][c]));
        }
    }
}

using Attend = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t, int64_t, float*);

template <int... NC>
Attend pick(int64_t chunks, std::integer_sequence<int, NC...>) {
    Attend table[] = {attend<NC + 1>...};
    return table[chunks - 1];
}

at::Tensor ordered_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& mask, const c10::optional<at::Tensor>& key_slots, double scaling) {
    const hf_bpd::AttentionInputs in = hf_bpd::attention_inputs(query, key, value, mask, key_slots);
    at::Tensor out = at::empty({in.batch, in.rows, in.heads, in.dim}, query.options());
    const Problem pr = hf_bpd::attention_problem(in, out, scaling);
    const Attend run = pick(in.dim / 16, std::make_integer_sequence<int, 16>{});
    const int64_t most = (in.longest + 15) / 16 * 16;
    hf_bpd::each_head_group(in, kGroup, [&] { return std::vector<float>(kGroup * most); },
                            [&](auto& scratch, int64_t b, int64_t r, int64_t h0, int64_t count, int64_t length) {
                                run(pr, b, r, h0, count, length, scratch.data());
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
