"""The artifact of a base too large to hold twice (`artifacts.MAX_FROZEN_WEIGHTS`): code only, unfrozen, its
constants the base's own tensors given at load by the process (`load_constants(user_managed=True)`).

Without freezing, inductor's GEMM templates (which pack the weights into the package) do not apply, and ATen's fp32
`linear` on unpacked weights is slow for the few rows a verification block has; oneDNN's linear on the same unpacked
weights comes close to the packed template (docs/performance.md), so the exported step's linear layers are rewritten
to it (`onednn_linears`). The step stays fp32, and the near-tie referee keeps decoding exact against eager
`generate()`.
"""

from __future__ import annotations

import torch

UNFROZEN_FORMAT = 1  # bump when the unfrozen step (its rewrite, its options) changes
# Built without freezing, nothing to autotune (the GEMMs are oneDNN's calls), the constants left out of the package.
UNFROZEN_OPTIONS = {"freezing": False, "max_autotune": False, "aot_inductor.package_constants_in_so": False}


def weight_bytes(base) -> int:
    """Bytes of `base`'s parameters and buffers (tied ones once)."""
    return sum(t.numel() * t.element_size() for t in [*base.parameters(), *base.buffers()])


def own_constants(base) -> dict[str, torch.Tensor]:
    """The constants an unfrozen artifact runs on: `base`'s parameters and buffers by the names the exported step
    gives them (it holds `base` as `base`; an ordered artifact's step holds the packed module tree there)."""
    tensors = [*base.named_parameters(remove_duplicate=False), *base.named_buffers(remove_duplicate=False)]
    return {f"base.{name}": t for name, t in tensors if t is not None}


def onednn_linears(exported):
    """`exported` with every fp32 `aten.linear` call made oneDNN's (`mkldnn._linear_pointwise` on the unpacked weight,
    which AOTInductor calls through its C shim); unchanged where PyTorch was built without oneDNN."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return exported
    for node in exported.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        x, weight, *bias = node.args
        if weight.meta["val"].dtype != torch.float32:
            continue
        node.target = torch.ops.mkldnn._linear_pointwise.default
        node.args = (x, weight, bias[0] if bias else None, "none", [], "")
    exported.graph.lint()
    exported.graph_module.recompile()
    return exported
