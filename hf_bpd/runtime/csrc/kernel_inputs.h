// The checked inputs of hf_bpd's two operators, shared by their AVX512-BF16 and AVX2 sources
// (csrc/packed_linear*.cpp, csrc/ordered_attention*.cpp): one set of rules and error messages for both.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace hf_bpd {

constexpr int64_t kPackedLanes = 16;  // outputs per packed weight block

// packed_linear(x, packed, scale, bias): x (..., K) bf16, the weight packed as (N / 16, K / 2, 16, 2), bf16 or int8
// with one scale per output; scale and bias as contiguous fp32, x's rows as an (M, K) matrix.
struct PackedInputs {
    int64_t blocks, pairs, n;
    bool int8;
    at::Tensor rows, scale, bias;  // scale / bias undefined when absent
    std::vector<int64_t> out_sizes;
};

inline at::Tensor contiguous_fp32(const at::Tensor& t) {
    return t.scalar_type() == at::kFloat ? t.contiguous() : t.to(at::kFloat).contiguous();
}

inline PackedInputs packed_inputs(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
                                  const c10::optional<at::Tensor>& bias) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "packed_linear: x must be bf16, got ", x.scalar_type());
    TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPackedLanes && packed.size(3) == 2 && packed.is_contiguous(),
                "packed_linear: the weight must be packed as (N / 16, K / 2, 16, 2)");
    PackedInputs in;
    in.blocks = packed.size(0), in.pairs = packed.size(1), in.n = in.blocks * kPackedLanes;
    const int64_t k = in.pairs * 2;
    TORCH_CHECK(x.size(-1) == k, "packed_linear: x has ", x.size(-1), " features, the weight ", k);
    in.int8 = packed.scalar_type() == at::kChar;
    TORCH_CHECK(in.int8 || packed.scalar_type() == at::kBFloat16, "packed_linear: the weight must be bf16 or int8");
    TORCH_CHECK(in.int8 == (scale.has_value() && scale->defined()),
                "packed_linear: int8 weights take a scale, bf16 none");
    in.out_sizes = x.sizes().vec();
    in.out_sizes.back() = in.n;
    in.rows = x.reshape({-1, k}).contiguous();
    // fp32, as PackedLinear stores them, so that no call converts them
    if (in.int8) in.scale = contiguous_fp32(*scale);
    if (bias.has_value() && bias->defined()) in.bias = contiguous_fp32(*bias);
    return in;
}

constexpr float kClosed = -1e38f;  // an additive mask at or below this closes a position

// ordered_attention(query, key, value, mask, key_slots, scaling): bf16 (batch, heads, rows, dim) queries read
// through their strides, contiguous keys / values / mask, the key slots by position (or undefined), and each row's
// length: positions [0, its last open one] (later ones would only add exact zeros).
struct AttentionInputs {
    int64_t batch, heads, rows, dim, kv_heads, slots;
    at::Tensor q, k, v, mask, order;
    std::vector<int64_t> length;
    int64_t longest;
};

