"""Builds beside `generate()`: with `compile=True`, a call never waits for a compiler.

When a base has no artifact for this machine yet (`hf_bpd.runtime.artifacts`), the first compiled call starts a
build in a worker process and decodes at once with eager verification (a position-ordered bf16 base, whose artifact
is code only: with its step compiled in the call, as only a compiled step is exact against its plain decoding); every
later call looks again and switches to the artifact when it is there. The worker:

* gets a copy of the base's weights (`save_pretrained`, safetensors, in the artifact's folder; deleted once loaded),
  so it builds for the base as it is in the caller's process, whatever it was loaded from; the key's weight
  fingerprint and dtype are checked again in the worker;
* builds the int8 heads kernel (`hf_bpd.runtime.int8_heads`), then the artifact (minutes; the one-token batch
  step, asked for by the first batch, takes minutes more), with the caller's thread count
  (baked into the GEMM code), at idle CPU priority (`SCHED_IDLE` on Linux, else `nice` 19): it takes only the CPU
  time the caller leaves;
* outlives the caller (its own process group): a short script's process may end; the build finishes and the next
  process loads the artifact;
* logs to `build.log` in the artifact's folder; a failed build leaves `build.failed` (its error), and no later call
  starts it again until `hf-bpd compile CKPT` (which builds in the foreground and shows the error) or
  `hf-bpd compile --clear`.

The builder holds the artifact's file lock, so two processes never build the same one; a process that finds the
lock held waits for nothing and decodes eagerly. `generate(compile="wait")` builds in the caller instead, before
decoding (benchmarks); `HF_BPD_OFF=artifacts` turns artifacts off (`compile=True` then compiles with `torch.compile`
in the call, as on GPUs).

The worker is `hf_bpd.runtime.build_worker`, started by `start_build`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from safetensors.torch import save_model

from . import artifacts

logger = logging.getLogger("hf_bpd")
WEIGHTS = "base"  # the copy of the base's weights the worker loads, in the artifact's folder
REQUEST = "request-{graph}-{pid}.json"  # the key the worker builds a graph under, one file per calling process
_WORKERS: dict[Path, object] = {}  # artifact folder -> the thread (saving the weights) or worker process started here
_TOLD: set[tuple[Path, str]] = set()  # (folder, graph) builds this process has announced (one line each)
_LOCK = threading.Lock()


def _lock_held(directory: Path) -> bool:
    """Whether some process is building in `directory` (holds its lock)."""
    import fcntl

    try:
        with artifacts.open_lock(directory) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return True
            fcntl.flock(lock, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


def building(directory: Path) -> bool:
    """Whether a build of `directory`'s artifact is under way (started here or by another process)."""
    worker = _WORKERS.get(directory)
    if isinstance(worker, threading.Thread) and worker.is_alive():
        return True
    if isinstance(worker, subprocess.Popen) and worker.poll() is None:
        return True
    return directory.is_dir() and _lock_held(directory)


def ready_artifact(base, graph: str = artifacts.STEP):
    """`graph` of `base`'s artifact (`artifacts.STEP` or a batch step) if it is
    loaded or built by now, else None, after starting its build in the background unless one is under way in its
    folder or its last one failed."""
    artifact = artifacts.load(base, graph=graph)
    if artifact is not None or artifacts.unsupported_reason(base) is not None:
        return artifact
    key = artifacts.cached_key(base)
    directory = artifacts.key_dir(key)
    if artifacts.distrusted(directory if directory.is_dir() else artifacts.artifacts_dir()):
        return None
    _, record, failed = artifacts.graph_files(directory, graph)
    told = (directory, graph)
    with _LOCK:
        if building(directory):
            return None
        if record.exists():  # built since this process last looked (here or elsewhere)
            artifact = artifacts.load(base, again=True, graph=graph)
            if artifact is not None:
                return artifact
        if failed.exists():
            if told not in _TOLD:
                _TOLD.add(told)
                error = failed.read_text().strip().splitlines()[-1:] or ["?"]
                logger.warning("hf_bpd: the background build of %s failed (%s); %s. `hf-bpd compile CHECKPOINT` "
                               "builds it in the foreground", artifacts.DESCRIPTION[graph], error[0][:200],
                               _meanwhile(base, graph))
            return None
        start_build(base, key, directory, graph)
    return None


def _meanwhile(base, graph: str) -> str:
    """What the calls run on until `graph` is built."""
    if graph == artifacts.STEP and artifacts.supplies_constants(base):
        return "the step is compiled in each process"
    return _MEANWHILE[graph]


_MEANWHILE = {artifacts.STEP: "decoding eagerly",
              artifacts.ONE_TOKEN: "batches run their one-token steps on the compiled step",
              artifacts.TWO_TOKENS: "batches run their two-token steps on the compiled step"}


def worker_command(directory: Path, graph: str, request: str, lock_fd: int | None = None) -> list[str]:
    """The build worker's command line. `-P` (and the artifact folder as its working directory): the worker imports
    hf_bpd's installed code only, never a module that happens to lie in the caller's working directory."""
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "hf_bpd.runtime.build_worker",
            str(directory), graph, request, *([str(lock_fd)] if lock_fd is not None else [])]


