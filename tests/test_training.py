"""Training: data rendering/masking, `accelerate launch training/train_heads.py` smoke, kill-and-resume, LoRA mode."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

import hf_bpd
from hf_bpd.training.data import conversation_messages, tokenize_conversation
from hf_bpd.training.hidden_states import build_examples, cache_hidden_states, latest_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return hf_bpd.load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    words = ["alpha", "beta", "gamma", "delta"]
    with path.open("w") as f:
        for i in range(48):
            answer = " ".join(words[(i + j) % 4] for j in range(24))
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Count {i}"},
                                                  {"from": "gpt", "value": answer}]}) + "\n")
        f.write(json.dumps({"conversations": []}) + "\n")  # malformed: skipped and counted
        f.write(json.dumps({"instruction": "Say hi", "output": "hi there"}) + "\n")  # Alpaca record
    return path


def test_assistant_only_mask_on_a_hand_written_example(tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}]
    example = tokenize_conversation(tokenizer, messages)
    trained = [t for t, label in zip(example["input_ids"], example["labels"]) if label != -100]
    assert [t for t, label in zip(example["input_ids"], example["labels"]) if label != -100] == \
        [label for label in example["labels"] if label != -100]
    text = tokenizer.decode(trained)
    assert text.count("It is 4.") == 1 and text.count("It is 6.") == 1
    assert "What is 2+2?" not in text and "And 3+3?" not in text and "user" not in text
    assert text.count("<|im_end|>") == 2  # the assistant learns to end its turn


def test_a_tokenizer_without_chat_template_trains_on_the_plain_text_bench_prompts_with(tokenizer):
    """gemma-3-270m (a pretrained base) has no chat template: turns joined by blank lines, as `hf-bpd bench` prompts
    such a model, and the assistant's tokens (blank line first, EOS last) are the labels."""
    import copy

    from hf_bpd.evaluation.bench import encode_messages

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]
    example = tokenize_conversation(plain, messages)
    prompt = encode_messages(plain, messages[:1])["input_ids"][0].tolist()
    assert example["input_ids"][: len(prompt)] == prompt  # the prompt bench gives, then the answer
    trained = [t for t, label in zip(example["input_ids"], example["labels"]) if label != -100]
    assert plain.decode(trained) == "\n\nIt is 4." + plain.eos_token
    assert example["labels"][: len(prompt)] == [-100] * len(prompt)


def test_sharegpt_and_alpaca_records_render(tokenizer):
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
    alpaca = {"instruction": "Add", "input": "1 and 2", "output": "3"}
    gsm8k = {"question": "2+2?", "answer": "2+2=<<2+2=4>>4\n#### 4"}
    assert conversation_messages(sharegpt)[1] == {"role": "assistant", "content": "Hello!"}
    assert conversation_messages(alpaca)[0]["content"] == "Add\n\n1 and 2"
    assert conversation_messages(gsm8k)[1]["content"] == "2+2=4\nThe answer is 4"
    examples, skipped = build_examples(tokenizer, [sharegpt, alpaca, {"conversations": []}, {"foo": 1},
                                                   {"conversations": [{"from": "human", "value": "only"}]}])
    assert len(examples) == 2 and skipped == 3


