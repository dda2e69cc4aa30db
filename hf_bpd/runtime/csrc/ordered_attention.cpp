// Position-ordered attention on the CPU (hf_bpd.runtime.ordered_attention), reading only the cache slots in use.
//
// For each query row: scores over the row's own positions (position p reads cache slot key_slots[row, p], or slot p),
// scaled, plus the additive mask by position; softmax over positions; the values summed in position order. Every row
// is computed by the same instructions in the same order whatever the number of rows in the call, and positions
// closed for every row at the end of the cache (mask <= -1e38) are skipped: they would add exact zeros. A block's row
// is therefore bit-identical to a one-token step at its position, and a step costs what the context holds, not the
// static cache's length.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

constexpr float kClosed = -1e38f;  // an additive mask at or below this closes a position

// exp for 16 lanes: 2^n * p(r), r = x - n ln2 (Cody-Waite), degree-6 polynomial; 0 below -87.
inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, n);
}

inline __m512 load_bf16(const at::BFloat16* p) {  // 16 bf16 -> fp32
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

at::Tensor ordered_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& mask, const c10::optional<at::Tensor>& key_slots, double scaling) {
    TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                    value.scalar_type() == at::kBFloat16, "ordered_attention: bf16 query, key and value");
    const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), dim = query.size(3);
    const int64_t kv_heads = key.size(1), slots = key.size(2);
    TORCH_CHECK(dim % 16 == 0 && heads % kv_heads == 0, "ordered_attention: head dim a multiple of 16");
    TORCH_CHECK(mask.dim() == 4 && mask.size(0) == batch && mask.size(1) == 1 && mask.size(2) == rows &&
                    mask.size(3) == slots, "ordered_attention: an additive (batch, 1, rows, slots) mask");
    const int64_t groups = heads / kv_heads;
    at::Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
    at::Tensor m = mask.to(at::kFloat).contiguous();
    at::Tensor order;
    if (key_slots.has_value() && key_slots->defined()) order = key_slots->to(at::kLong).contiguous();
    const float* mp = m.data_ptr<float>();
    int64_t length = 0;  // positions past every open one are skipped
    for (int64_t i = 0; i < batch * rows; ++i)
        for (int64_t p = slots - 1; p >= length; --p)
            if (mp[i * slots + p] > kClosed) {
                length = p + 1;
                break;
            }
    at::Tensor out = at::empty({batch, rows, heads, dim}, query.options());
    const at::BFloat16* qp = q.data_ptr<at::BFloat16>();
    const at::BFloat16* kp = k.data_ptr<at::BFloat16>();
    const at::BFloat16* vp = v.data_ptr<at::BFloat16>();
    const int64_t* op = order.defined() ? order.data_ptr<int64_t>() : nullptr;
    at::BFloat16* outp = out.data_ptr<at::BFloat16>();
    const float scale = static_cast<float>(scaling);
    const int64_t chunks = dim / 16, padded = (length + 15) / 16 * 16;
    at::parallel_for(0, batch * heads * rows, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores(padded);
        std::vector<__m512> acc(chunks);
        for (int64_t unit = begin; unit < end; ++unit) {
            const int64_t b = unit / (heads * rows), h = unit / rows % heads, r = unit % rows, kvh = h / groups;
            const at::BFloat16* qrow = qp + ((b * heads + h) * rows + r) * dim;
            const at::BFloat16* kbase = kp + (b * kv_heads + kvh) * slots * dim;
            const at::BFloat16* vbase = vp + (b * kv_heads + kvh) * slots * dim;
            const float* mrow = mp + (b * rows + r) * slots;
            const int64_t* orow = op ? op + r * slots : nullptr;
            for (int64_t c = 0; c < chunks; ++c) acc[c] = load_bf16(qrow + c * 16);
            float top = -INFINITY;
            for (int64_t p = 0; p < length; ++p) {
                const at::BFloat16* krow = kbase + (orow ? orow[p] : p) * dim;
                __m512 dot = _mm512_mul_ps(acc[0], load_bf16(krow));
                for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(acc[c], load_bf16(krow + c * 16), dot);
                const float s = _mm512_reduce_add_ps(dot) * scale + mrow[p];
                scores[p] = s;
                top = s > top ? s : top;
            }
            for (int64_t p = length; p < padded; ++p) scores[p] = -INFINITY;
            __m512 sums = _mm512_setzero_ps();  // lane j adds positions j, j + 16, ... in order
            const __m512 shift = _mm512_set1_ps(top);
            for (int64_t p = 0; p < padded; p += 16) {
                __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores.data() + p), shift));
                _mm512_storeu_ps(scores.data() + p, e);
                sums = _mm512_add_ps(sums, e);
            }
            const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sums));
            for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
            for (int64_t p0 = 0; p0 < padded; p0 += 16) {
                alignas(64) float w[16];
                _mm512_store_ps(w, _mm512_div_ps(_mm512_loadu_ps(scores.data() + p0), total));
                const int64_t stop = std::min<int64_t>(16, length - p0);
                for (int64_t j = 0; j < stop; ++j) {
                    const int64_t p = p0 + j;
                    const at::BFloat16* vrow = vbase + (orow ? orow[p] : p) * dim;
                    const __m512 weight = _mm512_set1_ps(w[j]);
                    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(weight, load_bf16(vrow + c * 16), acc[c]);
                }
            }
            at::BFloat16* orow_out = outp + ((b * rows + r) * heads + h) * dim;
            for (int64_t c = 0; c < chunks; ++c)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow_out + c * 16), (__m256i)_mm512_cvtneps_pbh(acc[c]));
        }
    });
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_bpd_kernels, m) {
    m.def("ordered_attention(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor? key_slots, float scaling) "
          "-> Tensor");
}

TORCH_LIBRARY_IMPL(hf_bpd_kernels, CPU, m) {
    m.impl("ordered_attention", &ordered_attention);
}
