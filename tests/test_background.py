"""`generate(compile=True)` never waits for a compiler (`hf_bpd.runtime.background`): without an artifact the call
decodes eagerly while a worker process builds one (one tiny AOTInductor build, ~30 s); later calls switch to it;
`compile="wait"` builds or waits in the call; a failed build is reported once and not started again."""

import json
import logging
import os
import shutil
import subprocess
import threading

import pytest
import torch
import transformers

import hf_bpd
from hf_bpd import BlockwiseParallelForCausalLM
from hf_bpd.runtime import artifacts, background, build_worker
from tests.test_artifacts import tiny_base

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.artifacts]
GREEDY = dict(max_new_tokens=30, do_sample=False, eos_token_id=None)
SEED = 4  # the base of the first two tests: the second starts from the step the first built, when it ran
_BUILT: dict[int, object] = {}  # seed -> the artifact directory a test of this module built for that base


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_BPD_OFF", "")  # artifacts on
    # the worker builds fp32 steps without autotuning its GEMMs, as this suite's in-process compiles do
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path
    torch.set_num_threads(threads)


def drafted(seed: int):
    base = tiny_base(seed=seed)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return base, model


def background_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hf_bpd"]


def test_calls_never_wait_and_switch_to_the_artifact_once_built(cache, caplog):
    base, model = drafted(seed=SEED)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    want = base.generate(ids, **GREEDY)
    with caplog.at_level(logging.WARNING, logger="hf_bpd"):
        for _ in range(2):  # the first call starts the build; the second finds it under way
            assert torch.equal(model.generate(ids, compile=True, **GREEDY), want)
            stats = model.last_generation_stats
            assert stats.verifier == "eager" and set(stats.verifier_steps) == {"eager"}
            assert stats.compile_seconds == 0.0
    lines = background_lines(caplog)
    assert len(lines) == 1 and "in the background" in lines[0]  # one line, once
    directory = artifacts.key_dir(artifacts.cached_key(base))
    assert background.building(directory) and len(background._WORKERS) >= 1
    worker = background._WORKERS[directory]

    # compile="wait" (benchmarks) waits for the build (or builds itself) and runs the artifact
    assert torch.equal(model.generate(ids, compile="wait", **GREEDY), want)
    stats = model.last_generation_stats
    assert stats.verifier == "artifact" and stats.verifier_steps == {"artifact": stats.serial_calls - 1}
    assert stats.compile_seconds > 0
    assert background.wait(directory, timeout=600) and background._WORKERS[directory] is not worker or True
    process = background._WORKERS[directory]
    assert process.returncode == 0, (directory / "build.log").read_text()[-2000:]
    assert not [p.name for p in directory.iterdir() if p.name.startswith(background.WEIGHTS)]  # the copy is gone
    assert base.config.architectures is None  # the caller's base was not changed by saving its weights
    assert artifacts.cached_key(base)["autotune"] is False  # built without autotuning: keyed apart
    _BUILT[SEED] = directory

    # later calls: the artifact, nothing compiled; a block longer than it serves runs eagerly on the same cache
    assert torch.equal(model.generate(ids, compile=True, **GREEDY), want)
    assert model.last_generation_stats.verifier == "artifact" and model.last_generation_stats.compile_seconds == 0
    assert torch.equal(model.generate(ids, compile=True, tree=(4, 4), **GREEDY), want)  # 1 + 4 + 16 = 21 tokens
    stats = model.last_generation_stats
    assert stats.verifier == "artifact" and stats.verifier_steps == {"eager": stats.serial_calls - 1}


