"""hf_bpd's cache folders: small files written whole (measured cost tables beside artifacts and under
`$HF_BPD_CACHE`), the trust check and build locks of artifact folders, and inductor's build cache inside hf_bpd's."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from pathlib import Path

logger = logging.getLogger("hf_bpd")
LOCK = "build.lock"  # held by whoever builds in an artifact folder
ATTEMPTS = "attempts-{graph}"  # background builds of a graph whose worker has not ended (a death leaves it counted)
LOCK_WAIT = 3600  # seconds a builder waits for another's build in the same folder (an artifact takes minutes)


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


_DISTRUSTED: set[Path] = set()  # artifact folders this process has warned about (one line each)


def distrusted(directory: Path) -> bool:
    """Whether `directory` fails `hub.locate.trust_problem` (then nothing in it is loaded or built; one warning)."""
    from ..hub.locate import trust_problem

    problem = trust_problem(directory)
    if problem is not None and directory not in _DISTRUSTED:
        _DISTRUSTED.add(directory)
        warnings.warn(f"hf_bpd: no compiled step is used from {directory}: {problem} (decoding eagerly; fix the "
                      "cache's ownership and permissions, or set HF_BPD_CACHE to a folder of your own)", stacklevel=4)
    return problem is not None


def open_lock(directory: Path, name: str = LOCK):
    """The folder's lock file `name` (the build lock by default), opened for writing without following a symbolic
    link (`O_NOFOLLOW`)."""
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "w")


def inductor_cache_env() -> dict:
    """inductor's own build cache inside hf_bpd's (not `/tmp/torchinductor_$USER`, which anyone may create first)."""
    from ..hub.locate import cache_dir

    return {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir() / "inductor")}


def claim_lock(directory: Path):
    """The folder's build lock, taken without waiting, or None when a build holds it (or it cannot be opened, as a
    symbolic link cannot)."""
    import fcntl

    try:
        lock = open_lock(directory)
    except OSError:
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return None
    return lock


@contextlib.contextmanager
def inductor_cache():
    """inductor's build cache under `inductor_cache_env()` while an artifact compiles."""
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ.update(inductor_cache_env())
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def wait_for_lock(lock, directory: Path, log=None) -> None:
    """Take `directory`'s build lock, waiting at most `LOCK_WAIT` seconds for a build under way (saying so once)."""
    import fcntl

    deadline = time.monotonic() + LOCK_WAIT
    told = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"a build in {directory} held its lock for over {LOCK_WAIT // 60} minutes: "
                                   "let it finish, or end it and run `hf-bpd compile --clear`") from None
            if not told:
                told = True
                (log or (lambda line: logger.warning("hf_bpd: %s", line)))(
                    f"waiting for the build under way in {directory} (up to {LOCK_WAIT // 60} minutes)")
            time.sleep(0.5)
