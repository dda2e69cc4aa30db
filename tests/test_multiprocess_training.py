"""Data-parallel training: 2 CPU processes (gloo) give one process's loss curve; resume; self_distill's --device/--dtype.

Both processes and the single one see the same global batches (`--batch-size` is the global batch), and each process's
per-head mean is weighted by its share of the step's scored positions, so the averaged gradient is the global batch's:
the curves differ only by float32 summation order (measured: at most 2e-6 absolute on losses of about 8, over 24
steps). Weighting the two halves equally instead (plain DDP averaging of per-process means) is off by up to 1.5e-2
(2e-3 relative) on this data, whose examples differ in length; the tolerance, 1e-4 relative, sits between the two.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_bpd

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4  # relative, per step


@pytest.fixture(scope="module")
def varied_data(tmp_path_factory):
    """40 chats of 3 to 25 words: the two halves of a batch score different numbers of positions."""
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    with path.open("w") as f:
        for i in range(40):
            answer = " ".join(words[(i + j) % 5] for j in range(3 + (i * 7) % 23))
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Count {i}"},
                                                  {"from": "gpt", "value": answer}]}) + "\n")
    return path


def train(*args, launcher=()):
    """training/train_heads.py under `launcher` (none: plain python, one process), on CPU, one thread a process."""
    cmd = [*launcher, str(ROOT / "training" / "train_heads.py"), *map(str, args)]
    if not launcher:
        cmd.insert(0, sys.executable)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
CONFIG = [*ACCELERATE, "--config_file", str(ROOT / "configs" / "cpu.yaml")]
FLAGS = [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no", "--main_process_port", "0"]  # a free port


def log(out_dir):
    """Step -> entry of train_log.jsonl (the last entry wins when a resumed run repeats a step)."""
    lines = (Path(out_dir) / "train_log.jsonl").read_text().splitlines()
    return {entry["step"]: entry for entry in map(json.loads, lines)}


def test_two_processes_give_the_one_process_loss_curve_and_resume(tmp_path, tiny_chat_base, varied_data):
    # 36 training examples in batches of 5 (halves of 3 and 2): the last batch of an epoch has one example, so one
    # process runs it with nothing to score; 3 epochs = 24 steps; a checkpoint at steps 9 and 18
    common = ["--model", tiny_chat_base, "--data", varied_data, "--epochs", "3", "--batch-size", "5",
              "--num-heads", "2", "--draft-vocab-size", "64", "--lr", "3e-2", "--warmup-steps", "4",
              "--eval-fraction", "0.1", "--threads", "1", "--save-steps", "9"]
    train(*common, "--output-dir", tmp_path / "one")
    cache = tmp_path / "cache"
    result = train(*common, "--output-dir", tmp_path / "two", "--cache-dir", cache, launcher=CONFIG)
    one, two = log(tmp_path / "one"), log(tmp_path / "two")
    assert sorted(one) == sorted(two) == list(range(1, 25))
    for step in one:
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=TOLERANCE), step
        assert two[step]["head_losses"] == pytest.approx(one[step]["head_losses"], rel=TOLERANCE), step
        assert two[step]["lr"] == pytest.approx(one[step]["lr"], rel=1e-12), step  # the schedule steps once a step
    assert result.stdout.count("saved to") == 1  # one process reports and saves
    # each process cached its half of the training examples (own shards), the main one the held-out ones
    assert len(list(cache.glob("hidden-*.safetensors"))) == 3 and not list(cache.glob("*.partial"))

    training = json.loads((tmp_path / "two" / "training.json").read_text())
    assert training["processes"] == 2 and training["steps"] == 24
    alone = json.loads((tmp_path / "one" / "training.json").read_text())["eval_head_accuracy"]
    assert [row["positions"] for row in training["eval_head_accuracy"]] == [row["positions"] for row in alone]
    for row, reference_row in zip(training["eval_head_accuracy"], alone, strict=True):  # a near tie may flip
        assert row["top1"] == pytest.approx(reference_row["top1"], abs=0.02)
    heads = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(tmp_path / "two")
    reference = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(tmp_path / "one")
    for (name, a), (_, b) in zip(heads.heads.state_dict().items(), reference.heads.state_dict().items(), strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-5), name
    ids = torch.tensor([[5, 9, 13, 7]])
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(heads.generate(ids, **kwargs), heads.base_lm.generate(ids, **kwargs))

    # resume the finished two-process run from its last checkpoint (step 18), launched by flags this time: steps
    # 19-24 run again, from the cache, and repeat the uninterrupted run's losses
    result = train(*common, "--output-dir", tmp_path / "two", "--cache-dir", cache, "--resume", launcher=FLAGS)
    assert "resumed from step 18" in result.stdout and "caching base hidden states" not in result.stderr
    again = log(tmp_path / "two")
    assert sorted(again) == list(range(1, 25))
    for step in range(19, 25):
        assert again[step]["loss"] == pytest.approx(two[step]["loss"], rel=1e-6, abs=1e-7), step


def test_self_distill_on_a_device_in_bfloat16(tmp_path, tiny_chat_base, varied_data):
    from hf_bpd.training.self_distill import main as self_distill

    output = tmp_path / "distilled.jsonl"
    assert self_distill(["--model", str(tiny_chat_base), "--prompts", str(varied_data), "--output", str(output),
                         "--limit", "3", "--max-new-tokens", "4", "--batch-size", "2", "--threads", "1",
                         "--device", "cpu", "--dtype", "bfloat16"]) == 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 3 and all(r["conversations"][1]["from"] == "gpt" for r in rows)
    with pytest.raises(SystemExit):
        self_distill(["--model", str(tiny_chat_base), "--prompts", str(varied_data), "--output", str(output),
                      "--device", "nonsense"])


def test_self_distill_compiled_batches_give_the_eager_answers(tmp_path, tiny_chat_base, varied_data):
    """`--compile`: a plain base's batches decode on hf_bpd's compiled batch steps (fp32: the eager answers)."""
    from hf_bpd.training.self_distill import main as self_distill

    import warnings

    answers = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        output = tmp_path / f"{name}.jsonl"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert self_distill(["--model", str(tiny_chat_base), "--prompts", str(varied_data), "--output",
                                 str(output), "--limit", "2", "--max-new-tokens", "5", "--batch-size", "2",
                                 "--threads", "1", *extra]) == 0
        assert not [w for w in caught if "verifies eagerly" in str(w.message)]  # the compiled steps ran
        answers[name] = [json.loads(line)["conversations"][1]["value"] for line in output.read_text().splitlines()]
    assert len(answers["eager"]) == 2 and answers["compiled"] == answers["eager"]