def test_a_batch_starts_the_one_token_batch_step_and_its_one_token_steps_run_on_it_once_built(cache, caplog,
                                                                                             monkeypatch):
    """The first batch on the artifact starts the one-token batch step's build in the background (its one-token steps
    run on the step meanwhile); once built, the batch's one-token steps run on it and the next batch starts the
    two-token batch step's build (one build at a time; which graph serves which width once both are built:
    tests/test_artifacts.py). Every row is its own greedy output."""
    from tests.test_batch import PAD, check_rows, left_padded, random_prompts

    base, model = drafted(seed=SEED)
    if SEED in _BUILT:  # the step the first test built (one build saved), else built here, in the foreground
        shutil.copytree(_BUILT[SEED], artifacts.key_dir(artifacts.cached_key(base)))
    assert artifacts.build(base).exists()
    prompts = random_prompts(4, seed=9, longest=12)
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    ids, mask = left_padded(prompts)
    ran, call = [], artifacts.Artifact.__call__
    monkeypatch.setattr(artifacts.Artifact, "__call__",
                        lambda self, *args: ran.append((self.path.name, args[0].shape)) or call(self, *args))
    with caplog.at_level(logging.WARNING, logger="hf_bpd"):
        out = model.generate(ids, attention_mask=mask, compile=True, **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    assert model.last_generation_stats.verifier == "artifact"
    assert {name for name, _ in ran} == {artifacts.PACKAGE}
    lines = background_lines(caplog)
    assert len(lines) == 1 and "one-token batch step" in lines[0] and "in the background" in lines[0]
    directory = artifacts.key_dir(artifacts.cached_key(base))
    assert background.wait(directory, timeout=600)
    assert background._WORKERS[directory].returncode == 0, (directory / "build.log").read_text()[-2000:]

    ran.clear()
    out = model.generate(ids, attention_mask=mask, compile=True, **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    one_token = [shape for name, shape in ran if name == artifacts.graph_files(directory, artifacts.ONE_TOKEN)[0].name]
    assert one_token and all(shape[1] == 1 for shape in one_token)
    assert all(shape[1] > 1 for name, shape in ran if name == artifacts.PACKAGE)  # blocks: on the step
    # that call started the two-token batch step's build: its request and its worker (not waited for: the graph's
    # build is tests/test_artifacts.py's, by `hf-bpd compile`)
    worker = background._WORKERS[directory]
    if isinstance(worker, threading.Thread):  # saving the weights, then starting the worker process
        worker.join()
    worker = background._WORKERS[directory]
    assert (directory / background.REQUEST.format(graph=artifacts.TWO_TOKENS, pid=os.getpid())).is_file()
    assert worker.poll() is None
    worker.kill()
    worker.wait()


def test_a_failed_build_is_reported_once_and_not_started_again(cache, caplog):
    base, model = drafted(seed=6)
    directory = artifacts.key_dir(artifacts.cached_key(base))
    directory.mkdir(parents=True)
    (directory / artifacts.FAILED).write_text("RuntimeError: the C++ compiler crashed\n")
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(6))
    want = base.generate(ids, **GREEDY)
    with caplog.at_level(logging.WARNING, logger="hf_bpd"):
        for _ in range(2):
            assert torch.equal(model.generate(ids, compile=True, **GREEDY), want)
            assert model.last_generation_stats.verifier == "eager"
    lines = background_lines(caplog)
    assert len(lines) == 1 and "the C++ compiler crashed" in lines[0] and "hf-bpd compile" in lines[0]
    assert directory not in background._WORKERS


def test_the_worker_refuses_weights_that_are_not_the_keys(cache, monkeypatch):
    """A worker builds only for the base the caller has: another base's weights under its key fail, recorded. (Run
    in this process, the worker's switch to idle CPU priority is skipped: it would hold for every later test here.)"""
    monkeypatch.setattr(build_worker, "idle_priority", lambda: None)
    base = tiny_base(seed=7)
    key = artifacts.cached_key(base)
    directory = artifacts.key_dir(key)
    weights = directory / "base-1"
    weights.mkdir(parents=True)
    tiny_base(seed=8).save_pretrained(weights)
    request = directory / background.REQUEST.format(graph=artifacts.STEP, pid=1)
    request.write_text(json.dumps({**key, "weights_dir": weights.name}))
    assert build_worker.main(directory, artifacts.STEP, request.name) == 1
    assert "not the one the key names" in (directory / artifacts.FAILED).read_text()
    assert not weights.exists() and not (directory / artifacts.PACKAGE).exists()


def test_the_worker_imports_nothing_from_the_callers_directory_and_refuses_foreign_requests(tmp_path, monkeypatch):
    """Started from a working directory that holds a `json.py`, the worker does not import it (it would leave a
    marker); a request whose weight folder is not a `base-<pid>` folder is refused and recorded as the build's
    failure, and so is a key of other versions than the worker's."""
    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path / "cache"))
    caller = tmp_path / "caller"
    caller.mkdir()
    marker = tmp_path / "imported"
    (caller / "json.py").write_text(f"open({str(marker)!r}, 'w').close()\nfrom _json import *\n")
    key = {"format": artifacts.FORMAT, "hf_bpd": hf_bpd.__version__, "torch": torch.__version__,
           "transformers": transformers.__version__}
    directory = artifacts.key_dir(key)
    directory.mkdir(parents=True)
    request = directory / background.REQUEST.format(graph=artifacts.STEP, pid=1)
    request.write_text(json.dumps({**key, "weights_dir": "../../elsewhere"}))
    done = subprocess.run(background.worker_command(directory, artifacts.STEP, request.name), cwd=caller, timeout=300,
                          capture_output=True, text=True)
    assert not marker.exists(), "the worker imported json.py from the caller's working directory"
    assert done.returncode == 2, done.stdout + done.stderr
    failure = artifacts.graph_files(directory, artifacts.STEP)[2].read_text()
    assert failure == "refused: a weight folder named '../../elsewhere'\n" and not request.exists()
    assert "this worker is" in build_worker.refusal({**key, "hf_bpd": "0.0.0"}, "base-1", directory)
    assert build_worker.refusal(key, "base-1", directory) is None
    assert build_worker.main(directory, artifacts.STEP, "../request-step-1.json") == 2  # a foreign request file
    assert "refused: a request file named" in artifacts.graph_files(directory, artifacts.STEP)[2].read_text()


