"""`hf_bpd.bench`: prompt files, and every method on a tiny checkpoint with the real SmolLM2 tokenizer."""

import copy
import importlib.util
import json

import pytest
import torch

import hf_bpd
from hf_bpd import BlockwiseParallelForCausalLM
from hf_bpd.evaluation.bench import (encode_messages, load_questions, machine_info, markdown_report, plot_report,
                                     run_bench)
from hf_bpd.evaluation.decoders import BenchOptions, decode_ar, default_decoders, parse_methods
from hf_bpd.errors import BPDConfigError, MethodSkipped
from tests.conftest import tiny_smollm2_vocab_base

METHODS = list(default_decoders())

SUMMARY_KEYS = {"method", "category", "samples", "new_tokens", "seconds", "tokens_per_s", "speedup_vs_ar",
                "vs_best_plain", "vs_llama_cpp", "block_efficiency", "serial_calls", "mean_accepted", "draft_share", "exact",
                "exact_rate"}
SAMPLE_KEYS = {"id", "category", "turn", "method", "prompt_tokens", "new_tokens", "seconds", "tokens_per_s",
               "speedup_vs_ar", "serial_calls", "block_efficiency", "mean_accepted", "accepted_lengths",
               "draft_seconds", "draft_tokens", "tie_checks", "tie_changes", "tie_seconds", "output_ids", "exact"}
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a short poem about the sea.", "Now make it rhyme."]},
    {"question_id": 82, "category": "math", "turns": ["What is 12 times 7?"]},
    {"question_id": 83, "category": "math", "turns": ["List the first five prime numbers."]},
]


