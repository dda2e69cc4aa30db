// The drafting heads' step on one hidden state or a batch's rows with int8 weights: every head's blocks, the
// projection onto the draft vocabulary, and each head's top-k log-probabilities, in one call
// (hf_bpd.runtime.int8_heads).
//
// Why: after a verification forward the heads' weights are out of the CPU caches, and the step's cost is the bytes
// it reads. fp32 weights are 47 MB for SmolLM2's 4 heads; int8 with one fp32 scale per output row is a quarter of
// that. Activations stay fp32: y[r] = scale[r] * sum_k float(w[r, k]) * x[k] + bias[r].
//
// Threads: OpenMP. Loaded into a process that has already loaded PyTorch, `libgomp.so.1` resolves to the one
// PyTorch uses, so these loops run on PyTorch's own thread pool (no second pool spinning beside it).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct Linear {
  const int8_t* weight;  // (rows, cols), row-major
  const float* scale;    // (rows,)
  const float* bias;     // (rows,) or null
  int rows, cols;
  const int8_t* packed = nullptr;  // with AVX512-VNNI: (ceil(rows / 16), ceil(cols / 2), 16, 2), zero-padded
  const float* packed_scale = nullptr;  // (ceil(rows / 16) * 16,), zero-padded
};

// One vector of floats: 16 lanes with AVX-512, 8 with AVX2 + FMA (the kernel is built with -march=native), else
// plain loops that the compiler vectorises as it can.
#if defined(__AVX512F__)
#include <immintrin.h>

#include "vector_exp.h"
#define BPD_VECTOR 16
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload_i8(const int8_t* w) {  // 16 int8 weights as 16 floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BPD_VECTOR 8
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload_i8(const int8_t* w) {  // 8 int8 weights as 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// With AVX512-VNNI the inputs are quantised too: each input vector to int16 with one fp32 scale (symmetric, at most
// kInputLevels in magnitude, so a sum of int16 x int8 products over 2^16 columns stays inside int32), and the
// weights, packed 16 outputs x 2 columns to a vector, are multiplied in pairs into int32 sums (vpdpwssd): no
// conversion per weight to float and no horizontal sum per output, ~2.5x fewer instructions than the fp32 loop. The
// sums are exact integers, so a row's outputs are the same whatever else shares the call.
#define BPD_VNNI 1
constexpr float kInputLevels = 16383.f;

// x (cols,) -> pairs[(cols + 1) / 2] of int16 (low: column 2i, high: 2i + 1); returns the scale.
inline float quantize_pairs(const float* x, int cols, int32_t* pairs) {
  float top = 0.f;
  for (int k = 0; k < cols; ++k) top = std::max(top, std::fabs(x[k]));
  const float scale = top > 0.f ? top / kInputLevels : 1.f, inverse = 1.f / scale;
  for (int i = 0; i < (cols + 1) / 2; ++i) {
    const int32_t lo = static_cast<int32_t>(std::nearbyint(x[2 * i] * inverse));
    const int32_t hi = 2 * i + 1 < cols ? static_cast<int32_t>(std::nearbyint(x[2 * i + 1] * inverse)) : 0;
    pairs[i] = static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) | (static_cast<uint32_t>(hi) << 16));
  }
  return scale;
}

// y[m * y_stride + r] = scale[r] * x_scale[m] * (W q_m)[r] + bias[r] for the 16-output blocks [begin, end), M <= 4
// quantised inputs, NB blocks at a time.
template <int M, int NB>
inline void vnni_tile(const Linear& L, const int32_t* const* q, const float* x_scale, float* y, int y_stride,
                      int block) {
  const int pairs = (L.cols + 1) / 2;
  const int8_t* w = L.packed + static_cast<int64_t>(block) * pairs * 32;
  __m512i acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_si512();
  for (int k = 0; k < pairs; ++k) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b)
      wv[b] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(w + (static_cast<int64_t>(b) * pairs + k) * 32)));
    for (int m = 0; m < M; ++m) {
      const __m512i xv = _mm512_set1_epi32(q[m][k]);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpwssd_epi32(acc[m][b], wv[b], xv);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int r0 = (block + b) * 16, valid = std::min(16, L.rows - r0);
    const __mmask16 keep = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 ws = _mm512_loadu_ps(L.packed_scale + r0);
    const __m512 bias = L.bias ? _mm512_maskz_loadu_ps(keep, L.bias + r0) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][b]), _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[m])),
                                       bias);
      _mm512_mask_storeu_ps(y + static_cast<int64_t>(m) * y_stride + r0, keep, v);
    }
  }
}

