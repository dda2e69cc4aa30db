"""Row-invariant linear layers for bf16 and int8-weight bases on CPUs with AVX512-BF16 or AVX2: the compiled step's
GEMMs.

A drafted block is exact only if each of its rows is computed as the same row would be alone: in half precision any
other summation order flips greedy choices at bf16's many near-ties. `csrc/packed_linear.cpp` is a GEMM built for
that: every output sums its products in one SIMD lane, input pair after input pair (`vdpbf16ps`), whatever the number
of rows, so rows are bit-identical by construction. It also reads the weights at memory speed for one row and keeps
the multiply units busy for 8-16, so on SmolLM2's shapes it runs faster than PyTorch's bf16 `linear`, and than its
int8 weight-only kernel from a few rows on. On CPUs with AMX the same packed weights are the tile unit's B tiles
(`tdpbf16ps`, up to 16 rows per tile, each row its own fixed-order sum), where 8 or 16 rows cost what one row costs;
one engine serves a process (`torch.ops.hf_bpd_kernels.packed_linear_engine()`, `HF_BPD_OFF=amx` for the AVX512-BF16
path), because the two engines' sums can differ in their last bits. CPUs without AVX512-BF16 but with AVX2 and FMA
run `csrc/packed_linear_avx2.cpp` on the same packed weights (two FMAs per input pair in one lane: row-invariant
too, its own last bits), where bf16 weights halve what an fp32 step reads.

`packed_base(base)` is the module tree the compiled steps of a bf16 or `Int8WeightsConfig` base run: a copy of the
base's modules sharing every parameter, buffer and config with it, whose linear layers are `PackedLinear`s holding the
weights packed for the kernel (one extra copy of the linear weights per base, shared by all its compiled shapes), and
whose rotary embeddings are read from a table (`hf_bpd.runtime.rotary_table`). The base itself is not changed: its own
`generate()` runs as loaded. A weight memory-mapped from a file hands its pages back once packed
(`hf_bpd.runtime.page_cache`), so the packed copy is the one resident while the compiled steps decode.

The kernel is built on first use (`hf_bpd.runtime.kernels`); `HF_BPD_OFF=kernels` keeps inductor's GEMMs instead.
"""

from __future__ import annotations

import copy
import threading
import weakref

import torch
from torch import nn

from . import page_cache, weights
from .int8_weights import Int8WeightLinear
from .kernels import LANES, kernels_unsupported_reason
from .rotary_table import table_rotary_embeddings

_CLONES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base -> its packed module tree
_WEIGHTS_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base -> its weights' marker when packed
_lock = threading.Lock()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`(N, K)` -> the kernel's `(N / 16, K / 2, 16, 2)`: 16 outputs' weights for each pair of inputs side by side."""
    n, k = weight.shape
    return weight.detach().reshape(n // LANES, LANES, k // 2, 2).permute(0, 2, 1, 3).contiguous()


class PackedLinear(nn.Module):
    """A linear layer on the packed kernel: bf16 weights, or int8 weights with one bf16 scale per output row
    (`Int8WeightLinear`'s), rounding where those layers round."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @classmethod
    def of(cls, layer: nn.Module, mapped: list[tuple[int, int]] | None = None) -> PackedLinear | None:
        """The packed twin of `layer` (an `nn.Linear` with bf16 weights or an `Int8WeightLinear`), or None when its
        shape does not pack (output features not a multiple of 16, odd input features). `mapped`: the process's
        file mappings (`page_cache.file_mappings()`), where a weight's pages go back once packed."""
        if isinstance(layer, Int8WeightLinear):  # (bf16 scales and biases are exact in fp32, which the kernel reads)
            weight, scale = layer.weight, layer.weight_scale.detach().to(torch.bfloat16).float()
        elif type(layer) is nn.Linear and layer.weight.dtype == torch.bfloat16:
            weight, scale = layer.weight, None
        else:
            return None
        n, k = weight.shape
        if n % LANES or k % 2 or weight.device.type != "cpu":
            return None
        bias = None if layer.bias is None else layer.bias.detach().to(torch.bfloat16).float()
        packed = pack(weight)
        page_cache.release([weight.detach()], mapped)  # a mapped weight's pages go back: decoding reads `packed`
        return cls(packed, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.hf_bpd_kernels.packed_linear(x, self.packed, self.scale, self.bias)


def packing_unsupported_reason(base) -> str | None:
    """Why the kernel cannot serve `base`'s linear layers (None when it can: a bf16 CPU base, AVX512-BF16 or
    AVX2, the kernels built)."""
    if base.dtype != torch.bfloat16 or base.device.type != "cpu":
        return "the packed kernels serve bf16 bases on the CPU"
    return kernels_unsupported_reason()


def packed_base(base) -> nn.Module | None:
    """`base`'s module tree with every linear layer the kernel serves packed (see the module docstring), or None
    when this base or this machine has none to serve (not bf16, not on the CPU, no AVX512-BF16 or AVX2, build
    failed)."""
    if packing_unsupported_reason(base) is not None:
        return None
    with _lock:
        if weights.changed_since(base, _WEIGHTS_SEEN):  # the packed copies hold the old weights
            _CLONES.pop(base, None)
        clone = _CLONES.get(base)
        if clone is not None:
            return clone
        memo: dict[int, object] = {id(t): t for t in (*base.parameters(), *base.buffers())}
        for module in base.modules():
            config = getattr(module, "config", None)
            if config is not None:
                memo[id(config)] = config
        clone = copy.deepcopy(base, memo)
        replaced, mapped = 0, page_cache.file_mappings()
        for name, module in list(clone.named_modules()):
            twin = PackedLinear.of(module, mapped) if name else None
            if twin is not None:
                clone.set_submodule(name, twin)
                replaced += 1
        if not replaced:
            return None
        positions = getattr(getattr(base, "config", None), "max_position_embeddings", None)
        if isinstance(positions, int):
            table_rotary_embeddings(clone, positions)
        _CLONES[base] = clone
        return clone


def forget(base) -> None:
    """Drop `base`'s packed module tree (with its runners: the next compiled step packs the weights afresh)."""
    with _lock:
        _CLONES.pop(base, None)
