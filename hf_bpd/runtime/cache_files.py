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
