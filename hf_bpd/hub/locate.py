"""Where a model name points, decided before anything is downloaded and before any heavy import: a local directory, a
packaged alias, the local Hub cache, or the Hub itself (only when it can be reached).

A name that cannot work fails here in milliseconds with one line saying what was looked for where, instead of after
the Hub client's retries (measured: ~50 s per name with no network). `HF_HUB_OFFLINE=1` is respected: the Hub is
then never contacted.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
import stat
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from ..errors import BaseModelError
from ..limits import HUB_PROBE_TIMEOUT

# The PyPI-packaged base models (`hub.base_models.PACKAGED_MODELS`, which holds their details; a test keeps the two
# lists equal). Listed here too so that names can be checked without importing torch.
PACKAGED_ALIASES = ("smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-1.5b-instruct",
                    "qwen2.5-coder-0.5b-instruct")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
_probe: dict = {"at": 0.0, "reachable": None, "target": None}  # the last answer of `hub_reachable`


def cache_dir() -> Path:
    """Where converted base models, artifacts, kernels and KenLM live: `$HF_BPD_CACHE` (an empty value counts as
    unset), else `~/.cache/hf_bpd`."""
    return Path(os.environ.get("HF_BPD_CACHE") or Path.home() / ".cache" / "hf_bpd")


def trust_problem(path: Path) -> str | None:
    """Why hf_bpd must not run native code or compiled steps from `path` (None when it may): `path` must lie in the
    cache, and the cache folder and every folder or file from it down to `path` (and, for a folder, its entries)
    must be owned by this user, writable by nobody else and no symbolic link. The cache is the trust boundary:
    whoever can write there can run code in hf_bpd's processes."""
    root, path = cache_dir(), Path(path)
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return f"{path} is not inside hf_bpd's cache {root}"
    current, checked = root, []
    for part in ("", *parts):
        current = current / part if part else root
        checked.append(current)
    if path.is_dir() and not path.is_symlink():
        checked += sorted(path.iterdir())
    for number, item in enumerate(checked):
        try:
            info = os.stat(item) if number == 0 else os.lstat(item)  # the cache folder itself may be a link
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode):
            return f"{item} is a symbolic link"
        if info.st_uid != os.geteuid():
            return f"{item} belongs to another user (uid {info.st_uid})"
        if info.st_mode & 0o022:
            return f"{item} is writable by group or others (mode {oct(info.st_mode & 0o777)})"
    return None


def trusted(path: Path) -> Path:
    """`path`, after `trust_problem` found nothing wrong; else an OSError saying what (native code is then not
    loaded: its callers fall back to their pure-PyTorch paths)."""
    problem = trust_problem(path)
    if problem is not None:
        raise OSError(f"not loading {Path(path).name}: {problem}")
    return Path(path)


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) is set to a true value."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT) -> bool:
    """Whether a TCP connection to the Hub endpoint (or the HTTPS proxy, when one is set) opens within `timeout`
    seconds; the answer is kept for a minute."""
    proxy = next((os.environ[v] for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy") if os.environ.get(v)),
                 None)
    target = urlparse(proxy if proxy else hub_endpoint())
    host, port = target.hostname, target.port or (443 if target.scheme == "https" else 80)
    if _probe.get("target") == (host, port) and time.monotonic() - _probe["at"] < 60:
        return _probe["reachable"]
    result = {"ok": False}

    def connect():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result["ok"] = True
        except OSError:
            pass

    if host:
        worker = threading.Thread(target=connect, daemon=True)  # name resolution has no timeout of its own
        worker.start()
        worker.join(timeout + 0.2)
    _probe.update(at=time.monotonic(), reachable=result["ok"], target=(host, port))
    return result["ok"]


def _cached_snapshot(repo_id: str, filename: str = "config.json") -> Path | None:
    """The local snapshot directory of `repo_id` in the Hub cache when it holds `filename`, else None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        return None
    try:
        found = try_to_load_from_cache(repo_id, filename)
    except Exception:  # noqa: BLE001 - an invalid id for the cache layout: not cached
        return None
    return Path(found).parent if isinstance(found, str) else None


def _hub_cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except Exception:  # noqa: BLE001
        return "~/.cache/huggingface/hub"


def looks_like_path(name: str) -> bool:
    return (name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or name.count("/") > 1
            or name.endswith("/") or name in (".", ".."))


def locate(name, what: str = "model", aliases: bool = True) -> tuple[str, str]:
    """`(kind, where)` for a model name: `("alias", name)`, `("local", directory)`, `("hub-cache", snapshot
    directory)` (used when the Hub cannot or must not be contacted) or `("hub", repo_id)`; otherwise a one-line
    `BaseModelError` saying what was looked for where. `what` names the thing in messages ("base model", "heads
    checkpoint")."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not name.strip():
        raise BaseModelError(f"{what} name must be a non-empty string or path, got {name!r}: pass a local directory"
                             + (f", a packaged alias ({', '.join(PACKAGED_ALIASES)})" if aliases else "")
                             + " or a Hub id")
    if aliases and name in PACKAGED_ALIASES:
        return "alias", name
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise BaseModelError(f"could not load {what} {name!r}: it is a file: pass the directory that holds its "
                                 "config.json")
        if not (path / "config.json").is_file():
            raise BaseModelError(f"could not load {what} {name!r}: the directory holds no config.json: pass a "
                                 "directory written by save_pretrained (config.json + weights)")
        return "local", str(path)
    listing = f", not a packaged alias ({', '.join(PACKAGED_ALIASES)})" if aliases else ""
    if looks_like_path(name):
        raise BaseModelError(f"could not load {what} {name!r}: no directory there (looked for {path / 'config.json'})"
                             f": pass an existing directory" + (f", a packaged alias ({', '.join(PACKAGED_ALIASES)})" if aliases else "")
                             + " or a Hub id such as org/name")
    if not _REPO_ID.match(name) or "--" in name or ".." in name:
        raise BaseModelError(f"could not load {what} {name!r}: not a local directory{listing} and not a valid Hub id "
                             "(org/name): check the spelling")
    snapshot = _cached_snapshot(name)
    close = difflib.get_close_matches(name.lower(), PACKAGED_ALIASES, n=1, cutoff=0.75) if aliases else []
    if close and snapshot is None:
        raise BaseModelError(f"could not load {what} {name!r}: no such directory and not a packaged alias; did you "
                             f"mean {close[0]!r}?")
    if hub_offline():
        if snapshot is not None:
            return "hub-cache", str(snapshot)
        raise BaseModelError(f"could not load {what} {name!r}: not a local directory{listing}, nor in the Hub cache "
                             f"({_hub_cache_dir()}), and HF_HUB_OFFLINE is set: pass a local directory, or unset "
                             "HF_HUB_OFFLINE to download it")
    if not hub_reachable():
        if snapshot is not None:
            return "hub-cache", str(snapshot)
        raise BaseModelError(f"could not load {what} {name!r}: not a local directory{listing}, nor in the Hub cache "
                             f"({_hub_cache_dir()}), and the Hub ({hub_endpoint()}) cannot be reached: pass a local "
                             "directory, or connect and retry")
    return "hub", name
