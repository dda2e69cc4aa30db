// Row-invariant linear layers for bf16 and int8-weight bases on CPUs with AVX512-BF16 (hf_bpd.runtime.packed_linear).
//
// y = x @ W^T for bf16 activations x (M, K) and a weight W (N, K) stored as bf16, or as int8 with one bf16 scale per
// output row, packed as (N / 16, K / 2, 16, 2): one 64-byte vector holds 16 outputs' weights for a pair of inputs.
// Each output sums its K products in one SIMD lane, pair after pair (vdpbf16ps), from zero: the same instructions in
// the same order whatever the number of rows M and however the rows are split into register tiles. A block's row is
// therefore bit-identical to the same row computed alone, which is what makes drafting exact in half precision.
// Rounding points follow the eager layers: bf16 (+ bias) -> bf16 for nn.Linear; for int8 weights, as
// Int8WeightLinear: bf16(sum) * scale -> bf16, + bias -> bf16.
//
// On CPUs with AMX (and a kernel that grants this process the tile registers) the same packed layout feeds the
// tile unit: a (16 pairs x 16 outputs) slice of the packed weight is one 1 KB B tile as stored, and TDPBF16PS sums
// each output pair after pair in the same fixed order for every row (each row of the A tile is its own dot product).
// Rows stay bit-identical to lone rows on that path too; it is chosen once per process (shapes with K % 32 != 0
// always take the AVX512-BF16 path), so a block and a one-token step of the same layer run the same instructions.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernel_inputs.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BPD_WITH_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kLanes = hf_bpd::kPackedLanes;  // outputs per packed block

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

// One row's 16 sums -> bf16 outputs, rounding where the eager layer rounds.
inline void finish(__m512 v, const float* scale, __m512 s, const float* bias, __m512 c, uint16_t* y) {
    if (scale) v = round_bf16(_mm512_mul_ps(round_bf16(v), s));
    if (bias) v = _mm512_add_ps(v, c);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
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
        for (int m = 0; m < MR; ++m) finish(acc[m][b], scale, s, bias, c, y + m * ldy + b * kLanes);
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
#define BPD_TAIL(R) \
    case R: tile<R, NB>(x + m * ldx, ldx, w, block_stride, pairs, scale, bias, y + m * ldy, ldy); break;
        BPD_TAIL(1) BPD_TAIL(2) BPD_TAIL(3) BPD_TAIL(4) BPD_TAIL(5) BPD_TAIL(6) BPD_TAIL(7)
#undef BPD_TAIL
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

#ifdef BPD_WITH_AMX
// ---- AMX: tiles 0-3 hold the sums of 4 blocks of 16 outputs (rows x 16 fp32), tile 4 the rows' next 32 inputs,
// tiles 5 and 6 a block's next 16 input pairs (as packed; int8 weights widened to bf16 first).
constexpr int64_t kTilePairs = 16;  // input pairs per tile step (32 inputs, 64 bytes of a bf16 row)

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

inline void configure_tiles(int64_t rows) {
    TileConfig config;
    for (int t = 0; t < 4; ++t) config.colsb[t] = 64, config.rows[t] = static_cast<uint8_t>(rows);
    config.colsb[4] = 64, config.rows[4] = static_cast<uint8_t>(rows);
    for (int t = 5; t < 7; ++t) config.colsb[t] = 64, config.rows[t] = kTilePairs;
    _tile_loadconfig(&config);
}

inline void memory_fence() { asm volatile("" ::: "memory"); }  // a compiler barrier only

inline const void* b_tile(const uint16_t* w, uint16_t*) { return w; }

inline const void* b_tile(const int8_t* w, uint16_t* scratch) {  // 16 pairs x 16 outputs of int8 -> bf16, exact
    memory_fence();  // and keep these stores after the tile loads that read the scratch before
    for (int64_t r = 0; r < kTilePairs; ++r)
        _mm512_store_si512(scratch + r * 2 * kLanes, (__m512i)load_weights(w + r * 2 * kLanes));
    memory_fence();  // the tile intrinsics are asm without a memory operand: keep the stores before the load
    return scratch;
}

// Tile t's sums (rows x 16 fp32) rounded and stored as 16 outputs of `rows` rows, with their scale and bias.
inline void store_sums(int t, int64_t rows, const float* scale, const float* bias, uint16_t* y, int64_t ldy) {
    alignas(64) float sums[16 * kLanes];
    switch (t) {
        case 0: _tile_stored(0, sums, kLanes * 4); break;
        case 1: _tile_stored(1, sums, kLanes * 4); break;
        case 2: _tile_stored(2, sums, kLanes * 4); break;
        default: _tile_stored(3, sums, kLanes * 4); break;
    }
    memory_fence();
    const __m512 s = scale ? _mm512_loadu_ps(scale) : _mm512_setzero_ps();
    const __m512 c = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m) finish(_mm512_load_ps(sums + m * kLanes), scale, s, bias, c, y + m * ldy);
}

