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


COSTS_FILE = "step_costs.json"  # an artifact's kept step costs, one table per entry (`KeptCosts`)


class KeptCosts:
    """One entry of the step costs kept beside an artifact (`COSTS_FILE`): `{tokens: ms}` of the steps that `entry`
    names (the rows and the graphs that ran them: "1 row", "4 rows, one-token batch step", ...), timed once per
    machine (the artifact is per CPU and thread count) so that a later process reads them instead of timing its steps.
    Each process checks the entries it read against its own steps (`KeptCostCheck`); a table they contradict is
    dropped, from the file too, and timed again. Writes are best effort: a read-only cache only means timing again."""

    def __init__(self, artifact, entry: str):
        path = getattr(artifact, "path", None)
        self.path = None if path is None else Path(path).parent / COSTS_FILE
        self.entry = entry
        self.table = self._read()  # what this process prices its steps by, as kept
        self.check = KeptCostCheck(self.table)

    def __contains__(self, tokens) -> bool:
        """Whether steps over `tokens` tokens are still to be checked against the kept table."""
        return tokens in self.check

    def _file(self) -> dict | None:
        """The file's entries (`{}` when there is none; None when it cannot be read or holds no entries)."""
        if self.path is None or not self.path.is_file():
            return {}
        try:
            stored = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return stored if isinstance(stored, dict) else None

    def _read(self) -> dict[int, float]:
        try:
            return {int(n): float(ms) for n, ms in (self._file() or {})[self.entry].items() if float(ms) > 0}
        except (KeyError, ValueError, TypeError, AttributeError):  # none, or not a {tokens: ms} table
            return {}

    def keep(self, table: dict[int, float] | None) -> None:
        """Keep `table` as this entry (None: drop the entry); the other entries stay as they are. A cost it changes is
        no longer checked (this process timed it)."""
        old, self.table = self.table, dict(table or {})
        for tokens in [n for n in self.check.unchecked if self.table.get(n) != old.get(n)]:
            self.check.unchecked.discard(tokens)
            self.check.seen.pop(tokens, None)
        stored = self._file()
        if self.path is None or stored is None:  # (an artifact without a file: nothing to keep it in)
            return
        stored = {e: t for e, t in stored.items() if isinstance(t, dict)}  # (entries only)
        if table is not None:
            stored[self.entry] = {str(n): round(ms, 3) for n, ms in sorted(table.items())}
        elif stored.pop(self.entry, None) is None:
            return
        store_json(self.path, stored)

    def contradicted(self, tokens: int, ms: float) -> bool:
        """A step over `tokens` tokens, priced by the kept table, took `ms`: whether the table is now found wrong (see
        `KeptCostCheck`); then it is dropped here and from the file."""
        if tokens not in self.check or not self.check.step(tokens, ms, self.table[tokens]):
            return False
        self.keep(None)
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
