"""A base with int8 weights that compiles, exact: `from_pretrained(..., dtype=torch.bfloat16,
quantization_config=Int8WeightsConfig())` (CLI: `--quantize int8`).

Every linear layer of the decoder and the output layer keeps its weight as int8 with one bf16 scale per output row
(symmetric: `scale = max |row| / 127`, `weight = round(w / scale)`), a quarter of the fp32 bytes, and computes
`linear(x, weight.to(bf16)) * scale` on bf16 activations. The embeddings and the norms stay bf16. That expression is
the one inductor's weight-only int8 lowering recognises (with `freezing`): compiled, each layer is one of its CPU GEMM
templates reading the int8 weight directly (dequantized in registers, fp32 accumulation), so the compiled steps run on
a quarter of the fp32 weight bytes; eagerly it is the same arithmetic through a dequantized copy (slow, correct).

Exactness: the templates' small-row micro-kernels add a row's products in the same order whatever the number of
rows; what also matters is where inductor rounds to bf16. Fused into a GEMM's epilogue, the scale multiply and the
residual add can stay in fp32 for one block length and be rounded to bf16 for another, so a block's rows would differ
from one-token steps; `emulate_precision_casts` makes inductor round wherever the eager program does, and with
position-ordered attention (`hf_bpd.runtime.ordered_attention`) a block's rows equal one-token steps bit for bit
(`tests/test_int8_weights.py`).

The heads keep the base's activation dtype. `QuantoConfig(weights="int8")` (optimum-quanto) also loads, for eager
decoding only: its quantized tensors cannot be frozen into a compiled step.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import BPDConfigError
from . import page_cache

INT8_ACTIVATION_DTYPE = torch.bfloat16  # inductor's weight-only int8 templates take bf16 activations
DEQUANTIZE_ROWS = 4096  # rows dequantized at a time (`Int8WeightLinear.dequantized_weight`)


@dataclass
class Int8WeightsConfig:
    """Int8 weights for the base's linear layers (`quantization_config=` of `BlockwiseParallelForCausalLM.
    from_pretrained` and `hf_bpd.load_base`): the decoder's linear layers and, with `output_layer`, the output
    layer (the input embeddings stay bf16 either way). Activations are bf16: load with `dtype=torch.bfloat16`."""

    output_layer: bool = True


class Int8WeightLinear(nn.Module):
    """`nn.Linear` with an int8 weight and one bf16 scale per output row (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightLinear:
        """The int8 form of `linear` (symmetric per output row)."""
        with torch.no_grad():
            weight = linear.weight.detach().float()
            scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
            scale = scale.to(INT8_ACTIVATION_DTYPE)
            quantized = torch.round(weight / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
            bias = None if linear.bias is None else linear.bias.detach().to(INT8_ACTIVATION_DTYPE)
        return cls(quantized, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(x.dtype)) * self.weight_scale
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight the layer computes with, in bf16 (as a plain linear layer would hold it); with `rows` (indices)
        only those rows. Converted a block of rows at a time into the result, so a 150k-row output layer needs no
        fp32 copy of itself (the values are those of the whole-matrix expression, element by element)."""
        weight, scale = self.weight, self.weight_scale
        if rows is not None:
            rows = rows.to(weight.device)
            weight, scale = weight.index_select(0, rows), scale.index_select(0, rows)
        out = torch.empty(weight.shape, dtype=INT8_ACTIVATION_DTYPE, device=weight.device)
        for start in range(0, weight.shape[0], DEQUANTIZE_ROWS):
            block = slice(start, start + DEQUANTIZE_ROWS)
            out[block] = (weight[block].to(torch.float32) * scale[block].float()[:, None]).to(INT8_ACTIVATION_DTYPE)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def saved_int8_file(directory: Path, config: Int8WeightsConfig) -> Path:
    """Where `quantize_int8_weights` keeps the int8 weights of the bf16 base in `directory` (a cache folder hf_bpd
    owns): named by this module's source and the config, so a changed quantizer never reads an old file."""
    source = hashlib.sha256(Path(__file__).read_bytes() + repr(config).encode()).hexdigest()[:16]
    return Path(directory) / f"int8-weights-{source}.safetensors"


def _int8_layer(layer: nn.Linear, name: str, saved: dict | None) -> Int8WeightLinear:
    if saved is None:
        return Int8WeightLinear.from_linear(layer)
    bias = saved.get(f"{name}.bias")
    return Int8WeightLinear(saved[f"{name}.weight"], saved[f"{name}.weight_scale"], bias)


def quantize_int8_weights(base, config: Int8WeightsConfig | None = None, saved_file: Path | None = None) -> int:
    """Replace `base`'s decoder linear layers (and its output layer) by `Int8WeightLinear`s, in place; returns how
    many. The base must be bf16 (one-line `BPDConfigError` otherwise). With `saved_file` (`saved_int8_file`) the int8
    weights are read from it, mapped into memory like the base's (the bf16 weights are then never read), or written
    to it for the next process."""
    config = config or Int8WeightsConfig()
    if base.dtype != INT8_ACTIVATION_DTYPE:
        raise BPDConfigError(f"int8 weights compute with bf16 activations, the base is {base.dtype}: load it with "
                             "dtype=torch.bfloat16 (CLI: --dtype bf16)")
    decoder, output = base.get_decoder(), base.get_output_embeddings()
    swaps = [(module, name, child) for module in decoder.modules() for name, child in module.named_children()
             if isinstance(child, nn.Linear)]
    names = {id(module): name for name, module in base.named_modules()}
    if config.output_layer and isinstance(output, nn.Linear):
        parent_name, _, leaf = names[id(output)].rpartition(".")
        swaps.append((base.get_submodule(parent_name) if parent_name else base, leaf, output))
    saved = None
    if saved_file is not None and Path(saved_file).is_file():
        saved = load_file(str(saved_file))  # mapped: pages are read as the layers compute
        if not all(f"{names[id(child)]}.weight" in saved for _, _, child in swaps):
            saved = None  # another base's: quantize again and replace it
    mapped = page_cache.file_mappings()
    layers = {}
    for module, name, child in swaps:
        layer = layers[names[id(child)]] = _int8_layer(child, names[id(child)], saved)
        setattr(module, name, layer)
        page_cache.release([child.weight.detach()], mapped)  # read for the last time: a mapped weight's pages go back
    if saved_file is not None and saved is None:
        _save_int8(layers, Path(saved_file))
    if config.output_layer and getattr(base.config.get_text_config(), "tie_word_embeddings", False):
        base.config.get_text_config().tie_word_embeddings = False  # the output layer has its own (int8) weight now
    base.int8_weights = config
    return len(swaps)


def _save_int8(layers: dict[str, Int8WeightLinear], target: Path) -> None:
    """The int8 layers' tensors into `target`, written whole under a temporary name and renamed (a reader sees the
    complete file or none); a failure to write (a full disk) only costs the next process the quantization."""
    tensors = {}
    for name, layer in layers.items():
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = layer.weight, layer.weight_scale
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.detach()
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial))
        os.replace(partial, target)
    except OSError as error:
        warnings.warn(f"could not save the int8 weights to {target} ({error}): the next load quantizes again",
                      stacklevel=3)
        partial.unlink(missing_ok=True)


def split_int8_weights(quantization_config):
    """`(Int8WeightsConfig or None, what goes to transformers' from_pretrained)` for a `quantization_config=`."""
    if isinstance(quantization_config, Int8WeightsConfig):
        return quantization_config, None
    return None, quantization_config


def has_int8_weights(base) -> bool:
    """Whether `quantize_int8_weights` has converted `base`."""
    return getattr(base, "int8_weights", None) is not None


def float_weight(layer: nn.Module, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`layer.weight` as the floating-point values it computes with (an int8 layer's dequantized); with `rows`
    (indices) only those rows (an int8 layer dequantizes only them)."""
    if isinstance(layer, Int8WeightLinear):
        return layer.dequantized_weight(rows)
    return layer.weight if rows is None else layer.weight[rows.to(layer.weight.device)]


def float_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` as a module with plain linear layers would hold it: each int8 layer's dequantized
    weight under `weight`, without its scale (to initialise a bf16 copy of a layer from an int8 base)."""
    state = module.state_dict()
    for name, layer in module.named_modules():
        if isinstance(layer, Int8WeightLinear):
            prefix = f"{name}." if name else ""
            state[f"{prefix}weight"] = layer.dequantized_weight()
            del state[f"{prefix}weight_scale"]
    return state