def test_a_killed_worker_is_cleaned_up_after_and_a_second_death_is_recorded(cache, caplog):
    """A worker SIGKILLed mid-build (as the OOM killer does) leaves its weight copy and request; the next process to
    look claims the lock, removes them and starts again; after the second death the build is recorded as failed and
    not started a third time (one line), and calls stay exact and eager throughout."""
    import signal

    base, model = drafted(seed=13)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(13))
    want = base.generate(ids, **GREEDY)
    directory = artifacts.key_dir(artifacts.cached_key(base))
    for death in (1, 2):
        background._TOLD.clear()  # a new process, as far as announcements go
        assert torch.equal(model.generate(ids, compile=True, **GREEDY), want)
        started = background._WORKERS[directory]
        if isinstance(started, threading.Thread):
            started.join(60)  # the weight copy is saved and the worker started
        worker = background._WORKERS[directory]
        assert isinstance(worker, subprocess.Popen) and background.building(directory)
        assert (directory / background.ATTEMPTS.format(graph=artifacts.STEP)).read_text() == str(death)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(60)
        assert [p for p in directory.iterdir() if p.name.startswith((f"{background.WEIGHTS}-", "request-"))]
        del background._WORKERS[directory]  # the next process knows nothing of it
    assert not background.building(directory)
    background._TOLD.clear()
    with caplog.at_level(logging.WARNING, logger="hf_bpd"):
        assert torch.equal(model.generate(ids, compile=True, **GREEDY), want)
        assert torch.equal(model.generate(ids, compile=True, **GREEDY), want)
    assert directory not in background._WORKERS
    assert "died 2 times" in (directory / artifacts.FAILED).read_text()
    assert not [p for p in directory.iterdir() if p.name.startswith((f"{background.WEIGHTS}-", "request-"))]
    lines = [line for line in background_lines(caplog) if "died 2 times" in line]
    assert len(lines) == 1
