"""Writing hf_bpd's small cache files (measured cost tables beside artifacts and under `$HF_BPD_CACHE`)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def store_json(path: Path, data) -> bool:
    """Write `data` as JSON to `path` whole or not at all (a temporary file renamed into place), best effort: a cache
    that cannot be written only means measuring again. Returns whether it was written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(data, indent=1))
        os.replace(partial, path)
        return True
    except OSError:
        return False


STALE_STEPS = 16  # a process's steps of a kept cost that are checked against it (`KeptCostCheck`)
STALE_SHARE = 0.25  # their median this far from the kept cost: the kept table is wrong (dropped and timed again)


class KeptCostCheck:
    """Checks a kept step-cost table (timed by an earlier process, read from a file) against this process's own steps.

    A kept table can be wrong for good: timed while the machine was loaded, every later process would read it. So
    each kept entry is checked once per process: the median of the first `STALE_STEPS` steps priced by it, if
    `STALE_SHARE` off the kept figure, condemns the whole table (the caller drops it and its file, and times again).
    """

    def __init__(self, kept=()):
        self.unchecked = set(kept)  # kept entries not yet checked against this process's steps
        self.seen: dict = {}  # entry -> ms of this process's steps of it (while unchecked)

    def __contains__(self, entry) -> bool:
        return entry in self.unchecked

    def step(self, entry, ms: float, kept_ms: float) -> bool:
        """A step priced by kept entry `entry` (`kept_ms`) took `ms`; returns whether the kept table is now found
        wrong (after `STALE_STEPS` steps of the entry, their median `STALE_SHARE` off `kept_ms`; nothing is checked
        again then)."""
        seen = self.seen.setdefault(entry, [])
        seen.append(ms)
        if len(seen) < STALE_STEPS:
            return False
        median = sorted(seen)[len(seen) // 2]
        self.unchecked.discard(entry)
        del self.seen[entry]
        if abs(median - kept_ms) <= STALE_SHARE * kept_ms:  # (a kept 0 ms is wrong)
            return False
        self.unchecked.clear()
        self.seen.clear()
        return True