template <int M>
inline void vnni_blocks(const Linear& L, const int32_t* const* q, const float* x_scale, float* y, int y_stride,
                        int begin, int end) {
  int b = begin;
  for (; b + 4 <= end; b += 4) vnni_tile<M, 4>(L, q, x_scale, y, y_stride, b);
  for (; b < end; ++b) vnni_tile<M, 1>(L, q, x_scale, y, y_stride, b);
}

// (ceil(rows / 16), ceil(cols / 2), 16, 2) from a row-major (rows, cols) int8 matrix, zero-padded.
inline void pack_weights(const int8_t* weight, int rows, int cols, std::vector<int8_t>& out) {
  const int blocks = (rows + 15) / 16, pairs = (cols + 1) / 2;
  out.assign(static_cast<size_t>(blocks) * pairs * 32, 0);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      out[((static_cast<size_t>(r / 16) * pairs + c / 2) * 16 + r % 16) * 2 + c % 2] =
          weight[static_cast<size_t>(r) * cols + c];
}
#endif

inline void split(int rows, int parts, int part, int* begin, int* end) {
  const int chunk = (rows + parts - 1) / parts;
  *begin = std::min(rows, part * chunk);
  *end = std::min(rows, *begin + chunk);
}

// acc[m * R + j] = dot(row r + j, input m) for R rows and M inputs (x[m * x_stride + k]): every weight is read and
// converted once for all inputs, and the R * M sums are independent chains (an FMA's latency is hidden).
template <int R, int M>
inline void dot_block(const Linear& L, int r, const float* x, int x_stride, float* acc) {
  const int n = L.cols;
  const int8_t* w = L.weight + static_cast<int64_t>(r) * n;
  int k = 0;
#ifdef BPD_VECTOR
  vec a[R * M];
  for (int i = 0; i < R * M; ++i) a[i] = vzero();
  // The rows two blocks ahead are asked for while this block is computed: on a CPU whose cores keep few reads in
  // flight, the hardware prefetchers alone left the stream stalling on the arithmetic (hf_bpd.runtime.prefetch).
  const int64_t ahead = static_cast<int64_t>(2 * R) * n;
  for (; k + BPD_VECTOR <= n; k += BPD_VECTOR) {
    if ((k & 63) == 0)
      for (int j = 0; j < R; ++j) __builtin_prefetch(w + static_cast<int64_t>(j) * n + k + ahead, 0, 3);
    vec xs[M];
    for (int m = 0; m < M; ++m) xs[m] = vload(x + m * x_stride + k);
    for (int j = 0; j < R; ++j) {
      const vec v = vload_i8(w + static_cast<int64_t>(j) * n + k);
      for (int m = 0; m < M; ++m) a[m * R + j] = vfma(v, xs[m], a[m * R + j]);
    }
  }
  for (int i = 0; i < R * M; ++i) acc[i] = vsum(a[i]);
#else
  for (int i = 0; i < R * M; ++i) acc[i] = 0.f;
#endif
  for (; k < n; ++k)
    for (int j = 0; j < R; ++j)
      for (int m = 0; m < M; ++m)
        acc[m * R + j] += static_cast<float>(w[static_cast<int64_t>(j) * n + k]) * x[m * x_stride + k];
}

