"""The background build's worker process (`python -P -m hf_bpd.runtime.build_worker FOLDER GRAPH REQUEST [LOCK_FD]`,
started by `hf_bpd.runtime.background.start_build`): checks the request, loads the copy of the caller's base saved in
FOLDER, builds the int8 heads kernel (for the step) and then the artifact's GRAPH under the caller's key, at idle CPU
priority, holding the build lock it inherited; records a failure in the graph's failure note (`build.failed` for
the step)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from . import artifacts
from .background import ATTEMPTS, REQUEST


def main(directory: Path, graph: str = artifacts.STEP, request_name: str = "", lock_fd: int | None = None) -> int:
    """The worker: load the saved base, build the int8 kernel and `graph` of the artifact under the key requested in
    `request_name`, holding the build lock the caller claimed (`lock_fd`, inherited; else it takes the lock)."""
    import re

    from transformers import AutoModelForCausalLM

    failed = artifacts.graph_files(directory, graph)[2]
    if not re.fullmatch(REQUEST.format(graph=re.escape(graph), pid="[0-9]+"), request_name):
        failed.write_text(f"refused: a request file named {request_name!r}\n")
        return 2
    lock = os.fdopen(lock_fd, "w") if lock_fd is not None else None
    request_file = directory / request_name
    request = json.loads(request_file.read_text())
    weights_name = str(request.pop("weights_dir", ""))
    int8 = request.pop("int8_weights", None)  # an int8-weight base, saved as bf16: quantized again here
    key = request
    problem = refusal(key, weights_name, directory)
    if problem is not None:
        failed.write_text(f"refused: {problem}\n")
        print(f"refused: {problem}", flush=True)
        request_file.unlink(missing_ok=True)
        return 2
    idle_priority()  # after the checks (a refused request ends at once), before any thread starts
    weights = directory / weights_name
    torch.set_num_threads(key["threads"])
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{stamp} building {directory.name} {graph} ({key['cpu']}, {key['threads']} threads, {key['dtype']})",
          flush=True)
    try:
        dtype = getattr(torch, key["dtype"].split(".")[-1])
        base = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype).eval()
        if int8 is not None:
            from .int8_weights import Int8WeightsConfig, quantize_int8_weights

            quantize_int8_weights(base, Int8WeightsConfig(output_layer=bool(int8.get("output_layer", True))))
        shutil.rmtree(weights, ignore_errors=True)
        if graph == artifacts.STEP:
            try:
                from .int8_heads import build_kernel

                build_kernel()
            except Exception as error:  # noqa: BLE001 - generate() warns about it when it asks for the kernel
                print(f"int8 heads kernel: {error}", flush=True)
        path = artifacts.build(base, log=lambda line: print(line, flush=True), key=key, graph=graph, lock=lock)
        print(f"ready: {path}", flush=True)
    except Exception as error:  # noqa: BLE001 - recorded for the callers, who decode eagerly
        failed.write_text(f"{type(error).__name__}: {str(error).splitlines()[0][:500]}\n")
        print(f"failed: {type(error).__name__}: {error}", flush=True)
        return 1
    finally:
        shutil.rmtree(weights, ignore_errors=True)
        request_file.unlink(missing_ok=True)
        (directory / ATTEMPTS.format(graph=graph)).unlink(missing_ok=True)  # it ended (built or failed), not died
    return 0


def refusal(key: dict, weights_name: str, directory: Path) -> str | None:
    """Why this worker will not build the request (None when it will): a weight folder named otherwise than the
    callers name it (`base-<pid>`, inside the artifact folder), a key of another format or of other hf_bpd, torch
    or transformers versions than the worker's own, or a folder that is not the key's own."""
    import re

    import transformers

    from .. import __version__

    if not re.fullmatch(r"base-[0-9]+", weights_name):
        return f"a weight folder named {weights_name!r}"
    mine = {"format": artifacts.FORMAT, "hf_bpd": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__}
    theirs = {name: key.get(name) for name in mine}
    if theirs != mine:
        return f"a request for {theirs}, this worker is {mine}"
    if artifacts.key_dir(key).resolve() != directory.resolve():
        return "the key names another artifact folder"
    return None


def idle_priority() -> None:
    """This process at idle CPU priority (before it starts threads: Linux applies both per thread)."""
    os.nice(19)
    try:  # when memory runs out, the kernel ends this build first, not the caller
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass
    if hasattr(os, "sched_setscheduler"):  # Linux: CPU time only when nothing else wants it
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], *(int(fd) for fd in sys.argv[4:5])))