#define BPD_AMX_STEP(T, B)                                                              \
    if (NB > T) {                                                                          \
        _tile_loadd(B, b_tile(w + T * block_stride + k * 2 * kLanes, scratch[T & 1]), 64); \
        _tile_dpbf16ps(T, 4, B);                                                           \
    }

// rows (<= 16) x NB (<= 4) blocks of 16 outputs over all K/2 pairs (a multiple of 16).
template <int NB, typename W>
void amx_tile(int64_t rows, const uint16_t* x, int64_t ldx, const W* w, int64_t block_stride, int64_t pairs,
              const float* scale, const float* bias, uint16_t* y, int64_t ldy) {
    alignas(64) uint16_t scratch[2][kTilePairs * 2 * kLanes];
    _tile_zero(0);
    if (NB > 1) _tile_zero(1);
    if (NB > 2) _tile_zero(2);
    if (NB > 3) _tile_zero(3);
    for (int64_t k = 0; k < pairs; k += kTilePairs) {
        _tile_loadd(4, x + k * 2, ldx * 2);
        BPD_AMX_STEP(0, 5) BPD_AMX_STEP(1, 6) BPD_AMX_STEP(2, 5) BPD_AMX_STEP(3, 6)
    }
    for (int b = 0; b < NB; ++b)
        store_sums(b, rows, scale ? scale + b * kLanes : nullptr, bias ? bias + b * kLanes : nullptr, y + b * kLanes,
                   ldy);
}
#undef BPD_AMX_STEP

// Two row tiles (16 rows and `second` more) x NB (<= 2) blocks of 16 outputs: tiles 0 / 1 the first 16 rows' sums of
// blocks 0 / 1, tiles 2 / 3 the other rows', tiles 4 / 5 the two row tiles' next 32 inputs, tiles 6 / 7 the blocks'
// next 16 input pairs. Each weight tile loaded feeds both row tiles (the tile loads, not the multiplications, bound
// a 16-row tile). Every row's sums run over the pairs in the same order as in `amx_tile`: rows stay bit-identical.
inline void configure_pair_tiles(int64_t second) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64;
    config.rows[0] = config.rows[1] = config.rows[4] = 16;
    config.rows[2] = config.rows[3] = config.rows[5] = static_cast<uint8_t>(second);
    config.rows[6] = config.rows[7] = kTilePairs;
    _tile_loadconfig(&config);
}

