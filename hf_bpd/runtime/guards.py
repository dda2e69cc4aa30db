"""How the compiled steps meet dynamo's guards (`hf_bpd.runtime.compiled`, `hf_bpd.runtime.batched`).

dynamo checks a compiled graph's guards before every call. A step's module tree is fixed once compiled (its weights
are frozen into the graph), so most of those checks only cost time; a guard on global state can still fail later in a
process, and the compilation it triggers must run under hf_bpd's settings.
"""

from __future__ import annotations

import re

import torch

_REPEATED_LAYER = re.compile(r"\._modules\['\d+'\]")  # a source inside a ModuleList (the decoder's layers)


def step_guards(entries) -> list[bool]:
    """The dynamo guards a compiled step keeps (`guard_filter_fn`): everything outside its module tree (the inputs'
    shapes and dtypes, the cache, global state), and the identity of the tensors outside the decoder's repeated layers
    (the output layer, the final norm, the embeddings), which tells one base's step from another's. Dropped: the checks
    of every layer's attributes, hooks and parameters, which are most of dynamo's lookup time on every call. A step's
    module tree does not change after compilation; its weights are frozen into the graph anyway."""
    return [not entry.orig_guard.source.is_unspecialized_nn_module()
            or (entry.guard_type == "ID_MATCH" and _REPEATED_LAYER.search(entry.name) is None) for entry in entries]


def call_compiled(compiled, *args):
    """`compiled(*args)` for a shape already compiled, or None where dynamo would compile again: a guard on global
    state can fail later in a process (transformers' output-capturing registry, for one, grows when another model
    class is loaded), and a compilation there would run without `_Patches` -- without the settings, under dynamo's
    default limit of 8 shapes per code object -- so the caller compiles under `_Patches` instead (the stance adds
    little to a call)."""
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            return compiled(*args)
    except RuntimeError as error:
        if "Detected recompile" not in str(error):
            raise
        return None


def compile_step(step):
    """`torch.compile` of a verification step with `step_guards` (fixed shapes: one graph per block shape)."""
    return torch.compile(step, dynamic=False, options={"guard_filter_fn": step_guards})
