"""Handing a memory-mapped weight's pages back to the page cache once it has been read only to be copied or hashed.

transformers maps a safetensors file into memory when the file already holds the dtype asked for (a bf16 base from a
bf16 file), so the base's weights occupy memory only while their pages are resident. A bf16 base that decodes on
hf_bpd's kernels reads them to hash them (`weights.digest`) and to pack them (`packed_linear.packed_base`), or to
quantize them (`int8_weights.quantize_int8_weights`), and no more: decoding then reads the packed copy. `release`
hands such pages back (Linux `madvise(MADV_PAGEOUT)`): they stay in the file, and in the page cache while memory
allows, and the base reads them again, unchanged, the next time it computes with them (its own eager `generate()`).
So a process holds the packed weights once, not the packed and the base's own side by side.

Only pages of a file mapping are handed back: anonymous memory (a base converted from fp32, or a tensor made in this
process) is left alone, since paging it out would mean swapping a live weight. Pages a write made private keep their
content either way (the kernel keeps or swaps them, never drops them). Elsewhere than Linux `release` does nothing.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (clean file pages are dropped, private ones kept or swapped)
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise


def file_mappings() -> list[tuple[int, int]]:
    """This process's file-backed mappings as sorted `(start, end)` address ranges (from `/proc/self/maps`; none
    elsewhere than Linux)."""
    if not sys.platform.startswith("linux"):
        return []
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and fields[4] != "0":  # a path and an inode: a file
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return sorted(ranges)


def release(tensors: Iterable[torch.Tensor], ranges: list[tuple[int, int]] | None = None) -> int:
    """Hand back the resident pages of every CPU tensor here that lies inside a file mapping (see the module
    docstring); returns the bytes advised. Values are unchanged: the pages are read again on the next access.
    `ranges`: `file_mappings()` read once by a caller that releases tensor after tensor (each read parses
    `/proc/self/maps`)."""
    tensors = [t for t in tensors if t is not None and t.device.type == "cpu" and t.numel() and t.is_contiguous()]
    if not sys.platform.startswith("linux") or not tensors:
        return 0
    try:
        ranges = file_mappings() if ranges is None else ranges
    except OSError:
        return 0
    starts = [start for start, _ in ranges]
    page, advised = mmap.PAGESIZE, 0
    for tensor in tensors:
        begin = tensor.data_ptr()
        end = begin + tensor.numel() * tensor.element_size()
        i = bisect.bisect_right(starts, begin) - 1
        if i < 0 or end > ranges[i][1]:  # not (wholly) inside one file mapping
            continue
        first, last = -(-begin // page) * page, end // page * page  # whole pages only: neighbours keep theirs
        if last > first and _madvise()(first, last - first, MADV_PAGEOUT) == 0:
            advised += last - first
    return advised