// y[m * y_stride + r] = scale[r] * dot(row r, input m) + bias[r] for rows [begin, end) and M inputs.
template <int M>
inline void dot_rows(const Linear& L, const float* x, int x_stride, float* y, int y_stride, int begin, int end) {
  constexpr int R = M == 1 ? 4 : 2;  // 4 or 8 independent sums
  float acc[R * M];
  int r = begin;
  for (; r + R <= end; r += R) {
    dot_block<R, M>(L, r, x, x_stride, acc);
    for (int j = 0; j < R; ++j) {
      const float s = L.scale[r + j], b = L.bias ? L.bias[r + j] : 0.f;
      for (int m = 0; m < M; ++m) y[m * y_stride + r + j] = s * acc[m * R + j] + b;
    }
  }
  for (; r < end; ++r) {
    dot_block<1, M>(L, r, x, x_stride, acc);
    const float s = L.scale[r], b = L.bias ? L.bias[r] : 0.f;
    for (int m = 0; m < M; ++m) y[m * y_stride + r] = s * acc[m] + b;
  }
}

// y (m, rows) = x (m, cols) W^T for m inputs, in groups of up to 4, rows split across threads (`part` of `parts`).
void gemv(const Linear& L, const float* x, int m, float* y, int parts, int part) {
#ifdef BPD_VNNI
  if (L.packed) {  // each thread quantises the inputs itself (the same values), then computes its blocks
    const int pairs = (L.cols + 1) / 2, blocks = (L.rows + 15) / 16;
    int begin, end;
    split(blocks, parts, part, &begin, &end);
    std::vector<int32_t> q(static_cast<size_t>(std::min(m, 4)) * pairs);
    for (int i = 0; i < m; i += 4) {
      const int g = std::min(4, m - i);
      const int32_t* rows[4];
      float scales[4];
      for (int j = 0; j < g; ++j) {
        rows[j] = &q[static_cast<size_t>(j) * pairs];
        scales[j] = quantize_pairs(x + static_cast<int64_t>(i + j) * L.cols, L.cols, &q[static_cast<size_t>(j) * pairs]);
      }
      float* yi = y + static_cast<int64_t>(i) * L.rows;
      if (g == 1) vnni_blocks<1>(L, rows, scales, yi, L.rows, begin, end);
      else if (g == 2) vnni_blocks<2>(L, rows, scales, yi, L.rows, begin, end);
      else if (g == 3) vnni_blocks<3>(L, rows, scales, yi, L.rows, begin, end);
      else vnni_blocks<4>(L, rows, scales, yi, L.rows, begin, end);
    }
    return;
  }
#endif
  int begin, end;
  split(L.rows, parts, part, &begin, &end);
  for (int i = 0; i < m; i += 4) {
    const int g = std::min(4, m - i);
    const float* xi = x + static_cast<int64_t>(i) * L.cols;
    float* yi = y + static_cast<int64_t>(i) * L.rows;
    if (g == 1) dot_rows<1>(L, xi, L.cols, yi, L.rows, begin, end);
    else if (g == 2) dot_rows<2>(L, xi, L.cols, yi, L.rows, begin, end);
    else if (g == 3) dot_rows<3>(L, xi, L.cols, yi, L.rows, begin, end);
    else dot_rows<4>(L, xi, L.cols, yi, L.rows, begin, end);
  }
}

// log(sum_v exp(row[v])), shifted by the maximum; in fp32 lanes with AVX-512.
inline float log_sum_exp(const float* row, int n) {
  float top = row[0];
  int v = 0;
#ifdef __AVX512F__
  __m512 tops = _mm512_set1_ps(row[0]);
  for (; v + 16 <= n; v += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(row + v));
  top = _mm512_reduce_max_ps(tops);
#endif
  for (int i = v; i < n; ++i) top = std::max(top, row[i]);
  float sum = 0.f;
  v = 0;
#ifdef __AVX512F__
  const __m512 shift = _mm512_set1_ps(top);
  __m512 sums = _mm512_setzero_ps();
  for (; v + 16 <= n; v += 16) sums = _mm512_add_ps(sums, hf_bpd::exp16(_mm512_sub_ps(_mm512_loadu_ps(row + v), shift)));
  sum = _mm512_reduce_add_ps(sums);
#endif
  for (; v < n; ++v) sum += std::exp(row[v] - top);
  return top + std::log(sum);
}

