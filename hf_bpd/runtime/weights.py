"""The exact identity of a base's weights, for everything that holds a copy of them (artifacts, compiled steps).

Compiled steps freeze the weights they were built from, so one may serve a base only while its weights are those.
`digest` reads every parameter's bytes (sha256 of names, shapes, dtypes and data): two bases that differ in any bit
get different digests. It is computed once per weights version: `marker`, checked before every compiled call, is
each parameter's storage and version counter (which `load_state_dict`, `copy_` and optimizer steps bump) plus 16
values of each tensor at full precision (writes through `.data`, as LoRA merges do, bump no version). A write through
`.data` that changes none of those values is not seen until the weights' versions change.
"""

from __future__ import annotations

import functools
import hashlib
import weakref

import numpy as np
import torch

from . import page_cache

PROBES = 16  # values per tensor in the marker
_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base -> (marker, digest or None)


@functools.lru_cache(maxsize=4096)
def _positions(nbytes: int, size: int) -> np.ndarray:
    """Byte offsets of `PROBES` evenly spaced elements of `size` bytes in a tensor of `nbytes` bytes."""
    n = nbytes // size
    k = min(PROBES, n)
    elements = np.arange(k, dtype=np.int64) * (n - 1) // max(k - 1, 1)
    return (elements[:, None] * size + np.arange(size, dtype=np.int64)).reshape(-1)


def _probe(param: torch.Tensor) -> bytes:
    data = param.detach()
    size = data.element_size()
    if data.device.type != "cpu" or not data.is_contiguous():  # gather the probed elements first, then copy them
        elements = torch.as_tensor(_positions(data.numel() * size, size)[::size] // size, device=data.device)
        data = data.reshape(-1)[elements].cpu()
    raw = data.reshape(-1).view(torch.uint8).numpy()
    return raw[_positions(raw.size, size)].tobytes()


def marker(base) -> tuple:
    """What changes when `base`'s weights change (see the module docstring); milliseconds for a 1.5B base."""
    params = [p for p in base.parameters()]
    with torch.no_grad():
        sampled = b"".join(_probe(p) for p in params if p.numel())
    return tuple((p.data_ptr(), p._version) for p in params), hashlib.sha256(sampled).hexdigest()


def digest(base) -> str:
    """sha256 of every parameter's name, shape, dtype and bytes; computed again only when `marker` changes."""
    mark = marker(base)
    known = _KNOWN.get(base)
    if known is not None and known[0] == mark and known[1] is not None:
        return known[1]
    h = hashlib.sha256()
    mapped = page_cache.file_mappings()
    with torch.no_grad():
        for name, param in base.named_parameters():
            h.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
            data = param.detach().contiguous().reshape(-1)
            if data.numel():
                h.update(memoryview(data.cpu().view(torch.uint8).numpy()))
                page_cache.release([param.detach()], mapped)  # read to hash only: a mapped weight's pages go back
    value = "sha256:" + h.hexdigest()
    _KNOWN[base] = (mark, value)
    return value


def changed_since(base, seen: weakref.WeakKeyDictionary) -> bool:
    """Whether `base`'s weights changed since this was last asked with `seen` (a holder's own record); the first
    question for a base answers False."""
    mark = marker(base)
    before = seen.get(base)
    seen[base] = mark
    return before is not None and before != mark
