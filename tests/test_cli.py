import subprocess
import sys


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hf_bpd.cli", *args], capture_output=True, text=True, timeout=600)


def test_generate_with_packaged_base():
    result = run_cli("generate", "--model", "smollm2-135m-instruct", "--chat", "--prompt",
                     "What is the capital of France?", "--max-new-tokens", "12", "--compare")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "new tokens: 8 " in result.stdout  # "The capital of France is Paris." then EOS
    assert "identical output: True" in result.stdout


def test_generate_bad_model_is_one_line_error(tmp_path):
    result = run_cli("generate", "--model", str(tmp_path / "missing"), "--max-new-tokens", "2")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("hf-bpd: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------ every subcommand: help, one-line errors
import argparse  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_bpd.cli import build_parser, main  # noqa: E402
from tests.test_bench import QUESTIONS, SUMMARY_KEYS, make_tiny_checkpoint, write_questions  # noqa: E402


def subcommands():
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(action.choices)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base_dir, heads_dir = make_tiny_checkpoint(root)
    return {"base": str(base_dir), "heads": str(heads_dir), "questions": str(write_questions(root / "q.jsonl")),
            "root": root}


def run_main(argv):
    """`(exit code, stdout, stderr)` of `hf-bpd argv` run in this process."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_subcommands_are_listed():
    assert {"generate", "bench", "analyze"} <= set(subcommands())


@pytest.mark.parametrize("command", [[]] + [[name] for name in subcommands()], ids=lambda c: c[0] if c else "top")
def test_every_subcommand_has_help(command, capsys):
    assert run_main(command + ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-bpd" + (f" {command[0]}" if command else ""))


def one_line_error(code, capsys):
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("hf-bpd: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "usage:" not in err
    return lines[0]


BAD_ARGS = [
    ([], "required: command"),
    (["bench", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "--max-new-tokens", "many"], "invalid int value"),
    (["bench", "--questions", "{root}/missing.jsonl"], "no questions file"),
    (["bench", "--questions", "{questions}", "--methods", "bpd,nope"], "unknown method(s) nope"),
    (["bench", "--questions", "{questions}", "--tree", "4,x"], "--tree must be comma-separated integers"),
    (["bench", "--questions", "{questions}", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["bench", "--questions", "{questions}", "--output", "{root}"], "is a directory"),
    (["bench", "--questions", "{questions}", "--plot", "{questions}"], "is a file"),
    (["bench", "--questions", "{root}/bad.jsonl"], "bad.jsonl:1 is not valid JSON"),
    (["bench", "--model", "{root}/no-model", "--questions", "{questions}"], "could not load"),
    (["analyze"], "required: --model"),
    (["analyze", "--model", "{heads}", "--rescorer", "bigram"], "invalid choice: 'bigram'"),
    (["analyze", "--model", "{heads}", "--questions", "{questions}", "--top-k", "1,0"], "--top-k must be"),
    (["analyze", "--model", "{base}", "--questions", "{questions}"], "plain base model"),
    (["analyze", "--model", "{heads}", "--questions", "{questions}", "--rescorer", "ngram"], "bundles no ngram"),
    (["generate", "--max-new-tokens"], "expected one argument"),
    (["generate", "--model", "{heads}", "--num-drafts", "0"], "--num-drafts must be >= 1"),
    (["generate", "--model", "{heads}", "--tree", "4,x"], "--tree must be comma-separated integers"),
    (["generate", "--model", "{heads}", "--rescorer", "ngram"], "bundles no ngram"),
    (["generate", "--model", "{heads}", "--draft-top-k", "100000"], "draft_top_k must be an integer in"),
    (["generate", "--model", "{base}", "--num-drafts", "2"], "plain base model"),
    (["generate", "--model", "{heads}", "--draft-nodes", "0"], "--draft-nodes must be >= 1"),
    (["generate", "--model", "{heads}", "--draft-nodes", "300"], "draft_nodes must be an integer in [1, 256]"),
    (["generate", "--model", "{heads}", "--draft-nodes", "3", "--tree", "2,1"], "tree= fixes the verified nodes"),
    (["generate", "--model", "{base}", "--draft-nodes", "3"], "plain base model"),
    (["generate", "--model", "{heads}", "--drafter", "feature"], "needs a feature-level drafter"),
    (["generate", "--model", "{heads}", "--drafter", "feature", "--num-drafts", "2"], "num_drafts would be ignored"),
    (["bench", "--questions", "{questions}", "--draft-nodes", "0"], "--draft-nodes must be >= 1"),
]


@pytest.mark.parametrize("argv, fragment", BAD_ARGS, ids=[" ".join(a[:2]) + f"-{i}" for i, (a, _) in
                                                           enumerate(BAD_ARGS)])
def test_bad_paths_and_options_are_one_line_errors(argv, fragment, tiny, capsys):
    (tiny["root"] / "bad.jsonl").write_text("{oops\n")
    argv = [a.format(**tiny) for a in argv]
    line = one_line_error(run_main(argv + (["--threads", "1"] if argv[:1] in (["bench"], ["analyze"], ["generate"]) and
                                           "--bogus" not in argv and "many" not in argv else [])), capsys)
    assert fragment in line


def test_bad_questions_file_in_a_real_process(tmp_path):
    result = run_cli("bench", "--questions", str(tmp_path / "missing.jsonl"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"hf-bpd: error: no questions file at {tmp_path / 'missing.jsonl'}: pass a .jsonl/.json/.txt prompt file"]


def test_generate_with_heads_prints_a_side_by_side_table(tiny, capsys):
    code = run_main(["generate", "--model", tiny["heads"], "--prompt", "hello world", "--max-new-tokens", "12",
                     "--num-drafts", "2", "--draft-top-k", "2", "--draft-nodes", "3", "--compare", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| method | tok/s | speed-up | block efficiency | identical to plain |" in out
    assert "| plain greedy generate() |" in out and "| bpd (heads' top-1 draft) |" in out
    assert "| bpd, 2-best, 3 nodes (above) |" in out
    assert out.count("| yes |") == 2 and "| NO |" not in out and "identical output: True" in out


def test_compare_times_every_method_as_its_fastest_of_repeats(tiny, capsys):
    """`--repeats N`: each compared method runs N times and its fastest run counts (the first run's output is the
    one printed and checked); N < 1 is a one-line error."""
    import time as _time

    from hf_bpd.cli.generate import _timed

    pauses, outputs = [0.08, 0.01, 0.05], []

    def call():
        _time.sleep(pauses[len(outputs)])
        outputs.append(len(outputs))
        return outputs[-1]

    out, seconds = _timed(call, 3)
    assert out == 0 and len(outputs) == 3 and 0.01 <= seconds < 0.05
    code = run_main(["generate", "--model", tiny["heads"], "--prompt", "hello world", "--max-new-tokens", "6",
                     "--compare", "--repeats", "2", "--threads", "1"])
    assert code == 0 and "identical output: True" in capsys.readouterr().out
    assert run_main(["generate", "--model", tiny["heads"], "--prompt", "hi", "--compare", "--repeats", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "hf-bpd: error: --repeats must be >= 1 (timed runs per method with --compare), got 0")


# ------------------------------------------------------------------ bench and analyze end to end
def test_bench_command_writes_table_json_and_plots(tiny, tmp_path, capsys):
    out = tmp_path / "out" / "bench.json"
    code = run_main(["bench", "--model", tiny["heads"], "--questions", tiny["questions"], "--limit", "2",
                     "--max-new-tokens", "8", "--methods", "pld,bpd,tree,bpd+ngram,feature", "--tree", "2,2",
                     "--threads", "1", "--output", str(out), "--plot", str(tmp_path / "plots"), "--no-progress"])
    stdout = capsys.readouterr().out
    assert code == 0
    assert "| method | tok/s | speed-up vs ar |" in stdout and "| tree |" in stdout
    report = json.loads(out.read_text())
    assert {"settings", "machine", "methods", "skipped", "summary", "by_category", "samples"} <= set(report)
    assert {"cpu", "threads", "torch", "transformers"} <= set(report["machine"]) and report["machine"]["threads"] == 1
    assert report["settings"]["chat"] is True and report["settings"]["tree"] == [2, 2]
    assert report["methods"] == ["ar", "pld", "bpd", "tree"] and list(report["skipped"]) == ["bpd+ngram", "feature"]
    for row in report["summary"]:
        assert set(row) == SUMMARY_KEYS and row["exact"] is True
    assert len(report["samples"]) == 2 * 4
    assert (tmp_path / "plots" / "speedup.png").exists() and (tmp_path / "plots" / "block_efficiency.png").exists()


def test_bench_batch_sizes_compare_batched_bpd_with_batched_plain_decoding(tiny, tmp_path, capsys):
    out = tmp_path / "batch.json"
    code = run_main(["bench", "--model", tiny["heads"], "--questions", tiny["questions"], "--limit", "3",
                     "--max-new-tokens", "10", "--batch-size", "1,4", "--threads", "1", "--warmup", "0",
                     "--rounds", "2", "--methods", "ar,ar-artifact,bpd", "--no-progress", "--output", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0 and "| batch size | method | tok/s | vs best plain |" in stdout
    report = json.loads(out.read_text())
    assert [r["batch_size"] for r in report["batches"]] == [1, 4] and report["settings"]["rounds"] == 2
    assert all(r["rounds"] == 2 for r in report["batches"])
    for row in report["batches"]:
        plain, bpd = row["methods"]["ar"], row["methods"]["bpd"]
        best = max(plain["tokens_per_s"], row["methods"]["ar-artifact"]["tokens_per_s"])
        assert row["prompts"] == 3 and bpd["identical_rows"] == 3 and row["best_plain"] in ("ar", "ar-artifact")
        assert row["methods"]["ar-artifact"]["identical_rows"] == 3
        assert plain["tokens_per_s"] > 0 and bpd["tokens_per_s"] > 0 and bpd["block_efficiency"] >= 1
        assert bpd["vs_best_plain"] == pytest.approx(bpd["tokens_per_s"] / best)
    passes = [r["methods"]["bpd"]["forward_passes"] for r in report["batches"]]
    assert passes[1] < passes[0]  # 1 batch, not 3 rows
    assert run_main(["bench", "--model", tiny["heads"], "--batch-size", "0"]) == 2
    assert run_main(["bench", "--model", tiny["heads"], "--batch-size", "4", "--rounds", "0"]) == 2
    assert run_main(["bench", "--model", tiny["heads"], "--batch-size", "4", "--methods", "ar,fast"]) == 2

    code = run_main(["bench", "--model", tiny["heads"], "--questions", tiny["questions"], "--limit", "3",
                     "--max-new-tokens", "10", "--batch-size", "4", "--threads", "1", "--warmup", "0",
                     "--methods", "ar,ar-compiled,bpd-compiled", "--no-progress", "--output", str(out)])
    assert code == 0
    row = json.loads(out.read_text())["batches"][0]
    compiled = {name: row["methods"][name] for name in ("ar-compiled", "bpd-compiled")}
    assert row["best_plain"] in ("ar", "ar-compiled") and all(m["identical_rows"] == 3 for m in compiled.values())
    # the methods share the compiled shapes: each shape's time goes to the first call that meets it
    assert sum(m["compile_seconds"] for m in compiled.values()) > 0 and compiled["ar-compiled"]["compile_seconds"] > 0
    assert all(m["compile_seconds"] >= 0 and m["tokens_per_s"] > 0 for m in compiled.values())


def test_bench_on_a_plain_base_model(tiny, capsys):
    code = run_main(["bench", "--model", tiny["base"], "--questions", tiny["questions"], "--limit", "1",
                     "--max-new-tokens", "4", "--methods", "bpd,pld", "--threads", "1", "--no-progress",
                     "--warmup", "0", "--no-chat"])
    stdout = capsys.readouterr().out
    assert code == 0
    assert "| pld |" in stdout and "`bpd`: the model has no drafting heads" in stdout


def test_analyze_command_writes_tables_json_and_plots(tiny, tmp_path, capsys):
    out = tmp_path / "analysis.json"
    code = run_main(["analyze", "--model", tiny["heads"], "--questions", tiny["questions"], "--max-new-tokens",
                     "10", "--top-k", "1,4", "--threads", "1", "--output", str(out), "--plot",
                     str(tmp_path / "plots"), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0
    assert "Table 3" in captured.out and "oracle k=4" in captured.out and "h_max" in captured.out
    assert "bundles no rescorer" in captured.err
    report = json.loads(out.read_text())
    assert set(report["summary"]) == {"all", "writing", "math"}
    summary = report["summary"]["all"]
    assert summary["prompts"] == len(QUESTIONS)
    assert set(summary["oracle_block_efficiency"]) == {"1", "4"}
    assert summary["oracle_block_efficiency"]["1"] == pytest.approx(summary["vanilla"]["block_efficiency"])
    assert len(summary["entropy"]["mean"]) == 4 and 1 <= summary["entropy"]["h_max"] <= 4
    assert len(report["prompts"]) == 3 and report["settings"]["rescorer"] is None
    assert (tmp_path / "plots" / "entropy.png").exists() and (tmp_path / "plots" / "oracle_topk.png").exists()


@pytest.mark.parametrize("model", ["heads", "base"])
def test_generate_no_heads_with_sampling_compare(tiny, model, capsys):
    """--no-heads decodes plainly on a heads checkpoint and on a plain base; --compare samples the base the same way."""
    code = run_main(["generate", "--model", tiny[model], "--prompt", "hello world", "--max-new-tokens", "6",
                     "--no-heads", "--do-sample", "--compare", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| plain sampling generate() |" in out and "| this run (above) |" in out


def test_profile_command_eager_table(tmp_path, capsys, monkeypatch):
    """`hf-bpd profile --no-compile` on a tiny base: one row per length, stored under $HF_BPD_CACHE/costs."""
    from tests.conftest import tiny_base

    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path / "cache"))
    tiny_base("llama").save_pretrained(tmp_path / "base")
    out = tmp_path / "costs.json"
    assert main(["profile", "--model", str(tmp_path / "base"), "--lengths", "1-3", "--no-compile", "--threads", "1",
                 "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 3 |" in printed and "stored" in printed
    assert json.loads(out.read_text())["lengths"] == [1, 2, 3]
    assert list((tmp_path / "cache" / "costs").glob("*.json"))


def test_dtype_short_names_and_int8_quantization_flag(tiny, capsys):
    """`--dtype bf16` (fp32, fp16) names torch's dtypes; `--quantize int8` loads the base with hf_bpd's int8 weights
    and bf16 activations (bf16 by default then); anything else is a one-line error."""
    parser = build_parser()
    for command in ("generate", "bench", "profile", "compile"):
        assert parser.parse_args([command, "--dtype", "bf16"]).dtype == "bfloat16"
    assert parser.parse_args(["bench", "--dtype", "fp32", "--quantize", "int8"]).quantize == "int8"
    assert parser.parse_args(["compile", "--quantize", "int8"]).quantize == "int8"  # the int8 base's artifact
    assert run_main(["bench", "--quantize", "int4"]) == 2
    assert "argument --quantize: invalid choice: 'int4'" in capsys.readouterr().err
    assert run_main(["generate", "--dtype", "bf8"]) == 2
    assert "argument --dtype: invalid choice: 'bf8'" in capsys.readouterr().err
    from hf_bpd.cli import load_model
    from hf_bpd.runtime.int8_weights import Int8WeightLinear

    model = load_model(tiny["heads"], quantize="int8")
    assert isinstance(model.base_lm.model.layers[0].mlp.up_proj, Int8WeightLinear)
    assert model.base_lm.model.layers[0].mlp.up_proj.weight.dtype == torch.int8 and model.dtype == torch.bfloat16
    code = run_main(["generate", "--model", tiny["heads"], "--prompt", "Hi", "--max-new-tokens", "4", "--quantize",
                     "int8"])
    assert code == 0, capsys.readouterr().err
    with pytest.raises(ValueError, match="--quantize int8 computes with bf16 activations: pass --dtype bf16, not float32"):
        load_model(tiny["heads"], dtype="fp32", quantize="int8")

def test_calibrate_save_rewrites_a_local_config_whole_and_refuses_a_linked_one(tiny, tmp_path, capsys):
    """`calibrate --save` writes `head_calibration` into a local checkpoint's config.json through a temporary file
    renamed into place; a config.json that is a link (a Hub snapshot's files link into the shared blob store) is
    refused in one line, before anything is loaded, and the file it links to is untouched."""
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny["heads"], checkpoint)
    args = ["calibrate", "--model", str(checkpoint), "--questions", tiny["questions"], "--limit", "1",
            "--max-new-tokens", "6", "--threads", "1", "--save"]
    assert run_main(args) == 0, capsys.readouterr().err
    assert "head_calibration" in json.loads((checkpoint / "config.json").read_text())
    assert not [p for p in checkpoint.iterdir() if p.name.endswith(".tmp")]
    blob = tmp_path / "blob.json"
    (checkpoint / "config.json").rename(blob)
    (checkpoint / "config.json").symlink_to(blob)
    before = blob.read_text()
    line = one_line_error(run_main(args), capsys)
    assert "is a link" in line and blob.read_text() == before