struct Heads {
  int num_heads, num_blocks, kind;  // kind 0: FFN blocks x + down(relu(up(x))); 1: resblocks x + silu(W x)
  int hidden, width, vocab;
  float softcap;
  std::vector<Linear> layers;  // per head, per block: (up, down) or (W)
  Linear projection;
  std::vector<float> states, inner, delta, logits;
  std::vector<std::vector<int8_t>> packed;  // the layers' packed weights (AVX512-VNNI)
  std::vector<std::vector<float>> packed_scales;
};

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* bpd_int8_heads_new(
    int num_heads, int num_blocks, int kind, int hidden, int width, int vocab, const int8_t** weights,
    const float** scales, const float** biases, const int8_t* proj_weight, const float* proj_scale,
    const float* proj_bias, float softcap) {
  auto* h = new Heads();
  h->num_heads = num_heads;
  h->num_blocks = num_blocks;
  h->kind = kind;
  h->hidden = hidden;
  h->width = width;
  h->vocab = vocab;
  h->softcap = softcap;
  const int per_block = kind == 0 ? 2 : 1;
  for (int i = 0; i < num_heads * num_blocks * per_block; ++i) {
    const bool up = kind == 0 && i % 2 == 0;
    const bool down = kind == 0 && i % 2 == 1;
    h->layers.push_back(Linear{weights[i], scales[i], biases[i], up ? width : hidden, down ? width : hidden});
  }
  h->projection = Linear{proj_weight, proj_scale, proj_bias, vocab, hidden};
#ifdef BPD_VNNI
  h->packed.reserve(h->layers.size() + 1);
  h->packed_scales.reserve(h->layers.size() + 1);
  for (Linear* L : [&] {
         std::vector<Linear*> all;
         for (auto& layer : h->layers) all.push_back(&layer);
         all.push_back(&h->projection);
         return all;
       }()) {
    h->packed.emplace_back();
    pack_weights(L->weight, L->rows, L->cols, h->packed.back());
    h->packed_scales.emplace_back(static_cast<size_t>((L->rows + 15) / 16) * 16, 0.f);
    std::copy(L->scale, L->scale + L->rows, h->packed_scales.back().begin());
    L->packed = h->packed.back().data();
    L->packed_scale = h->packed_scales.back().data();
  }
#endif
  h->states.resize(static_cast<size_t>(num_heads) * hidden);
  h->inner.resize(static_cast<size_t>(num_heads) * std::max(width, hidden));
  h->delta.resize(static_cast<size_t>(num_heads) * hidden);
  h->logits.resize(static_cast<size_t>(num_heads) * vocab);
  return h;
}

__attribute__((visibility("default"))) void bpd_int8_heads_free(void* handle) { delete static_cast<Heads*>(handle); }