inline AttentionInputs attention_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const at::Tensor& mask, const c10::optional<at::Tensor>& key_slots) {
    TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                    value.scalar_type() == at::kBFloat16 && mask.scalar_type() == at::kBFloat16,
                "ordered_attention: bf16 query, key, value and mask");
    AttentionInputs in;
    in.batch = query.size(0), in.heads = query.size(1), in.rows = query.size(2), in.dim = query.size(3);
    in.kv_heads = key.size(1), in.slots = key.size(2);
    TORCH_CHECK(in.dim % 16 == 0 && in.dim <= 256 && in.heads % in.kv_heads == 0,
                "ordered_attention: a head dim that is a multiple of 16, at most 256");
    TORCH_CHECK(mask.dim() == 4 && mask.size(0) == in.batch && mask.size(1) == 1 && mask.size(2) == in.rows &&
                    mask.size(3) == in.slots, "ordered_attention: an additive (batch, 1, rows, slots) mask");
    // The query is read through its strides: a block's query is a transposed view, which a copy would duplicate in
    // every layer.
    in.q = query.stride(3) == 1 ? query : query.contiguous();
    in.k = key.contiguous(), in.v = value.contiguous(), in.mask = mask.contiguous();
    if (key_slots.has_value() && key_slots->defined()) {
        in.order = key_slots->to(at::kLong).contiguous();
        const at::Tensor& o = in.order;
        TORCH_CHECK((o.dim() == 2 && o.size(0) == in.rows && o.size(1) == in.slots) ||
                        (o.dim() == 3 && o.size(0) == in.batch && o.size(1) == in.rows && o.size(2) == in.slots),
                    "ordered_attention: key_slots (rows, slots) or (batch, rows, slots)");
    }
    const at::BFloat16* mp = in.mask.data_ptr<at::BFloat16>();
    in.length.assign(in.batch * in.rows, 0);
    for (int64_t i = 0; i < in.batch * in.rows; ++i)
        for (int64_t p = in.slots - 1; p >= 0; --p)
            if (static_cast<float>(mp[i * in.slots + p]) > kClosed) {
                in.length[i] = p + 1;
                break;
            }
    in.longest = *std::max_element(in.length.begin(), in.length.end());
    return in;
}

// What each unit of ordered attention reads and writes: raw pointers and sizes of the checked inputs.
struct AttentionProblem {
    const at::BFloat16 *q, *k, *v, *mask;
    const int64_t* order;  // (rows, slots) or (batch, rows, slots) key slots by position, or null: slot p
    bool order_batched;    // order has a batch dimension (each sequence of a batch its own map)
    at::BFloat16* out;
    int64_t heads, rows, slots, groups, dim;
    int64_t q_batch, q_head, q_row;  // the query's strides (its last dimension is contiguous)
    float scale;
};

inline AttentionProblem attention_problem(const AttentionInputs& in, at::Tensor& out, double scaling) {
    return {in.q.data_ptr<at::BFloat16>(), in.k.data_ptr<at::BFloat16>(), in.v.data_ptr<at::BFloat16>(),
            in.mask.data_ptr<at::BFloat16>(), in.order.defined() ? in.order.data_ptr<int64_t>() : nullptr,
            in.order.defined() && in.order.dim() == 3, out.data_ptr<at::BFloat16>(), in.heads, in.rows, in.slots,
            in.heads / in.kv_heads, in.dim, in.q.stride(0), in.q.stride(1), in.q.stride(2),
            static_cast<float>(scaling)};
}

// Calls `unit(scratch, b, r, h0, count, length)` in parallel for every row's groups of up to `group` query heads that
// share a key/value head (heads [h0, h0 + count) of row r in sequence b, over its `length` positions); `make_scratch()`
// gives each thread its buffers.
template <typename MakeScratch, typename Unit>
void each_head_group(const AttentionInputs& in, int64_t group, MakeScratch make_scratch, Unit unit) {
    const int64_t groups = in.heads / in.kv_heads, splits = (groups + group - 1) / group, rows = in.rows;
    at::parallel_for(0, in.batch * in.kv_heads * rows * splits, 1, [&](int64_t begin, int64_t end) {
        auto scratch = make_scratch();
        for (int64_t i = begin; i < end; ++i) {
            const int64_t split = i % splits, r = i / splits % rows, kvh = i / (splits * rows) % in.kv_heads;
            const int64_t b = i / (splits * rows * in.kv_heads), first = split * group;
            const int64_t count = std::min<int64_t>(group, groups - first);
            unit(scratch, b, r, kvh * groups + first, count, in.length[b * rows + r]);
        }
    });
}

inline void define_packed_linear(torch::Library& m) {
    m.def("packed_linear(Tensor x, Tensor packed, Tensor? scale, Tensor? bias) -> Tensor");
}

inline void define_ordered_attention(torch::Library& m) {
    m.def("ordered_attention(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor? key_slots, float scaling) "
          "-> Tensor");
}

}  // namespace hf_bpd
