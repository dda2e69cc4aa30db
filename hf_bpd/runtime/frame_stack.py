"""Decoding on a fresh chunk of CPython's frame stack: a step's speed does not depend on the caller's stack depth.

CPython 3.11+ keeps Python frames on a per-thread data stack made of chunks (16 KiB and up). A call whose frame does
not fit in the current chunk maps a new chunk (`mmap`), and its return unmaps it. When a caller's stack depth puts a
chunk boundary inside the loop of a decoding step, every step maps and unmaps chunks and faults their pages in again.
Such a caller makes every step markedly slower, the faster the step the larger the share (docs/performance.md, "Why
the compiled step is fast"); on a fresh chunk a step runs at the same speed at every caller depth.

`on_fresh_frame_stack(fn, ...)` calls `fn` from a trampoline whose frame is declared large (`co_stacksize`), so
CPython starts a new chunk for it that leaves `RESERVED_BYTES` free for `fn` and everything it calls, whatever the
depth of the caller. The chunk is mapped once per call; its pages are touched only as frames use them. Older Pythons
(heap-allocated frames) call `fn` directly.
"""

from __future__ import annotations

import sys
import types

RESERVED_BYTES = 1 << 20  # the trampoline's declared frame: its chunk holds at least this much for the callees


def _trampoline(fn, args, kwargs):
    return fn(*args, **kwargs)


if sys.version_info >= (3, 11):
    # a larger co_stacksize only makes CPython reserve more value-stack slots in the frame (never read)
    _code = _trampoline.__code__
    _trampoline = types.FunctionType(_code.replace(co_stacksize=_code.co_stacksize + RESERVED_BYTES // 8),
                                     globals(), "_trampoline")


def on_fresh_frame_stack(fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, with its frames on a frame-stack chunk of their own (see the module docstring)."""
    return _trampoline(fn, args, kwargs)