ATTEMPTS = artifacts.ATTEMPTS  # builds of a graph started whose worker has not ended; a third is not started
MAX_ATTEMPTS = 2  # a build whose worker died this many times (killed, out of memory) is recorded as failed


def _clean_leftovers(directory: Path) -> None:
    """Remove what dead builds left in `directory` (weight copies, requests, partial packages); called only while
    holding its lock, so no live build owns any of them."""
    for item in directory.iterdir():
        if item.name.startswith((f"{WEIGHTS}-", "request-", ".partial-")) and not item.is_symlink():
            shutil.rmtree(item) if item.is_dir() else item.unlink(missing_ok=True)


def start_build(base, key: dict, directory: Path, graph: str = artifacts.STEP) -> None:
    """Claim `directory`'s build lock (without waiting: a build under way there is left alone), clean up after dead
    builds, then save `base`'s weights for the worker and start it off the calling thread (saving the weights takes
    a while). The worker inherits the lock, so from the claim to its end no other process starts a build there. A
    graph whose worker died `MAX_ATTEMPTS` times is recorded as failed instead."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = artifacts.claim_lock(directory)
    if lock is None:  # another process builds here
        return
    _, record, failed = artifacts.graph_files(directory, graph)
    attempts_file = directory / ATTEMPTS.format(graph=graph)
    try:
        _clean_leftovers(directory)
        attempts = int(attempts_file.read_text() or 0) if attempts_file.is_file() else 0
        if record.exists() or failed.exists():  # built or failed since the caller looked
            lock.close()
            return
        if attempts >= MAX_ATTEMPTS:
            failed.write_text(f"the build's worker died {attempts} times without a word (killed, or out of memory; "
                              f"see {directory / 'build.log'})\n")
            attempts_file.unlink()
            lock.close()
            return
        attempts_file.write_text(str(attempts + 1))
    except BaseException:
        lock.close()
        raise
    if (directory, graph) not in _TOLD:
        _TOLD.add((directory, graph))
        logger.warning("hf_bpd: building %s for this machine in the background (%s, %d threads; log: %s); %s until "
                       "it is ready", artifacts.DESCRIPTION[graph], key["cpu"], key["threads"], directory / "build.log",
                       _meanwhile(base, graph))

    def save_and_start():
        try:
            weights = directory / f"{WEIGHTS}-{os.getpid()}"
            weights.mkdir(mode=0o700)
            # not `base.save_pretrained`: it would set fields of the caller's config (and print a progress bar)
            copy.deepcopy(base.config).save_pretrained(weights)
            int8 = _save_weights(base, weights / "model.safetensors")
            request = directory / REQUEST.format(graph=graph, pid=os.getpid())
            request.write_text(json.dumps({**key, "weights_dir": weights.name, **int8}, indent=1))
            # Its own process group (Ctrl-C in a terminal reaches the caller only), but the caller's session: with
            # Linux's autogroup scheduling a new session would get an equal share of the CPU whatever its priority,
            # and the caller's decoding would slow down beside the build.
            group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
            with open(directory / "build.log", "ab") as log:
                _WORKERS[directory] = subprocess.Popen(
                    worker_command(directory, graph, request.name, lock.fileno()), cwd=directory,
                    pass_fds=(lock.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    **group, env={**os.environ, "OMP_NUM_THREADS": str(key["threads"]),
                                  "TORCHINDUCTOR_COMPILE_THREADS": "1", **artifacts.inductor_cache_env()})
        except Exception as error:  # noqa: BLE001 - the caller decodes eagerly whatever happens here
            failed.write_text(f"starting the build: {type(error).__name__}: {error}\n")
        finally:
            lock.close()  # the worker holds the lock through its own copy of the descriptor

    # Not a daemon: a short script that ends now still leaves a complete weight copy and a started worker.
    thread = threading.Thread(target=save_and_start, name="hf_bpd-artifact-save")
    _WORKERS[directory] = thread
    thread.start()


def _save_weights(base, path: Path) -> dict:
    """Save `base`'s weights for the worker; returns what else the request must say. An int8-weight base (its artifact
    is code only: the worker needs the layout of its constants, not their values) is saved as bf16 with its
    `Int8WeightsConfig`, which the worker applies again."""
    from .int8_weights import float_state_dict, has_int8_weights

    if not has_int8_weights(base):
        save_model(base, str(path))  # tied tensors once
        return {}
    from safetensors.torch import save_file

    state, seen = {}, set()
    for name, tensor in float_state_dict(base).items():
        if tensor.data_ptr() not in seen:  # tied tensors once (loading ties them again)
            seen.add(tensor.data_ptr())
            state[name] = tensor.contiguous()
    save_file(state, str(path), metadata={"format": "pt"})
    return {"int8_weights": {"output_layer": bool(base.int8_weights.output_layer)}}


def wait(directory: Path, timeout: float | None = None) -> bool:
    """Wait for this process's worker of `directory`; True when it finished. (`compile="wait"` waits through the
    artifact's file lock instead, for a build started by any process.)"""
    worker = _WORKERS.get(directory)
    if isinstance(worker, threading.Thread):
        worker.join(timeout)
        worker = _WORKERS.get(directory)
    if isinstance(worker, subprocess.Popen):
        try:
            worker.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
    return True