// hidden (n, hidden) -> values (n, H, top_k) log-probabilities best first, indices (n, H, top_k) into the draft
// vocabulary, for n hidden states in one call (a batch's rows), H the first `heads` heads (all when `heads` is 0 or
// more than there are): each weight row is read once for up to 4 of the (head, row) inputs. Every output is computed
// as for a lone hidden state (the same sums in the same order whatever n and H are). `threads` OpenMP threads
// (PyTorch's intra-op count).
__attribute__((visibility("default"))) void bpd_int8_heads_run_rows(void* handle, const float* hidden, int n,
                                                                     int top_k, float* values, int64_t* indices,
                                                                     int threads, int heads) {
  Heads& h = *static_cast<Heads*>(handle);
  const int H = heads > 0 && heads < h.num_heads ? heads : h.num_heads, d = h.hidden, per_block = h.kind == 0 ? 2 : 1;
  const size_t inputs = static_cast<size_t>(H) * n;  // laid out [head][row]: a head's n inputs are contiguous
  if (h.states.size() < inputs * d) {
    h.states.resize(inputs * d);
    h.inner.resize(inputs * std::max(h.width, d));
    h.delta.resize(inputs * d);
    h.logits.resize(inputs * h.vocab);
  }
  for (int i = 0; i < H; ++i)
    std::memcpy(&h.states[static_cast<size_t>(i) * n * d], hidden, sizeof(float) * d * static_cast<size_t>(n));
#pragma omp parallel num_threads(threads)
  {
    const int parts = omp_get_num_threads(), part = omp_get_thread_num();
    int b, e;
    for (int block = 0; block < h.num_blocks; ++block) {
      // every head's block, rows split across the threads; a barrier between the stages
      for (int i = 0; i < H; ++i) {
        const Linear& first = h.layers[(static_cast<size_t>(i) * h.num_blocks + block) * per_block];
        gemv(first, &h.states[static_cast<size_t>(i) * n * d], n,
             &h.inner[static_cast<size_t>(i) * n * first.rows], parts, part);
      }
#pragma omp barrier
      if (h.kind == 0) {
        const int w = h.width;
        split(static_cast<int>(inputs) * w, parts, part, &b, &e);
        for (int j = b; j < e; ++j) h.inner[j] = std::max(h.inner[j], 0.f);
#pragma omp barrier
        for (int i = 0; i < H; ++i) {
          const Linear& down = h.layers[(static_cast<size_t>(i) * h.num_blocks + block) * 2 + 1];
          gemv(down, &h.inner[static_cast<size_t>(i) * n * w], n, &h.delta[static_cast<size_t>(i) * n * d], parts,
               part);
        }
#pragma omp barrier
        split(static_cast<int>(inputs) * d, parts, part, &b, &e);
        for (int j = b; j < e; ++j) h.states[j] += h.delta[j];  // x + down(relu(up(x)))
      } else {
        split(static_cast<int>(inputs) * d, parts, part, &b, &e);
        for (int j = b; j < e; ++j) {
          const float z = h.inner[j];
          h.states[j] += z / (1.f + std::exp(-z));
        }
      }
#pragma omp barrier
    }
    // the projection: each draft-vocabulary row read once for up to 4 (head, row) inputs
    gemv(h.projection, h.states.data(), static_cast<int>(inputs), h.logits.data(), parts, part);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int x = 0; x < static_cast<int>(inputs); ++x) {
      const int i = x / n, r = x % n;  // head i of row r
      float* row = &h.logits[static_cast<size_t>(x) * h.vocab];
      const int V = h.vocab;
      if (h.softcap > 0.f)
        for (int v = 0; v < V; ++v) row[v] = std::tanh(row[v] / h.softcap) * h.softcap;
      const float lse = log_sum_exp(row, V);
      // top-k: a heap whose front is the worst kept entry; of equal values the lower index is better
      std::vector<std::pair<float, int>> heap;
      heap.reserve(top_k + 1);
      auto better = [](const std::pair<float, int>& a, const std::pair<float, int>& c) {
        return a.first > c.first || (a.first == c.first && a.second < c.second);
      };
      for (int v = 0; v < V; ++v) {
#ifdef __AVX512F__
        // a chunk of 16 with nothing above the worst kept value changes nothing (ties keep the lower index)
        if ((v & 15) == 0 && v + 16 <= V && static_cast<int>(heap.size()) == top_k &&
            !_mm512_cmp_ps_mask(_mm512_loadu_ps(row + v), _mm512_set1_ps(heap.front().first), _CMP_GT_OQ)) {
          v += 15;
          continue;
        }
#endif
        if (static_cast<int>(heap.size()) < top_k) {
          heap.emplace_back(row[v], v);
          std::push_heap(heap.begin(), heap.end(), better);
        } else if (better(std::make_pair(row[v], v), heap.front())) {
          std::pop_heap(heap.begin(), heap.end(), better);
          heap.back() = std::make_pair(row[v], v);
          std::push_heap(heap.begin(), heap.end(), better);
        }
      }
      std::sort_heap(heap.begin(), heap.end(), better);  // best first
      const size_t out = (static_cast<size_t>(r) * H + i) * top_k;
      for (int j = 0; j < top_k; ++j) {
        values[out + j] = heap[j].first - lse;
        indices[out + j] = heap[j].second;
      }
    }
  }
}

}  // extern "C"
