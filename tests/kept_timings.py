"""The timing tables a machine keeps under hf_bpd's cache, as the test session found them.

hf_bpd keeps what it times on a machine for later processes: an artifact's step costs (`step_costs.json`: a lone
call's blocks, and its batch steps per row count) and eager forward costs (`costs/*.json`). Tests on the shipped
checkpoints run on the user's artifacts, so their timings, taken while the suite loads both cores, would be kept and
priced every later call on that machine. `tests/conftest.py` takes a snapshot before the session and puts it back
after it.
"""

from __future__ import annotations

from pathlib import Path

KEPT = ("artifacts/*/step_costs.json", "costs/*.json")


def kept_tables(root: Path) -> dict[Path, bytes]:
    """Every kept timing table under the cache folder `root`, by path, with its bytes."""
    return {path: path.read_bytes() for pattern in KEPT for path in root.glob(pattern) if path.is_file()}


def restore(root: Path, before: dict[Path, bytes]) -> list[Path]:
    """Put `root`'s kept timing tables back as `before` (`kept_tables`) had them: tables written since are removed,
    changed or removed ones rewritten (where their folder still exists). Returns the paths it changed."""
    changed = []
    for path in sorted(set(kept_tables(root)) - set(before)):
        path.unlink(missing_ok=True)
        changed.append(path)
    for path, data in before.items():
        if path.parent.is_dir() and (not path.is_file() or path.read_bytes() != data):
            path.write_bytes(data)
            changed.append(path)
    return changed