def make_tiny_checkpoint(root):
    """A 2-layer Llama with SmolLM2's vocabulary and tokenizer (base dir), wrapped with 3 random heads (heads dir)."""
    tokenizer = hf_bpd.load_tokenizer("smollm2-135m-instruct")
    base_dir, heads_dir = root / "base", root / "heads"
    tiny_smollm2_vocab_base(tokenizer).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    model = BlockwiseParallelForCausalLM.from_base(str(base_dir), num_heads=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    model.save_pretrained(heads_dir)
    return base_dir, heads_dir


def write_questions(path, rows=QUESTIONS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def loaded(checkpoint):
    model = BlockwiseParallelForCausalLM.from_pretrained(checkpoint[1])
    return model, hf_bpd.load_tokenizer(str(checkpoint[1]))


# ------------------------------------------------------------------ prompt files
def test_load_questions_layouts(tmp_path):
    mt = load_questions(write_questions(tmp_path / "mt.jsonl"))
    assert [q["id"] for q in mt] == ["81", "82", "83"]
    assert mt[0]["category"] == "writing" and mt[0]["turns"] == QUESTIONS[0]["turns"]

    alpaca = [{"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
              {"instruction": "Name a color.", "input": ""},
              {"instruction": "Name a color.", "input": ""}]  # duplicate: kept once
    (tmp_path / "alpaca.json").write_text(json.dumps(alpaca))
    got = load_questions(tmp_path / "alpaca.json")
    assert [q["turns"] for q in got] == [["Translate to French.\n\nGood morning"], ["Name a color."]]
    assert got[0]["category"] == "alpaca" and got[0]["id"].startswith("alpaca-")
    write_questions(tmp_path / "alpaca.jsonl", alpaca[:2])
    assert [q["turns"] for q in load_questions(tmp_path / "alpaca.jsonl")] == [q["turns"] for q in got]

    (tmp_path / "plain.txt").write_text("first prompt\n\n  second prompt  \n")
    assert [q["turns"] for q in load_questions(tmp_path / "plain.txt")] == [["first prompt"], ["second prompt"]]


def test_load_questions_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no questions file"):
        load_questions(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"turns": ["ok"]}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        load_questions(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text('{"answer": 1}\n')
    with pytest.raises(ValueError, match="no prompts in"):
        load_questions(tmp_path / "empty.jsonl")


def test_parse_methods():
    assert parse_methods("bpd,pld", METHODS) == ["ar", "bpd", "pld"]  # the reference always runs, first
    assert parse_methods(None, METHODS) == list(METHODS)
    with pytest.raises(BPDConfigError, match="unknown method.*nope"):
        parse_methods("bpd,nope", METHODS)


def test_encode_messages_chat_and_plain(loaded):
    _, tokenizer = loaded
    messages = [{"role": "user", "content": "Hi"}]
    chat = encode_messages(tokenizer, messages)  # the tokenizer has a chat template: used by default
    plain = encode_messages(tokenizer, messages, chat=False)
    assert chat["input_ids"].shape[1] > plain["input_ids"].shape[1]
    assert tokenizer.decode(chat["input_ids"][0]).rstrip().endswith("assistant")


# ------------------------------------------------------------------ running methods
def test_bench_every_method_is_exact(loaded, tmp_path):
    model, tokenizer = loaded
    questions = load_questions(write_questions(tmp_path / "q.jsonl"))
    methods = ["ar", "pld", "early-exit", "bpd", "bpd+ngram", "bpd+neural", "pbest", "tree", "tree+ngram"]
    report = run_bench(model, tokenizer, questions, methods, max_new_tokens=12, progress=False)

    assert set(report) == {"methods", "skipped", "exact_reference", "summary", "by_category", "samples"}
    assert report["exact_reference"] == "ar"  # fp32
    assert report["methods"] == ["ar", "pld", "early-exit", "bpd", "pbest", "tree"]
    # rescorers that the checkpoint does not bundle are skipped with the reason, not a crash
    assert set(report["skipped"]) == {"bpd+ngram", "bpd+neural", "tree+ngram"}
    assert all("bundles no" in reason for reason in report["skipped"].values())

    assert [r["method"] for r in report["summary"]] == report["methods"]
    for row in report["summary"] + report["by_category"]:
        assert set(row) == SUMMARY_KEYS
        assert row["exact"] is True and row["exact_rate"] == 1.0
        assert row["block_efficiency"] >= 1.0 and row["tokens_per_s"] > 0 and row["speedup_vs_ar"] > 0
    assert {r["category"] for r in report["by_category"]} == {"writing", "math"}
    ar = report["summary"][0]
    assert ar["block_efficiency"] == 1.0 and ar["speedup_vs_ar"] == 1.0 and ar["serial_calls"] == ar["new_tokens"]

    assert len(report["samples"]) == 3 * 6  # turn 1 of each question, every method
    for sample in report["samples"]:
        assert set(sample) == SAMPLE_KEYS and sample["turn"] == 1
        # every serial call decodes its accepted draft tokens plus one token of its own
        assert sample["new_tokens"] == sample["serial_calls"] + sum(sample["accepted_lengths"])
    # methods ran in a different order for each prompt
    orders = [[s["method"] for s in report["samples"] if s["id"] == q["id"]] for q in questions]
    assert len({tuple(o) for o in orders}) == 3

    text = markdown_report(report)
    assert text.splitlines()[0].startswith("| method | tok/s | speed-up vs ar | vs best plain | block efficiency")
    assert "**NO**" not in text and "`bpd+ngram`: this checkpoint bundles no ngram rescorer" in text
    assert "Machine:" not in text  # run_bench alone reports no machine; the CLI's report names the CPU

    line = markdown_report({**report, "machine": machine_info()}).splitlines()[-1]
    features = machine_info()["cpu_features"]
    capability = torch.backends.cpu.get_cpu_capability() + (f"; {', '.join(features)}" if features else "")
    assert line.startswith("Machine: ") and f"({capability})" in line
    flags = open("/proc/cpuinfo").read().split()
    assert features == [name for name in ("avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if name in flags]
    written = plot_report(report, tmp_path / "plots")
    assert all((tmp_path / "plots" / name).exists() for name in ("speedup.png", "block_efficiency.png"))
    assert len(written) == 2


def test_a_broken_decoder_is_not_exact(loaded, tmp_path):
    model, tokenizer = loaded
    questions = load_questions(write_questions(tmp_path / "q.jsonl"))

    def broken(model, inputs, max_new_tokens):
        out, stats = decode_ar(model, inputs, max_new_tokens)
        out = out.clone()
        out[0, -1] = (out[0, -1] + 1) % model.config.vocab_size  # one wrong token at the end
        return out, stats

    def fails(model, inputs, max_new_tokens):
        raise RuntimeError("boom\nsecond line")

    decoders = {**default_decoders(), "broken": broken, "fails": fails}
    report = run_bench(model, tokenizer, questions, ["bpd", "broken", "fails"], decoders, max_new_tokens=8,
                       progress=False)
    rows = {r["method"]: r for r in report["summary"]}
    assert rows["broken"]["exact"] is False and rows["broken"]["exact_rate"] == 0.0
    assert rows["bpd"]["exact"] is True and rows["ar"]["exact"] is True
    assert report["skipped"] == {"fails": "failed: RuntimeError: boom"}
    assert "**NO**" in markdown_report(report)


def test_half_precision_is_checked_against_the_same_dtypes_compiled_plain_decoding(loaded, tmp_path):
    """bf16: `exact` compares each output with ar-compiled's (eager half precision rounds otherwise at near-ties, so the
    promise is the compiled plain path's tokens); fp32: with eager ar's. Decoders that end their output differently
    tell which one was the reference."""
    model, tokenizer = loaded
    questions = load_questions(write_questions(tmp_path / "q.jsonl"))[:2]

    def ending(token):
        def decoder(model, inputs, max_new_tokens):
            ids = inputs["input_ids"]
            return torch.cat([ids, torch.full((1, max_new_tokens), token, dtype=ids.dtype)], dim=1), None
        return decoder

    decoders = {"ar": ending(1), "ar-compiled": ending(2), "default": ending(2), "other": ending(3)}
    half = copy.deepcopy(model).to(torch.bfloat16)
    for base, reference, exact in (
            (half, "ar-compiled", {"ar": False, "ar-compiled": True, "default": True, "other": False}),
            (model, "ar", {"ar": True, "ar-compiled": False, "default": False, "other": False})):
        report = run_bench(base, tokenizer, questions, ["ar-compiled", "default", "other"], decoders, max_new_tokens=4,
                           progress=False)
        assert report["exact_reference"] == reference
        assert {r["method"]: r["exact"] for r in report["summary"]} == exact
        text = markdown_report(report)
        assert ("no (eager)" in text and "equals ar-compiled's" in text) == (reference == "ar-compiled")
    report = run_bench(half, tokenizer, questions, ["default"], decoders, max_new_tokens=4, progress=False)
    assert report["exact_reference"] == "ar"  # without compiled plain decoding, eager ar's is all there is
    calls = []

    def fails_later(model, inputs, max_new_tokens):  # the warm-up and the first prompt pass, then it fails
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("gone")
        return ending(2)(model, inputs, max_new_tokens)

    report = run_bench(half, tokenizer, questions, ["ar-compiled", "default", "other"],
                       {**decoders, "ar-compiled": fails_later}, max_new_tokens=4, progress=False)
    assert report["exact_reference"] == "ar" and "ar-compiled" in report["skipped"]  # every sample checked against ar
    for rows in (report["summary"], report["by_category"]):
        assert {r["method"]: r["exact"] for r in rows if r["method"] != "other"} == {"ar": True, "default": False}


def test_multi_turn_continues_the_reference_conversation(loaded, tmp_path):
    model, tokenizer = loaded
    questions = load_questions(write_questions(tmp_path / "q.jsonl", QUESTIONS[:2]))
    report = run_bench(model, tokenizer, questions, ["bpd"], max_new_tokens=6, multi_turn=True, warmup=0,
                       progress=False)
    turns = [(s["id"], s["turn"], s["method"]) for s in report["samples"]]
    assert sorted(turns) == sorted([("81", 1, "ar"), ("81", 1, "bpd"), ("81", 2, "ar"), ("81", 2, "bpd"),
                                    ("82", 1, "ar"), ("82", 1, "bpd")])
    first, second = (next(s for s in report["samples"] if s["id"] == "81" and s["turn"] == t and s["method"] == "ar")
                     for t in (1, 2))
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["new_tokens"]  # history is in the prompt
    assert all(s["exact"] for s in report["samples"])


def test_plain_base_skips_head_methods(checkpoint, loaded, tmp_path):
    base, tokenizer = hf_bpd.load_base(str(checkpoint[0]))
    questions = load_questions(write_questions(tmp_path / "q.jsonl", QUESTIONS[1:2]))
    report = run_bench(base, tokenizer, questions, ["pld", "bpd", "tree", "ar-compiled"], max_new_tokens=6,
                       warmup=0, progress=False)
    assert report["methods"] == ["ar", "pld", "ar-compiled"]  # compiled plain decoding needs no heads
    assert set(report["skipped"]) == {"bpd", "tree"}
    assert "no drafting heads" in report["skipped"]["bpd"]
    compiled = [s for s in report["summary"] if s["method"] == "ar-compiled" and s["category"] == "all"]
    assert compiled and compiled[0]["exact"] and compiled[0]["block_efficiency"] == 1.0


def test_bench_needs_the_reference():
    with pytest.raises(BPDConfigError, match="needs 'ar'"):
        run_bench(None, None, [{"id": "1", "category": "c", "turns": ["x"]}], ["bpd"],
                  {"bpd": default_decoders()["bpd"]})


class NoRepeatRescorer(hf_bpd.Rescorer):
    """Stands in for a bundled rescorer: the best head-score paths whose tokens never repeat consecutively."""

    def rescore(self, lattice, context, num_drafts):
        paths = [d for d in lattice.best_paths(64)
                 if all(a != b for a, b in zip((context[-1],) + d.tokens, d.tokens))]
        return (paths or lattice.best_paths(1))[:num_drafts]


def test_rescored_methods_run_when_a_rescorer_is_bundled(loaded, tmp_path):
    model, tokenizer = loaded
    questions = load_questions(write_questions(tmp_path / "q.jsonl"))
    model.bundled_rescorers["ngram"] = NoRepeatRescorer()
    try:
        report = run_bench(model, tokenizer, questions, ["bpd+ngram", "pbest-ngram", "tree+ngram", "bpd+neural"],
                           default_decoders(BenchOptions(tree_widths=(2, 2), num_drafts=3, draft_top_k=4)),
                           max_new_tokens=10, progress=False)
    finally:
        del model.bundled_rescorers["ngram"]
    assert report["methods"] == ["ar", "bpd+ngram", "pbest-ngram", "tree+ngram"]
    assert list(report["skipped"]) == ["bpd+neural"]
    assert all(row["exact"] for row in report["summary"])
    widest = {m: max(max(s["draft_tokens"]) for s in report["samples"] if s["method"] == m) for m in report["methods"]}
    # chain drafts have at most 3 tokens (3 heads); 3 or 4 rescored drafts verified as a tree have more nodes
    assert widest["ar"] == 0 and widest["bpd+ngram"] <= 3 < widest["pbest-ngram"] <= widest["tree+ngram"] <= 12


@pytest.mark.parametrize("method", ["pld", "early-exit", "assisted"])
def test_assisted_serial_calls_are_full_depth_base_forwards(checkpoint, loaded, method):
    """pld / early-exit / assisted statistics (recorded with module hooks) agree with an independent forward hook on
    the base (the assistant's own forwards are not the base's)."""
    model, tokenizer = loaded
    base = model.base_lm
    full = base.config.num_hidden_layers
    depths = []
    decoders = default_decoders(BenchOptions(assistant=str(checkpoint[0])))  # the base itself as its assistant
    hook = base.register_forward_pre_hook(lambda module, args: depths.append(base.model.config.num_hidden_layers))
    try:
        inputs = encode_messages(tokenizer, [{"role": "user", "content": "Count: one two three one two three"}])
        out, stats = decoders[method](model, inputs, 16)
    finally:
        hook.remove()
    assert stats.serial_calls == depths.count(full) and stats.serial_calls >= 1
    assert stats.new_tokens == out.shape[1] - inputs["input_ids"].shape[1] == 16
    assert stats.new_tokens == stats.serial_calls + sum(stats.accepted_lengths)
    assert (full - 1 in depths) == (method == "early-exit")  # early exit drafts with the first layer
    assert all(a >= 0 for a in stats.accepted_lengths)
    # the recorder's hooks are removed afterwards (only the test's own was still there)
    assert not base._forward_pre_hooks and not base.model.layers[-1]._forward_hooks


def save_tiny_assistant(path, tokenizer, seed, extra_vocab=0):
    """A 1-layer random Llama with SmolLM2's tokenizer (its config's vocabulary padded by `extra_vocab` rows)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer) + extra_vocab, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_assisted_with_a_tiny_assistant_reproduces_ar(checkpoint, loaded, tmp_path):
    """transformers' assisted generation with a separate draft model, passed by path: token-identical to ar through
    the bench's own check, for an assistant that drafts the base's tokens (the base itself), a random one and one whose
    config pads the vocabulary; the assistant is loaded once per registry."""
    model, tokenizer = loaded
    questions = load_questions(write_questions(tmp_path / "q.jsonl", QUESTIONS[:2]))
    for name, agrees in ((str(checkpoint[0]), True), (save_tiny_assistant(tmp_path / "a1", tokenizer, 1), False),
                         (save_tiny_assistant(tmp_path / "a2", tokenizer, 2, extra_vocab=64), False)):
        decoders = default_decoders(BenchOptions(assistant=name))
        report = run_bench(model, tokenizer, questions, ["assisted"], decoders, max_new_tokens=12, warmup=0,
                           progress=False)
        assert report["methods"] == ["ar", "assisted"] and report["skipped"] == {}, report["skipped"]
        assert all(s["exact"] for s in report["samples"]) and all(r["exact"] for r in report["summary"])
        mine = [s for s in report["samples"] if s["method"] == "assisted"]
        assert len(mine) == 2
        for sample in mine:
            assert 1 <= sample["serial_calls"] <= sample["new_tokens"]
            assert sample["new_tokens"] == sample["serial_calls"] + sum(sample["accepted_lengths"])
        row = next(r for r in report["summary"] if r["method"] == "assisted")
        # the base's own weights draft tokens the base accepts: fewer serial calls than new tokens
        assert (row["serial_calls"] < row["new_tokens"]) == agrees
        assistant = decoders["assisted"].keywords["assistant"]
        loaded_once = assistant.model
        assert loaded_once is not None and loaded_once.dtype == model.dtype
        decoders["assisted"](model, encode_messages(tokenizer, [{"role": "user", "content": "Hi"}]), 4)
        assert assistant.model is loaded_once


def test_assisted_without_an_assistant_is_skipped_with_a_note(loaded, tmp_path):
    model, tokenizer = loaded
    questions = load_questions(write_questions(tmp_path / "q.jsonl", QUESTIONS[1:2]))
    report = run_bench(model, tokenizer, questions, ["assisted"], max_new_tokens=4, progress=False)
    assert report["methods"] == ["ar"] and list(report["skipped"]) == ["assisted"]
    assert report["skipped"]["assisted"].startswith("no assistant model: pass --assistant-model NAME")
    assert "`assisted`: no assistant model" in markdown_report(report)
    decoders = default_decoders(BenchOptions(assistant=str(tmp_path / "missing")))  # run_bench is given a bad name
    report = run_bench(model, tokenizer, questions, ["assisted"], decoders, max_new_tokens=4, progress=False)
    reason = report["skipped"]["assisted"]
    assert reason.startswith(f"assistant model {tmp_path / 'missing'}: ") and "no directory there" in reason
    assert "\n" not in reason and report["methods"] == ["ar"]


def test_cli_bench_assisted_checks_the_assistant_model_before_loading_anything(checkpoint, tmp_path, capsys, monkeypatch):
    """`hf-bpd bench --assistant-model /no/such/dir`: exit 2 and one line, before any model is loaded; a real one
    runs the assisted method (added to the default methods) and is named in the report's settings."""
    import hf_bpd.cli.bench as cli_bench
    from hf_bpd.cli import main

    questions = str(write_questions(tmp_path / "q.jsonl", QUESTIONS[1:2]))
    argv = ["bench", "--model", str(checkpoint[1]), "--questions", questions, "--threads", "1", "--no-progress",
            "--max-new-tokens", "6", "--warmup", "0"]
    setup = cli_bench._setup

    def no_model(args):
        raise AssertionError("a model was loaded before --assistant-model was checked")

    monkeypatch.setattr(cli_bench, "_setup", no_model)
    assert main(argv + ["--assistant-model", "/no/such/dir", "--methods", "ar,assisted"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hf-bpd: error: could not load assistant model '/no/such/dir'")
    assert main(argv + ["--assistant-model", str(checkpoint[0]), "--batch-size", "1"]) == 2
    assert "not --batch-size" in capsys.readouterr().err

    monkeypatch.setattr(cli_bench, "_setup", setup)
    out = tmp_path / "bench.json"
    assert main(argv + ["--assistant-model", str(checkpoint[0]), "--methods", "assisted", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["assistant_model"] == str(checkpoint[0]) and report["methods"] == ["ar", "assisted"]
    assert all(s["exact"] for s in report["samples"])
    assert "| assisted |" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the flag is documented in `hf-bpd bench --help`
        main(["bench", "--help"])
    assert "--assistant-model NAME" in capsys.readouterr().out


def test_method_names_do_not_follow_the_checkpoints_own_defaults(checkpoint):
    """A checkpoint whose config asks for 3 drafts by default: `bpd` still means one argmax chain draft."""
    from hf_bpd.evaluation.decoders import default_decoders

    _, heads_dir = checkpoint
    model = BlockwiseParallelForCausalLM.from_pretrained(heads_dir)
    model.generation_config.num_drafts = 3
    decoders = default_decoders()
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8]])}
    assert decoders["bpd"](model, inputs, 6)[1].method == "chain"
    assert decoders["pbest"](model, inputs, 6)[1].method == "p-best"
    assert decoders["tree"](model, inputs, 6)[1].method == "tree"


def test_profile_script_smoke(checkpoint, tmp_path, capsys):
    """benchmarks/profile_decoding.py on the tiny checkpoint: every part is a share of generate() time."""
    from tests.test_training import ROOT

    spec = importlib.util.spec_from_file_location("profile_decoding", ROOT / "benchmarks" / "profile_decoding.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, heads_dir = checkpoint
    out = tmp_path / "profile.json"
    assert module.main(["--model", str(heads_dir), "--questions", str(write_questions(tmp_path / "q.jsonl")),
                        "--limit", "2", "--max-new-tokens", "6", "--methods", "bpd,tree", "--threads", "1",
                        "--output", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert set(rows) == {"bpd", "tree"}
    for row in rows.values():
        assert 0.0 < row["share"]["verification forward"] < 1.0 and row["block_efficiency"] >= 1.0
        assert abs(sum(row["share"].values()) - 1.0) < 1e-6
    assert "| bpd |" in capsys.readouterr().out


def test_draft_slots_script_smoke(checkpoint, tmp_path, capsys):
    """benchmarks/draft_slots.py on the tiny checkpoint made compiled + prompt lookup by default: every plan's output
    equals compiled plain decoding's, and the 7-node plan compiles a block of 8."""
    from hf_bpd.runtime import compiled as verify_runtime
    from tests.test_training import ROOT

    spec = importlib.util.spec_from_file_location("draft_slots", ROOT / "benchmarks" / "draft_slots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = BlockwiseParallelForCausalLM.from_pretrained(checkpoint[1])
    model.generation_config.compile, model.generation_config.prompt_lookup = True, True
    model_dir = tmp_path / "compiled-default"
    model.save_pretrained(model_dir)
    hf_bpd.load_tokenizer(str(checkpoint[1])).save_pretrained(model_dir)
    out = tmp_path / "slots.json"
    assert module.main(["--model", str(model_dir), "--questions", str(write_questions(tmp_path / "q.jsonl")),
                        "--limit", "2", "--max-new-tokens", "12", "--slots", "3,7", "--threads", "1",
                        "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["plan"] for r in rows] == ["ar-compiled", "default, 3 slots", "default, 7 slots"]
    assert all(r["identical"] == 2 and r["block_efficiency"] >= 1.0 for r in rows)
    assert "| default, 7 slots |" in capsys.readouterr().out
    runners = [r for by_size in verify_runtime._RUNNERS.values() for r in by_size.values()]
    assert any({4, 8} <= set(r.compiled_buckets) for r in runners)
    assert verify_runtime.COMPILED_DRAFT_SLOTS == 7  # restored by the script


def test_exactness_script_smoke(checkpoint, tmp_path, capsys):
    """benchmarks/exactness.py on the tiny checkpoint in bf16: the compiled default equals compiled plain decoding on
    every prompt, and the summary counts them."""
    from tests.test_training import ROOT

    spec = importlib.util.spec_from_file_location("exactness", ROOT / "benchmarks" / "exactness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "exactness.json"
    assert module.main(["--model", str(checkpoint[1]), "--questions", str(write_questions(tmp_path / "q.jsonl")),
                        "--limit", "2", "--max-new-tokens", "8", "--dtype", "bf16", "--threads", "1",
                        "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["summary"]["prompts"] == 2 and report["summary"]["identical"] == 2
    assert all(row["verifier"] == "compiled" and row["new_tokens"] > 0 for row in report["rows"])
    assert '"identical": 2' in capsys.readouterr().out


def test_vs_best_plain_divides_by_the_faster_plain_path():
    from hf_bpd.evaluation.bench import summarize_samples

    def sample(method, seconds):
        return {"method": method, "new_tokens": 100, "seconds": seconds, "serial_calls": None, "exact": True}

    samples = [sample("ar", 10.0), sample("ar-compiled", 4.0), sample("default", 2.0)]
    rows = {r["method"]: r for r in summarize_samples(samples, ["ar", "ar-compiled", "default"])}
    assert rows["default"]["speedup_vs_ar"] == pytest.approx(5.0)
    assert rows["default"]["vs_best_plain"] == pytest.approx(2.0)  # against ar-compiled's 25 tok/s, not ar's 10
    assert rows["ar"]["vs_best_plain"] == pytest.approx(0.4)
    rows = {r["method"]: r for r in summarize_samples(samples[::2], ["ar", "default"])}
    assert rows["default"]["vs_best_plain"] == pytest.approx(5.0)  # only eager plain ran


def test_vs_llama_cpp_column_when_it_ran():
    from hf_bpd.evaluation.bench import summarize_samples

    def sample(method, seconds, exact=True):
        return {"method": method, "new_tokens": 100, "seconds": seconds, "serial_calls": None, "exact": exact}

    samples = [sample("ar", 10.0), sample("llama.cpp", 4.0, exact=False), sample("default", 2.0)]
    rows = summarize_samples(samples, ["ar", "llama.cpp", "default"])
    assert [r["vs_llama_cpp"] for r in rows] == [pytest.approx(0.4), pytest.approx(1.0), pytest.approx(2.0)]
    report = {"summary": rows, "by_category": [], "skipped": {}}
    text = markdown_report(report)
    assert "| vs llama.cpp |" in text.splitlines()[0]
    assert "| llama.cpp | 25.0 |" in text and "no (own kernels)" in text and "**NO**" not in text
    rows = summarize_samples(samples[::2], ["ar", "default"])
    assert all(r["vs_llama_cpp"] is None for r in rows)
    assert "vs llama.cpp" not in markdown_report({"summary": rows, "by_category": [], "skipped": {}})


def test_llama_cpp_method_is_skipped_with_a_note(loaded, tmp_path, monkeypatch):
    """Without llama-cpp-python (or without a GGUF for the base) the llama.cpp method is skipped, with what to do."""
    import sys

    model, tokenizer = loaded
    questions = load_questions(write_questions(tmp_path / "q.jsonl", QUESTIONS[1:2]))
    report = run_bench(model, tokenizer, questions, ["ar", "llama.cpp"], max_new_tokens=4, progress=False)
    assert "not a packaged GGUF base: pass --gguf PATH" in report["skipped"]["llama.cpp"]
    decoders = default_decoders(BenchOptions(gguf=str(tmp_path / "missing.gguf")))
    report = run_bench(model, tokenizer, questions, ["ar", "llama.cpp"], decoders, max_new_tokens=4, progress=False)
    assert "no such .gguf file" in report["skipped"]["llama.cpp"]
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what an environment without the package looks like
    decoders = default_decoders(BenchOptions(gguf=str(tmp_path / "model.gguf")))
    report = run_bench(model, tokenizer, questions, ["ar", "llama.cpp"], decoders, max_new_tokens=4, progress=False)
    assert report["skipped"]["llama.cpp"].startswith("llama-cpp-python is not installed: pip install 'hf_bpd[llama]'")
    assert report["methods"] == ["ar"]


def test_a_llama_cpp_that_crashes_or_fails_is_skipped_with_what_to_do(tmp_path, monkeypatch):
    """llama.cpp is probed in a child process first: a build that crashes on this CPU (a signal) or fails on the file
    skips the column with a note (the rebuild without AMX for a crash) instead of taking the bench down."""
    from hf_bpd.evaluation import llama_cpp

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(llama_cpp, "_PROBED", {})
    monkeypatch.setattr(llama_cpp, "PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    reason = llama_cpp.probe(gguf, 2)
    assert reason.startswith("llama.cpp crashed (SIGSEGV) decoding model.gguf") and "GGML_AMX_INT8=OFF" in reason
    assert llama_cpp.probe(gguf, 2) is reason  # once per process and file
    monkeypatch.setattr(llama_cpp, "_PROBED", {})
    monkeypatch.setattr(llama_cpp, "PROBE", "raise SystemExit('bad magic')")
    assert llama_cpp.probe(gguf, 2) == "llama.cpp failed on model.gguf: bad magic"
    if importlib.util.find_spec("llama_cpp") is not None:  # the real probe on a file that is no model
        monkeypatch.undo()
        monkeypatch.setattr(llama_cpp, "_PROBED", {})
        assert llama_cpp.probe(gguf, 1).startswith("llama.cpp failed on model.gguf")


def test_llama_cpp_decodes_the_packaged_gguf(smollm2):
    """With llama-cpp-python installed: llama.cpp decodes the SmolLM2 GGUF greedily from the same prompt ids, within
    the token budget (its own Q4_1 kernels: its tokens need not be the dequantized base's)."""
    pytest.importorskip("llama_cpp")
    from hf_bpd.evaluation.llama_cpp import decode_llama_cpp

    base, tokenizer = smollm2
    inputs = encode_messages(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    sequences, stats = decode_llama_cpp(base, inputs, 24)
    prompt = inputs["input_ids"].shape[1]
    assert sequences[0, :prompt].tolist() == inputs["input_ids"][0].tolist()
    assert 0 < stats.new_tokens == sequences.shape[1] - prompt <= 24 and stats.block_efficiency == 1.0
    # the prompt went in as given and the greedy tokens are llama.cpp's own: its completion API from the same ids
    from hf_bpd.evaluation.llama_cpp import _LOADED

    llm = next(iter(_LOADED.values()))
    own = llm.create_completion(inputs["input_ids"][0].tolist(), max_tokens=24, temperature=0.0, top_k=1,
                                repeat_penalty=1.0)["choices"][0]["text"]
    assert tokenizer.decode(sequences[0, prompt:], skip_special_tokens=True).strip() == own.strip()


def test_llama_cpp_speculative_decoding_drafts_with_a_second_gguf(smollm2):
    """llama.cpp-specK: llama-cpp-python's speculative API with the draft model's GGUF. Drafting with the base's own
    GGUF, the greedy drafts are the base's own one-token choices: most steps accept all K draft tokens (block
    efficiency counted from the draft model's calls). llama.cpp's block forward rounds otherwise than its one-token
    steps, so its speculative output may leave its plain one at a near-tie (here after 30-odd tokens): only the start
    is compared. Without a draft model the method is skipped with the flag to pass."""
    pytest.importorskip("llama_cpp")
    from hf_bpd.evaluation.llama_cpp import decode_llama_cpp
    from hf_bpd.hub.base_models import PACKAGED_MODELS

    base, tokenizer = smollm2
    inputs = encode_messages(tokenizer, [{"role": "user", "content": "List the planets of the solar system."}])
    plain, _ = decode_llama_cpp(base, inputs, 40)
    gguf = PACKAGED_MODELS["smollm2-135m-instruct"].gguf()
    sequences, stats = decode_llama_cpp(base, inputs, 40, draft_tokens=4, draft_gguf=gguf)
    prompt = inputs["input_ids"].shape[1]
    assert sequences[0, : prompt + 16].tolist() == plain[0, : prompt + 16].tolist()
    assert stats.method == "llama.cpp-spec4" and sum(stats.accepted_lengths) + stats.serial_calls == stats.new_tokens
    assert stats.block_efficiency > 3.0, stats.accepted_lengths
    with pytest.raises(MethodSkipped, match="--assistant-model"):
        decode_llama_cpp(base, inputs, 8, draft_tokens=4)


def test_peak_memory_script_smoke(checkpoint, tmp_path, capsys):
    """benchmarks/peak_memory.py measuring one method in this process (what each of its child processes does): the
    resident size after loading and the peak while decoding, which cannot be below what was resident then."""
    from tests.test_training import ROOT

    spec = importlib.util.spec_from_file_location("peak_memory", ROOT / "benchmarks" / "peak_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = ["--model", str(checkpoint[1]), "--questions", str(write_questions(tmp_path / "q.jsonl")), "--limit", "1",
            "--max-new-tokens", "4", "--threads", "1"]
    assert module.main([*args, "--methods", "eager", "--in-process"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["method"] == "eager" and row["new_tokens"] == 4
    assert row["peak_mb"] >= row["loaded_mb"] * 0.9 > 0 and row["quantize"] is None and row["dtype"] == "float32"
    assert module.main([*args, "--methods", "eager", "--in-process", "--quantize", "int8"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["quantize"] == "int8" and row["dtype"] == "bfloat16" and row["new_tokens"] == 4
    with pytest.raises(SystemExit):
        module.main([*args, "--methods", "eager,turbo"])
    assert "unknown method(s) turbo" in capsys.readouterr().err