template <int NB, typename W>
void amx_pair_tile(int64_t second, const uint16_t* x, int64_t ldx, const W* w, int64_t block_stride, int64_t pairs,
                   const float* scale, const float* bias, uint16_t* y, int64_t ldy) {
    alignas(64) uint16_t scratch[2][kTilePairs * 2 * kLanes];
    _tile_zero(0);
    _tile_zero(2);
    if (NB > 1) {
        _tile_zero(1);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < pairs; k += kTilePairs) {
        _tile_loadd(4, x + k * 2, ldx * 2);
        _tile_loadd(5, x + 16 * ldx + k * 2, ldx * 2);
        _tile_loadd(6, b_tile(w + k * 2 * kLanes, scratch[0]), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (NB > 1) {
            _tile_loadd(7, b_tile(w + block_stride + k * 2 * kLanes, scratch[1]), 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    for (int t = 0; t < 2 * NB; ++t) {  // block b of row tile `half`, in tile b + 2 * half
        const int b = NB > 1 ? t % 2 : 0, half = NB > 1 ? t / 2 : t;
        store_sums(b + 2 * half, half ? second : 16, scale ? scale + b * kLanes : nullptr,
                   bias ? bias + b * kLanes : nullptr, y + half * 16 * ldy + b * kLanes, ldy);
    }
}

// Each group of 4 output blocks multiplies every row tile while its weights are in cache (the weights are read from
// memory once per call, not once per row tile), rows in pairs of tiles (`amx_pair_tile`), a last tile alone.
template <typename W>
void amx_run(int64_t rows, const uint16_t* x, int64_t pairs, const W* w, int64_t blocks, const float* scale,
             const float* bias, uint16_t* y, int64_t n) {
    const int64_t block_stride = pairs * 2 * kLanes, groups = (blocks + 3) / 4;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
        int64_t configured = -1;  // the tile set-up loaded: rows of a lone tile, or 100 + a pair's second tile's rows
        for (int64_t g = begin; g < end; ++g) {
            const int64_t b0 = g * 4, count = std::min<int64_t>(4, blocks - b0);
            const float* sg = scale ? scale + b0 * kLanes : nullptr;
            const float* cg = bias ? bias + b0 * kLanes : nullptr;
            const W* wg = w + b0 * block_stride;
            int64_t m0 = 0;
            for (; rows - m0 > 16; m0 += 32) {
                const int64_t second = std::min<int64_t>(16, rows - m0 - 16);
                if (configured != 100 + second) {
                    configure_pair_tiles(second);
                    configured = 100 + second;
                }
                const uint16_t* xm = x + m0 * pairs * 2;
                for (int64_t b = 0; b < count; b += 2) {
                    const float* sb = sg ? sg + b * kLanes : nullptr;
                    const float* cb = cg ? cg + b * kLanes : nullptr;
                    uint16_t* yb = y + m0 * n + (b0 + b) * kLanes;
                    if (count - b >= 2)
                        amx_pair_tile<2>(second, xm, pairs * 2, wg + b * block_stride, block_stride, pairs, sb, cb,
                                         yb, n);
                    else
                        amx_pair_tile<1>(second, xm, pairs * 2, wg + b * block_stride, block_stride, pairs, sb, cb,
                                         yb, n);
                }
            }
            if (m0 < rows) {
                const int64_t mr = rows - m0;
                if (configured != mr) configure_tiles(mr), configured = mr;
                const uint16_t* xm = x + m0 * pairs * 2;
                uint16_t* yg = y + m0 * n + b0 * kLanes;
                switch (count) {
                    case 4: amx_tile<4>(mr, xm, pairs * 2, wg, block_stride, pairs, sg, cg, yg, n); break;
                    case 3: amx_tile<3>(mr, xm, pairs * 2, wg, block_stride, pairs, sg, cg, yg, n); break;
                    case 2: amx_tile<2>(mr, xm, pairs * 2, wg, block_stride, pairs, sg, cg, yg, n); break;
                    default: amx_tile<1>(mr, xm, pairs * 2, wg, block_stride, pairs, sg, cg, yg, n); break;
                }
            }
        }
        _tile_release();
    });
}

bool amx_granted() {  // Linux hands a process the AMX tile state only on request
    static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}
#endif

// The engine of this process: "amx" where built for and granted (HF_BPD_OFF naming amx declines it), else "avx512".
std::atomic<int> engine{-1};  // -1 undecided, 0 avx512, 1 amx

// Whether HF_BPD_OFF (comma-separated, hf_bpd/environment.py) names "amx".
bool amx_turned_off() {
    const char* env = std::getenv("HF_BPD_OFF");
    std::string names = env ? std::string(",") + env + "," : "";
    names.erase(std::remove(names.begin(), names.end(), ' '), names.end());
    return names.find(",amx,") != std::string::npos;
}

bool use_amx() {
    if (engine < 0) {
#ifdef BPD_WITH_AMX
        engine = (amx_turned_off() || !amx_granted()) ? 0 : 1;
#else
        engine = 0;
#endif
    }
    return engine == 1;
}

std::string packed_linear_engine(const c10::optional<std::string>& choose) {
    use_amx();
    if (choose.has_value()) {
        TORCH_CHECK(*choose == "amx" || *choose == "avx512", "packed_linear_engine: 'amx' or 'avx512', got ", *choose);
#ifdef BPD_WITH_AMX
        engine = (*choose == "amx" && amx_granted()) ? 1 : 0;
#else
        engine = 0;
#endif
    }
    return engine == 1 ? "amx" : "avx512";
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias) {
    const hf_bpd::PackedInputs in = hf_bpd::packed_inputs(x, packed, scale, bias);
    const int64_t m = in.rows.size(0), blocks = in.blocks, pairs = in.pairs, n = in.n;
    at::Tensor y = at::empty({m, n}, x.options());
    if (m > 0) {
        const auto* xp = reinterpret_cast<const uint32_t*>(in.rows.data_ptr<at::BFloat16>());
        auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
        const float* sp = in.int8 ? in.scale.data_ptr<float>() : nullptr;
        const float* cp = in.bias.defined() ? in.bias.data_ptr<float>() : nullptr;
        const auto* wb = reinterpret_cast<const uint16_t*>(in.int8 ? nullptr : packed.data_ptr<at::BFloat16>());
#ifdef BPD_WITH_AMX
        if (pairs % kTilePairs == 0 && use_amx()) {
            const auto* xb = reinterpret_cast<const uint16_t*>(xp);
            if (in.int8) amx_run(m, xb, pairs, packed.data_ptr<int8_t>(), blocks, sp, cp, yp, n);
            else amx_run(m, xb, pairs, wb, blocks, sp, cp, yp, n);
            return y.view(in.out_sizes);
        }
#endif
        if (in.int8) run(m, xp, pairs, packed.data_ptr<int8_t>(), blocks, sp, cp, yp, n);
        else run(m, xp, pairs, wb, blocks, sp, cp, yp, n);
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
