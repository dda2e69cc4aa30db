"""`hf_bpd.runtime.frame_stack`: decoding runs on a frame-stack chunk of its own, so a loop of calls does not map and
unmap CPython's frame-stack chunks at any caller depth."""

import resource
import sys

import pytest
import torch

from hf_bpd.runtime import frame_stack
from hf_bpd.runtime.frame_stack import on_fresh_frame_stack

from .test_decoding import random_bpd

needs_data_stack = pytest.mark.skipif(sys.version_info < (3, 11), reason="frames live on a data stack from 3.11")


def _with_locals(name: str, count: int, body: str):
    """A function whose frame holds `count` locals (its size on the frame stack grows with them)."""
    source = f"def {name}(depth, fn, *args):\n    " + " = ".join(f"v{i}" for i in range(count)) + " = 0\n" + body
    namespace = {}
    exec(source, namespace)
    return namespace[name]


# a leaf frame of ~2.4 KiB and caller levels of ~0.8 KiB: at every chunk boundary some caller depth leaves less room
# than the leaf needs, so that the leaf maps a chunk on every call
_leaf = _with_locals("_leaf", 300, "    return depth + 1\n")


def _loop(n):
    """A loop whose every iteration pushes and pops one frame (`_leaf`)."""
    total = 0
    for _ in range(n):
        total = _leaf(total, None)
    return total


_at_depth = _with_locals("_at_depth", 100, "    return fn(*args) if depth == 0 else _at_depth(depth - 1, fn, *args)\n")
_at_depth.__globals__["_at_depth"] = _at_depth


def _faults(fn, *args) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn(*args)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@needs_data_stack
def test_a_loop_pays_no_chunk_faults_at_any_caller_depth():
    iterations, depths = 500, range(0, 1500, 2)  # callers up to ~1.2 MiB deep: chunk boundaries crossed
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + max(depths) + 100)
    try:
        # the faults of the loop beyond those of reaching its depth (deep callers map chunks of their own)
        plain = [_faults(_at_depth, d, _loop, iterations) - _faults(_at_depth, d, _loop, 0) for d in depths]
        fresh = [_faults(_at_depth, d, on_fresh_frame_stack, _loop, iterations)
                 - _faults(_at_depth, d, on_fresh_frame_stack, _loop, 0) for d in depths]
    finally:
        sys.setrecursionlimit(limit)
    # the control: at some caller depth, the leaf's frame crosses a chunk boundary on every iteration
    assert max(plain) >= iterations, max(plain)
    assert max(fresh) < 50, max(fresh)


@needs_data_stack
def test_the_trampoline_reserves_its_chunk():
    code = frame_stack._trampoline.__code__
    assert code.co_stacksize * 8 >= frame_stack.RESERVED_BYTES
    assert on_fresh_frame_stack(lambda a, b=0: a + b, 2, b=3) == 5


def test_decoding_runs_on_a_fresh_chunk():
    model = random_bpd("llama", 0)
    seen = []

    def hook(module, args):
        frame, names = sys._getframe(), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        seen.append(names)

    handle = model.base_lm.register_forward_pre_hook(hook)
    try:
        ids = torch.tensor([[1, 5, 9, 4]])
        model.generate(input_ids=ids, max_new_tokens=4, compile=False)
    finally:
        handle.remove()
    assert seen and all("_trampoline" in names for names in seen)