def run_train(*args, accelerate=True, check=True, **popen):
    launcher = ([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no", "--cpu"] if accelerate else [sys.executable])
    cmd = launcher + [str(ROOT / "training" / "train_heads.py"), *map(str, args)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if popen:
        return subprocess.Popen(cmd, env=env, **popen)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def losses(out_dir):
    """Loss per step (the last entry wins when a resumed run repeats a step)."""
    entries = {}
    for line in (Path(out_dir) / "train_log.jsonl").read_text().splitlines():
        entry = json.loads(line)
        entries[entry["step"]] = entry["loss"]
    return entries


COMMON = ["--num-heads", "2", "--draft-vocab-size", "64", "--batch-size", "4", "--lr", "3e-2", "--threads", "1",
          "--eval-fraction", "0.1", "--log-steps", "5"]


def test_prompt_files_read_without_datasets(tmp_path):
    """`load_prompts` reads JSON arrays and (gzipped) JSON lines itself: a prompt holding a Unicode line separator
    stays one record, records missing a key read it as None (as `datasets` gives them), and a file that is not JSON
    records is a one-line error."""
    import gzip

    from hf_bpd.training.data import _records, load_prompts

    rows = [{"instruction": "Split\u2028here\x85and here?", "id": "a-1"}, {"question": "What is 2+2?"}]
    with gzip.open(tmp_path / "p.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    (tmp_path / "p.json").write_text(json.dumps(rows))
    for name in ("p.jsonl.gz", "p.json"):
        records = _records(tmp_path / name)
        assert len(records) == 2 and records[1]["instruction"] is None and records[0]["question"] is None
        prompts = load_prompts(tmp_path / name)
        assert [p["prompt"] for p in prompts] == ["Split\u2028here\x85and here?", "What is 2+2?"]
        assert prompts[0]["id"] == "a-1"
    (tmp_path / "bad.jsonl").write_text('{"instruction": "x"\n')
    with pytest.raises(ValueError, match="not a JSON array or JSON lines file"):
        load_prompts(tmp_path / "bad.jsonl")


def test_accelerate_launch_smoke_loss_goes_down(tmp_path, tiny_chat_base, tiny_data):
    out = tmp_path / "heads"
    result = run_train("--model", tiny_chat_base, "--data", tiny_data, "--epochs", "3",
                       "--save-steps", "10", "--output-dir", out, *COMMON)
    assert "1 records skipped" in result.stdout + result.stderr
    log = losses(out)
    assert len(log) == 36  # 3 epochs x ceil(44 training examples / batch 4): every epoch runs
    assert sum(list(log.values())[-5:]) / 5 < 0.85 * sum(list(log.values())[:5]) / 5
    model = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(out)
    assert model.config.num_heads == 2 and model.config.draft_vocab_size == 64
    card = (out / "README.md").read_text()
    assert "## Training" in card and "top-1" in card
    training = json.loads((out / "training.json").read_text())
    assert training["steps"] == 36 and len(training["eval_head_accuracy"]) == 2


def test_hidden_state_cache_on_disk_is_reused_and_keyed(tmp_path, tiny_chat_base, tokenizer):
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_base).eval()
    model = hf_bpd.BlockwiseParallelForCausalLM.from_base(base, num_heads=2)
    records = [{"conversations": [{"from": "human", "value": f"Count {i}"},
                                  {"from": "gpt", "value": "alpha beta " * (i + 1)}]} for i in range(7)]
    examples, _ = build_examples(tokenizer, records)
    rows = []  # examples the base ran on
    hook = model.base_lm.register_forward_hook(lambda m, args, kwargs, out: rows.append(len(kwargs["input_ids"])),
                                               with_kwargs=True)
    reference = cache_hidden_states(model, examples)  # no cache dir: computed, nothing written
    assert sum(rows) == 7 and not list(tmp_path.iterdir())
    rows.clear()
    first = cache_hidden_states(model, examples[:5], targets="base", cache_dir=tmp_path, shard_examples=2)
    assert sum(rows) == 5 and len(list(tmp_path.iterdir())) == 3  # shards of 2, 2 and 1 examples
    assert all(f.suffix == ".safetensors" for f in tmp_path.iterdir())
    rows.clear()
    again = cache_hidden_states(model, examples[:5], targets="base", cache_dir=tmp_path)
    assert sum(rows) == 0, "the second call must come from disk, not from the base"
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a["hidden"], b["hidden"]) and torch.equal(a["labels"], b["labels"])
    # more data, another order, a subset: only the examples never seen run through the base
    mixed = [examples[6], examples[1], examples[5], examples[3]]
    out = cache_hidden_states(model, mixed, targets="base", cache_dir=tmp_path)
    assert sum(rows) == 2
    assert torch.equal(out[1]["hidden"], first[1]["hidden"]) and torch.equal(out[3]["labels"], first[3]["labels"])
    assert torch.allclose(out[0]["hidden"].float(), reference[6]["hidden"].float(), atol=2e-2)  # other batch
    rows.clear()
    cache_hidden_states(model, examples[:5], targets="data", cache_dir=tmp_path)  # other targets: computed again
    assert sum(rows) == 5
    rows.clear()
    with torch.no_grad():
        model.base_lm.model.layers[0].mlp.down_proj.weight.mul_(2)  # other weights: computed again
    cache_hidden_states(model, examples[:5], targets="base", cache_dir=tmp_path)
    assert sum(rows) == 5
    hook.remove()


def test_train_heads_from_the_disk_cache_gives_the_same_run(tmp_path, tiny_chat_base, tiny_data):
    args = ["--model", tiny_chat_base, "--data", tiny_data, "--max-steps", "12", "--cache-dir", tmp_path / "cache",
            *COMMON]
    run_train(*args, "--output-dir", tmp_path / "a", accelerate=False)
    assert len(list((tmp_path / "cache").glob("hidden-*.safetensors"))) == 2  # a shard per split
    result = run_train(*args, "--output-dir", tmp_path / "b", accelerate=False)
    assert "caching base hidden states" not in result.stderr
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_kill_and_resume_loses_no_step(tmp_path, tiny_chat_base, tiny_data):
    # a checkpoint every step, so the kills land inside saves as well as between them
    args = ["--model", tiny_chat_base, "--data", tiny_data, "--max-steps", "60", "--epochs", "6",
            "--save-steps", "1", *COMMON]
    run_train(*args, "--output-dir", tmp_path / "straight", accelerate=False)
    reference = losses(tmp_path / "straight")

    out = tmp_path / "killed"
    saved = 0
    for kill_after in (8, 25):  # killed twice; the second run is itself a resumed one
        proc = run_train(*args, "--output-dir", out, *(["--resume"] if saved else []), accelerate=False,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline and (latest_checkpoint(out / "state") or (None, 0))[1] < kill_after:
            time.sleep(0.01)
            if proc.poll() is not None:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        saved = latest_checkpoint(out / "state")[1]
        assert kill_after <= saved < 60, "the run was not interrupted mid-way"
    result = run_train(*args, "--output-dir", out, "--resume", accelerate=False)
    assert f"resumed from step {saved}" in result.stdout
    resumed = losses(out)
    assert sorted(resumed) == list(range(1, 61))
    for step in range(saved + 1, 61):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step


def test_checkpoint_torn_by_a_kill_is_never_resumed(tmp_path):
    """A save cut short leaves `state.partial` half written; resuming uses the last complete save."""
    accelerator = Accelerator(cpu=True)
    layer = torch.nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer, optimizer = accelerator.prepare(layer, optimizer)
    layer(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    state = tmp_path / "state"
    save_checkpoint(accelerator, state, step=4)
    weights = {k: v.clone() for k, v in layer.state_dict().items()}
    assert latest_checkpoint(state) == (state, 4) and not (tmp_path / "state.partial").exists()

    # killed while writing the step-8 save: files present but truncated, no trainer_state.json yet
    torn = tmp_path / "state.partial"
    shutil.copytree(state, torn)
    (torn / "trainer_state.json").unlink()
    for name in ("optimizer.bin", "scheduler.bin", "model.safetensors"):
        if (torn / name).exists():
            (torn / name).write_bytes((torn / name).read_bytes()[:10])
    with torch.no_grad():
        layer.weight.add_(1.0)
    assert latest_checkpoint(state) == (state, 4)
    accelerator.load_state(str(latest_checkpoint(state)[0]))
    assert all(torch.equal(v, weights[k]) for k, v in layer.state_dict().items())

    # killed between the two renames: the old save is parked, the new one is complete
    save_checkpoint(accelerator, state, step=8)
    state.rename(tmp_path / "state.old")
    shutil.copytree(tmp_path / "state.old", torn)
    (torn / "trainer_state.json").write_text(json.dumps({"step": 12}))
    assert latest_checkpoint(state) == (torn, 12)
    save_checkpoint(accelerator, state, step=16)  # the next save cleans up both
    assert latest_checkpoint(state) == (state, 16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_lora_base_mode_changes_only_lora_and_heads(tmp_path, tiny_chat_base, tiny_data, tokenizer):
    out = tmp_path / "lora"
    run_train("--model", tiny_chat_base, "--data", tiny_data, "--max-steps", "6", "--lora-base", "q_proj,v_proj",
              "--lr", "1e-4", "--output-dir", out, "--num-heads", "2", "--batch-size", "4", "--threads", "1",
              "--base-loss-weight", "1.0", "--kl-weight", "1.0", accelerate=False)
    assert (out / "base_adapter" / "adapter_model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_base).eval()
    loaded = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(out)
    assert loaded.config.base_adapter == "base_adapter"
    original, adapted = base.state_dict(), loaded.base_lm.state_dict()
    changed = {k for k in original if not torch.equal(original[k], adapted[k])}
    assert changed and all(("q_proj" in k or "v_proj" in k) for k in changed)
    # a short run at a small learning rate with the base loss and KL kept: the greedy output does not drift
    prompts = ["Count 3", "Count 7", "Say hi"]
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        expected = base.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(loaded.base_lm.generate(ids, max_new_tokens=8, do_sample=False), expected)


def test_self_distill_is_batched_resumable_and_deterministic(tmp_path, tiny_chat_base, tiny_data):
    """Interrupting after 3 prompts and running again generates only the rest; the file equals one full run, and
    prompts of an --exclude file are never distilled."""
    from hf_bpd.training.self_distill import main as self_distill

    held_out = tmp_path / "dev.jsonl"
    held_out.write_text(json.dumps({"question_id": "d", "category": "x", "turns": ["Count 4"]}) + "\n")
    common = ["--model", str(tiny_chat_base), "--prompts", str(tiny_data), "--exclude", str(held_out),
              "--max-new-tokens", "6", "--batch-size", "2", "--threads", "1"]
    resumed, fresh = tmp_path / "resumed.jsonl", tmp_path / "fresh.jsonl"
    assert self_distill(common + ["--output", str(resumed), "--limit", "3"]) == 0
    first = resumed.read_text().splitlines()
    assert len(first) == 3
    assert self_distill(common + ["--output", str(resumed), "--limit", "7"]) == 0
    assert self_distill(common + ["--output", str(fresh), "--limit", "7"]) == 0
    lines = resumed.read_text().splitlines()
    assert lines[:3] == first and len(lines) == 7
    assert sorted(lines) == sorted(fresh.read_text().splitlines())  # batch composition does not change answers
    rows = [json.loads(line) for line in lines]
    assert len({r["id"] for r in rows}) == 7
    assert all(r["conversations"][0]["from"] == "human" and r["conversations"][1]["from"] == "gpt" for r in rows)
    assert "Count 4" not in {r["conversations"][0]["value"] for r in rows}

    # With a heads checkpoint the batches decode with batched drafting: the same answers.
    heads = tmp_path / "heads"
    hf_bpd.BlockwiseParallelForCausalLM.from_base(str(tiny_chat_base), num_heads=2).save_pretrained(heads)
    drafted = tmp_path / "drafted.jsonl"
    assert self_distill(common[:1] + [str(heads)] + common[2:] + ["--output", str(drafted), "--limit", "7"]) == 0
    assert sorted(drafted.read_text().splitlines()) == sorted(lines)


def test_tune_rescorers_smoke_bundles_the_better_ngram_and_sets_the_default(tmp_path, tiny_chat_base, tokenizer):
    from hf_bpd.rescorers import kenlm as bpd_kenlm

    base = AutoModelForCausalLM.from_pretrained(tiny_chat_base).eval()
    answers = []
    for i in range(3):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": f"Count to {i}"}],
                                            add_generation_prompt=True, return_tensors="pt", return_dict=True)
        answers.append(base.generate(**ids, max_new_tokens=24, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist())
    # heads with no opinion (own projections at zero: uniform over a small draft vocabulary holding every answer
    # token, all of it in the lattice), so only the n-gram can make the drafts right
    vocab = sorted(set(sum(answers, [])))
    vocab = sorted(vocab + [t for t in range(1000, 2000) if t not in vocab][: max(0, 16 - len(vocab))])
    model = hf_bpd.BlockwiseParallelForCausalLM.from_base(base, num_heads=3, draft_vocab=vocab,
                                                          tie_head_projection=False)
    with torch.no_grad():
        for head in model.heads.heads:
            head.projection.weight.zero_()
    model.config.base_model_name_or_path = str(tiny_chat_base)
    checkpoint = tmp_path / "ckpt"
    model.save_pretrained(checkpoint)
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": str(i), "category": "x", "turns": [f"Count to {i}"]})
                                 + "\n" for i in range(3)))
    # an n-gram over the base's own greedy answers (it knows what the base says) and one over unrelated ids
    (tmp_path / "answers.txt").write_text("".join((" ".join(map(str, a)) + "\n") * 5 for a in answers))
    (tmp_path / "noise.txt").write_text("".join(" ".join(str(vocab[(i * 13 + j * 7) % len(vocab)]) for j in range(12)) + "\n"
                                                for i in range(60)))
    lms = [bpd_kenlm.build_ngram_from_ids(tmp_path / f"{name}.txt", tmp_path / f"{name}.bin", 3, memory="50M",
                                      discount_fallback=True) for name in ("noise", "answers")]
    result = subprocess.run([sys.executable, str(ROOT / "training" / "tune_rescorers.py"), "--checkpoint",
                             str(checkpoint), "--questions", str(questions), "--max-new-tokens", "16", "--threads",
                             "1", "--top-k", str(len(vocab)), "--ngram", *map(str, lms), "--bundle"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((checkpoint / "tuning.json").read_text())
    assert report["prompts"] == 3
    assert report["answers.bin"]["best"] > report["answers.bin"]["vanilla"], report
    assert report["answers.bin"]["best"] > report["noise.bin"]["best"], report
    assert report["chosen"] == "answers.bin" and report["default_rescorer"] == "ngram"
    loaded = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(checkpoint)
    spec = loaded.config.rescorers["ngram"]
    assert (checkpoint / spec["path"]).is_file() and spec["alpha"] == report["answers.bin"]["alpha"]
    assert spec["order"] == 3 and loaded.generation_config.rescorer == "ngram"
    prompt = tokenizer("Count to 5", return_tensors="pt")
    reference = base.generate(**prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(loaded.generate(**prompt, max_new_tokens=20), reference)  # the default: rescorer="ngram"


def test_train_hydra_heads_with_soft_targets(tmp_path, tiny_chat_base, tiny_data):
    """`--head-type hydra --soft-target-weight`: the loss goes down, the run is recorded, the heads load and draft."""
    out = tmp_path / "hydra"
    run_train("--model", tiny_chat_base, "--data", tiny_data, "--epochs", "3", "--head-type", "hydra",
              "--head-intermediate-size", "48", "--soft-target-weight", "0.5", "--soft-target-temperature", "2",
              "--output-dir", out, *COMMON)
    log = list(losses(out).values())
    assert sum(log[-5:]) / 5 < 0.85 * sum(log[:5]) / 5
    training = json.loads((out / "training.json").read_text())
    assert training["head_type"] == "hydra" and training["soft_target_weight"] == 0.5
    model = hf_bpd.BlockwiseParallelForCausalLM.from_pretrained(out)
    assert model.config.head_type == "hydra"
    ids = torch.tensor([[5, 9, 13, 7]])
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(ids, **kwargs), model.base_lm.generate(ids, **kwargs))
    # benchmarks/draft_quality.py (smoke): references computed once and reused, every head count analysed; two
    # prompt files, each without its first prompt (--skip 1)
    questions = [tmp_path / "q1.jsonl", tmp_path / "q2.jsonl"]
    for path, rows in zip(questions, ([(2, "a"), (3, "a")], [(5, "b"), (4, "b")])):
        path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"Count {i}"]}) + "\n"
                                for i, c in rows))
    refs, report = tmp_path / "refs.jsonl", tmp_path / "dq.json"
    for _ in range(2):
        result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "draft_quality.py"), "--checkpoints",
                                 str(out), "--questions", *map(str, questions), "--skip", "1", "--max-new-tokens",
                                 "10", "--references", str(refs), "--rescorer-from", "", "--num-heads", "1,2",
                                 "--threads", "1", "--output", str(report)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(json.loads(line)["id"] for line in refs.read_text().splitlines()) == ["3", "4"]  # reused once made
    rows = json.loads(report.read_text())["results"]
    assert [r["num_heads"] for r in rows] == [1, 2] and rows[0]["head_type"] == "hydra"
    assert all(1.0 <= r["summary"]["all"]["vanilla"]["block_efficiency"] <= 1 + r["num_heads"] for r in rows)
    bad = run_train("--model", tiny_chat_base, "--data", tiny_data, "--soft-target-weight", "1.5",
                    "--output-dir", tmp_path / "bad", accelerate=False, check=False)
    assert bad.returncode != 0 and "--soft-target-weight" in bad.stderr
