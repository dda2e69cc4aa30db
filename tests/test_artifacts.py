"""Compiled steps that outlive the process (`hf_bpd.runtime.artifacts`, `hf-bpd compile`): built once by the command
(a tiny base's step and one-token batch step, ~1 min, shared by the module), loaded by a new process, exact, keyed,
checked and locked."""

import contextlib
import fcntl
import io
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_bpd import BlockwiseParallelForCausalLM
from hf_bpd.runtime import artifacts, cache_files
from hf_bpd.runtime.cache_files import COSTS_FILE, KeptCosts
from hf_bpd.runtime.compiled import ArtifactRunner, _RUNNERS

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.artifacts]


def tiny_base(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return AutoModelForCausalLM.from_config(config).eval()


def precompiled_headers() -> set:
    """The precompiled headers (`.gch`) in torch's own folder for them (outside any cache directory of ours)."""
    from torch._inductor import codecache

    return set(Path(codecache._HEADER_DIR).glob("*.gch"))


NEW_HEADERS = []  # the precompiled headers that appeared while `cli_build` built its artifacts


def saved_base(cache: Path):
    """A fresh copy of the module's tiny base, loaded from where `cli_build` saved it (its artifact's key)."""
    return AutoModelForCausalLM.from_pretrained(cache / "tiny").eval()


@pytest.fixture(scope="module")
def cli_build(tmp_path_factory):
    """`(cache directory, printed)`: the tiny base saved to disk and its artifact built by `hf-bpd compile` with 1
    thread into a fresh $HF_BPD_CACHE: `--no-batch-step` first (the step), then without the flag (the one-token batch
    step beside the step it finds built); `printed`: each call's `(stdout, stderr)`."""
    from hf_bpd.cli import main

    cache = tmp_path_factory.mktemp("hf_bpd_cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_BPD_CACHE", str(cache))
    threads = torch.get_num_threads()
    tiny_base().save_pretrained(cache / "tiny")
    printed = []
    headers = precompiled_headers()
    for flags in (["--no-batch-step"], []):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert main(["compile", str(cache / "tiny"), "--threads", "1", *flags]) == 0
        printed.append((out.getvalue(), err.getvalue()))
    NEW_HEADERS.extend(precompiled_headers() - headers)
    yield cache, printed
    torch.set_num_threads(threads)
    patch.undo()


@pytest.fixture(scope="module")
def built(cli_build):
    """`(cache directory, base, package path)`: the artifact `cli_build` built (the step and the batch steps), its
    base, torch at its 1 thread."""
    cache, _ = cli_build
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base = saved_base(cache)
    yield cache, base, artifacts.key_dir(artifacts.artifact_key(base, 1)) / artifacts.PACKAGE
    torch.set_num_threads(threads)


def example(capacity: int, block: int, past: int):
    closed = torch.finfo(torch.float32).min
    g = torch.Generator().manual_seed(capacity + block + past)
    kv = [torch.randn(1, 2, capacity, 8, generator=g) for _ in range(4)]
    mask = torch.zeros(1, 1, block, past + block)
    mask[0, 0, :, past:] = torch.triu(torch.full((block, block), closed), 1)
    ids = torch.randint(0, 96, (1, block), generator=g)
    return ids, (past + torch.arange(block))[None], mask, torch.tensor(past), kv


def eager_step(base, ids, positions, mask, past: int, kv):
    """`(logits, hidden)` of the exported step run eagerly over the whole cache `kv` (written in place), `mask` (or a
    dict of masks by layer type) covering the slots the artifact attends, the slots after them closed."""
    rows, block, capacity = ids.shape[0], ids.shape[1], kv[0].shape[2]
    cache, _ = artifacts.example_inputs(base, capacity=capacity, rows=rows)

    def padded(m):
        full = torch.full((rows, 1, block, capacity), torch.finfo(m.dtype).min)
        full[..., : m.shape[-1]] = m
        return full

    masks = {kind: padded(m) for kind, m in mask.items()} if isinstance(mask, dict) else padded(mask)
    with torch.no_grad():
        return artifacts._Step(base, cache)(ids, positions, masks, torch.tensor(past), kv)


def ragged_batch(seed: int, block: int, past: int, rows: int = 3, capacity: int = 64):
    """`(kv, mask, ids)` of a batch step: `rows` rows of `block` tokens after `past` slots of a random `capacity`-slot
    cache, each block causal, row 1 behind 5 slots of padding (its slot `i` holds position `i - 5`)."""
    closed = torch.finfo(torch.float32).min
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(rows, 2, capacity, 8, generator=g) for _ in range(4)]
    mask = torch.zeros(rows, 1, block, past + block)
    mask[:, 0, :, past:] = torch.triu(torch.full((block, block), closed), 1)
    mask[1, :, :, :5] = closed
    return kv, mask, torch.randint(0, 96, (rows, block), generator=g)


def step_equals_eager(artifact, base, ids, positions, mask, past: int, kv):
    """Runs `artifact` on `kv` (written in place) and the eager step on a copy of it: the same logits, and every row's
    keys/values written where the eager step wrote them. Returns `(logits, eager logits, eager kv)`."""
    eager_kv = [t.clone() for t in kv]
    logits, _ = artifact(ids, positions, mask, torch.tensor(past), kv)
    eager_logits, _ = eager_step(base, ids, positions, mask, past, eager_kv)
    assert torch.allclose(logits, eager_logits, atol=1e-4)
    for new, old in zip(kv, eager_kv):
        assert torch.allclose(new, old, atol=1e-5)
    return logits, eager_logits, eager_kv


def test_one_artifact_serves_every_block_and_context_length_and_writes_the_cache(built):
    _, base, path = built
    artifact = artifacts.Artifact(path)
    for capacity, block, past in ((64, 1, 5), (64, 8, 40), (512, 3, 300), (1024, 16, 1000)):
        ids, positions, mask, length, kv = example(capacity, block, past)
        before = [t.clone() for t in kv]
        logits, hidden = artifact(ids, positions, mask, length, kv)
        assert logits.shape == (1, block, 96) and hidden.shape == (1, block, 32)
        # the keys/values of this block were written in place at [past, past + block), nothing else
        for new, old in zip(kv, before):
            assert not torch.equal(new[:, :, past:past + block], old[:, :, past:past + block])
            assert torch.equal(new[:, :, :past], old[:, :, :past]) and torch.equal(new[:, :, past + block:],
                                                                                     old[:, :, past + block:])
        # the same step eagerly, over the whole cache with the unused slots masked: the same tokens
        eager_logits, _ = eager_step(base, ids, positions, mask, past, [t.clone() for t in before])
        assert torch.allclose(logits, eager_logits, atol=1e-4)
        assert torch.equal(logits.argmax(-1), eager_logits.argmax(-1))


def test_a_new_process_loads_the_artifact_and_decodes_exactly_without_compiling(built):
    cache, base, path = built
    inputs = example(64, 4, 20)
    reference = artifacts.Artifact(path)(*inputs)[0]
    torch.save({"inputs": inputs, "logits": reference}, cache / "job.pt")
    script = textwrap.dedent(f"""
        import json, sys, time, torch
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        torch.set_num_threads(1)
        from tests.test_artifacts import saved_base
        from hf_bpd import BlockwiseParallelForCausalLM
        from hf_bpd.runtime import artifacts
        job = torch.load({str(cache / "job.pt")!r})
        base = saved_base(Path({str(cache)!r}))
        start = time.perf_counter()
        artifact = artifacts.load(base)
        seconds = time.perf_counter() - start
        logits = artifact(*job["inputs"])[0]
        model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2).eval()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.heads.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        exact = []
        for seed in range(3):
            ids = torch.randint(3, 96, (1, 4 + 3 * seed), generator=torch.Generator().manual_seed(seed))
            kw = dict(max_new_tokens=30, do_sample=False, eos_token_id=None)
            exact.append(torch.equal(model.generate(ids, compile=True, **kw), base.generate(ids, **kw)))
        from hf_bpd.runtime.compiled import _RUNNERS
        print(json.dumps({{"same_logits": torch.equal(logits, job["logits"]), "load_seconds": seconds,
                          "exact": exact, "compile_seconds": model.last_generation_stats.compile_seconds,
                          "runners": [type(r).__name__ for r in _RUNNERS[base].values()]}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "HF_BPD_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same_logits"] and result["exact"] == [True, True, True]
    assert result["runners"] == ["ArtifactRunner"] and result["compile_seconds"] == 0.0
    assert result["load_seconds"] < 30


def test_the_key_names_what_the_artifact_depends_on(built):
    cache, base, _ = built
    key = artifacts.artifact_key(base, 1)
    assert artifacts.key_dir(key) != artifacts.key_dir(artifacts.artifact_key(base, 2))  # threads
    other = saved_base(cache)
    with torch.no_grad():
        other.model.norm.weight.add_(1.0)
    assert artifacts.key_dir(key) != artifacts.key_dir(artifacts.artifact_key(other, 1))  # weights
    assert key["cpu"] == torch.backends.cpu.get_cpu_capability() and key["torch"] == torch.__version__
    # the CPU's flags too (AMX tiles: the capability says AVX512 with or without them)
    other_cpu = artifacts.key_dir({**key, "cpu_flags": "0" * 16})
    assert artifacts.key_dir(key) != other_cpu and len(key["cpu_flags"]) == 16
    # another thread count has no artifact: compile=True falls back to compiling in the process
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert artifacts.load(saved_base(cache)) is None
    finally:
        torch.set_num_threads(threads)


def test_a_corrupt_artifact_is_not_loaded(built, tmp_path, monkeypatch):
    """(`build` then builds it again: it keeps a package only when `valid`, the check used here.)"""
    cache, base, path = built
    copy = tmp_path / "artifacts"
    import shutil

    shutil.copytree(cache / "artifacts", copy)
    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path))
    key = artifacts.artifact_key(base, 1)
    directory = artifacts.key_dir(key)
    assert artifacts.valid(directory, key)
    data = bytearray((directory / artifacts.PACKAGE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (directory / artifacts.PACKAGE).write_bytes(bytes(data))
    assert not artifacts.valid(directory, key)
    assert artifacts.load(saved_base(cache)) is None  # a base this process has not looked up yet
    (directory / "key.json").write_text("{")  # a damaged key too
    assert not artifacts.valid(directory, key) and [r for r in artifacts.listing() if r.get("broken")]


def test_a_second_builder_waits_for_the_first_and_builds_nothing(built, tmp_path, monkeypatch):
    cache, base, _ = built
    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path))
    key = artifacts.artifact_key(base, 1)
    directory = artifacts.key_dir(key)
    directory.mkdir(parents=True)
    result = []
    with open(directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a first builder at work
        waiter = threading.Thread(target=lambda: result.append(artifacts.build(base)))
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive()  # blocked on the lock
        source = cache / "artifacts" / directory.name
        for name in (artifacts.PACKAGE, "key.json"):  # the first builder finishes
            (directory / name).write_bytes((source / name).read_bytes())
    waiter.join(timeout=60)
    assert result == [directory / artifacts.PACKAGE]
    assert json.loads((directory / "key.json").read_text()) == json.loads((source / "key.json").read_text())


def test_building_an_artifact_leaves_no_precompiled_header(built):
    """Without `inlining.NO_PRECOMPILED_HEADERS` each build wrote two new ~150 MB headers that nothing reused."""
    assert not NEW_HEADERS, f"{len(NEW_HEADERS)} new precompiled headers: {sorted(map(str, NEW_HEADERS))}"


def test_compile_command_lists_and_clears(built, capsys):
    from hf_bpd.cli import main

    assert main(["compile", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "1 threads" in listed and "MB" in listed
    assert main(["compile"]) == 2  # no model: one line
    assert "needs a model" in capsys.readouterr().err


def test_compile_command_builds_the_step_and_the_batch_steps(cli_build, built, capsys):
    """`hf-bpd compile MODEL --no-batch-step` built the step only; without the flag the one-token and two-token batch
    steps were built beside it (the step found built) and batches are said to run on them; `--list` names each."""
    from hf_bpd.cli import main

    (first_out, first_err), (second_out, second_err) = cli_build[1]
    assert "building the compiled step" in first_err and "batch step" not in first_out + first_err
    assert "building the compiled one-token batch step" in second_err
    assert "building the compiled two-token batch step" in second_err and "on the batch steps" in second_out
    assert "building the compiled step" not in second_err  # found built
    graphs = (artifacts.STEP, *artifacts.BATCH_GRAPHS)
    assert artifacts.listing() and all(record.get("graph") in graphs for record in artifacts.listing())
    assert main(["compile", "--list"]) == 0
    listed = capsys.readouterr().out
    assert ": step, " in listed and ": one_token, " in listed and ": two_tokens, " in listed


def test_generate_uses_a_built_artifact_in_this_process(built):
    _, base, _ = built
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2).eval()
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(5))
    for new in (20, 700):  # a 512-slot cache, then a 1,024-slot one: the same artifact, nothing compiled
        kw = dict(max_new_tokens=new, do_sample=False, eos_token_id=None)
        assert torch.equal(model.generate(ids, compile=True, **kw), base.generate(ids, **kw))
        assert model.last_generation_stats.compile_seconds == 0.0
        assert model.last_generation_stats.verifier == "artifact"
    assert sorted(_RUNNERS[base]) == [("artifact", 512), ("artifact", 1024)]
    assert all(isinstance(r, ArtifactRunner) for r in _RUNNERS[base].values())


def test_compile_command_says_which_drafting_shapes_the_artifact_serves():
    """`hf-bpd compile CKPT --tree/--draft-nodes`: the block a drafting shape verifies, against the 16 served."""
    from argparse import Namespace

    from hf_bpd.cli.artifacts import _largest_block

    model = BlockwiseParallelForCausalLM.from_base(tiny_base(), num_heads=2).eval()
    assert _largest_block(model, Namespace(tree="4,4", draft_nodes=None)) == 21 > artifacts.MAX_BLOCK
    assert _largest_block(model, Namespace(tree=None, draft_nodes=7)) == 3  # 2 heads draft 2 nodes at most
    assert _largest_block(tiny_base(), Namespace(tree=None, draft_nodes=None)) == 1


def test_one_artifact_serves_batches_each_row_on_its_own_positions_and_mask(built):
    """Rows of one call with their own positions and masks (holes, other lengths) get what the eager step gives
    them (a step built from inputs whose rows shared one position row computed every row from row 0's)."""
    _, base, path = built
    artifact = artifacts.Artifact(path)
    block, past = 2, 20
    kv, mask, ids = ragged_batch(7, block, past)
    mask[2, :, :, 3:9] = torch.finfo(torch.float32).min
    positions = torch.stack([past + torch.arange(block), 15 + torch.arange(block), 14 + torch.arange(block)])
    step_equals_eager(artifact, base, ids, positions, mask, past, kv)


@pytest.mark.parametrize("graph", [artifacts.ONE_TOKEN, artifacts.TWO_TOKENS])
def test_the_batch_steps_equal_the_eager_step_row_by_row(built, graph):
    """The one-token batch step (one token per row, stacked query heads) and the two-token one (a batch's width-2
    steps), any number of rows: each computes what the eager step computes for each row, with its own positions and
    mask, and writes each row's keys/values where it wrote."""
    _, base, path = built
    directory = path.parent
    step = artifacts.Artifact(artifacts.graph_files(directory, graph)[0])
    width = 1 if graph == artifacts.ONE_TOKEN else 2
    closed = torch.finfo(torch.float32).min
    for rows, past, capacity in ((3, 20, 64), (1, 5, 64), (17, 300, 512)):
        g = torch.Generator().manual_seed(rows + past)
        kv = [torch.randn(rows, 2, capacity, 8, generator=g) for _ in range(4)]
        mask = torch.zeros(rows, 1, width, past + width)
        mask[:, 0, :, past:] = torch.triu(torch.full((width, width), closed), 1)
        mask[1 % rows, :, :, :5] = closed  # holes in some rows' pasts
        mask[rows - 1, :, :, 3:past // 2] = closed
        ids = torch.randint(0, 96, (rows, width), generator=g)
        positions = (past - torch.arange(rows) % 4)[:, None] + torch.arange(width)
        eager_kv = [t.clone() for t in kv]
        logits, hidden = step(ids, positions, mask, torch.tensor(past), kv)
        eager_logits, eager_hidden = eager_step(base, ids, positions, mask, past, eager_kv)
        assert logits.shape == (rows, width, 96) and torch.allclose(logits, eager_logits, atol=1e-4)
        assert torch.allclose(hidden, eager_hidden, atol=1e-4)
        for new, old in zip(kv, eager_kv):
            assert torch.allclose(new, old, atol=1e-5)
    record = json.loads(artifacts.graph_files(directory, graph)[1].read_text())
    assert record["graph"] == graph and record["weights"] == artifacts.cached_key(base)["weights"]
    assert artifacts.valid(directory, artifacts.cached_key(base), graph)
    with pytest.raises(ValueError, match="graphs are step, one_token, two_tokens"):
        artifacts.graph_files(directory, "three_tokens")


def test_compile_true_verifies_batches_on_the_artifact_row_exact(built, monkeypatch):
    """`generate(compile=True)` on a batch runs the artifact's batched runner (nothing compiled in the call): with
    forced drafts that rows accept to different depths, every row equals its prompt's lone greedy output, and rows
    that stop leave the step (the rows after them move into their places: a step computes the active rows only)."""
    from hf_bpd.runtime import batched
    from tests.test_batch import PAD, check_rows, left_padded, random_prompts
    from tests.test_batch_compiled import reference_drafts

    _, base, _ = built
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=3).eval()
    prompts = random_prompts(5, seed=11, longest=18)
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    lone = reference_drafts(monkeypatch, model, prompts, width, kwargs)
    ran, call = [], artifacts.Artifact.__call__
    monkeypatch.setattr(artifacts.Artifact, "__call__",
                        lambda self, *args: ran.append((self.path.name, args[0].shape[1])) or call(self, *args))
    out = model.generate(ids, attention_mask=mask, compile=True, **kwargs)
    assert check_rows(model, prompts, out, width, kwargs) == 0
    one_token = artifacts.graph_files(built[2].parent, artifacts.ONE_TOKEN)[0].name
    assert {(name, w > 1) for name, w in ran} == {(one_token, False), (artifacts.PACKAGE, True)}
    stats = model.last_generation_stats
    assert stats.verifier == "artifact" and stats.compile_seconds == 0.0
    per_step = list(zip(*[row.accepted_lengths[2:] for row in stats.rows]))
    assert any(len(set(step)) > 2 for step in per_step)  # ragged: rows accepted different lengths together
    runners = batched._RUNNERS[base]
    assert runners and all(isinstance(r, batched.ArtifactBatchedRunner) and not r.compiled_widths
                           for r in runners.values())

    # rows stop at their own EOS: the steps after compute the active rows only, on the same runner
    stops = {t: sum(t in lone[r][:20] for r in range(5)) for t in range(3, 96)}
    eos = max(stops, key=stops.get)
    kwargs_eos = dict(kwargs, eos_token_id=eos)
    computed, run = [], batched.ArtifactBatchedRunner.run

    def counting(self, tokens, *args, **kw):
        computed.append(tokens.shape[0])
        return run(self, tokens, *args, **kw)

    monkeypatch.setattr(batched.ArtifactBatchedRunner, "run", counting)
    out = model.generate(ids, attention_mask=mask, compile=True, **kwargs_eos)
    assert check_rows(model, prompts, out, width, kwargs_eos) == 0
    stopped = [row.new_tokens < 30 for row in model.last_generation_stats.rows]
    assert any(stopped[:-1]) and not all(stopped)  # a row stops before another row after it (which moves up)
    assert computed[0] == 5 and min(computed) < 5 and computed == sorted(computed, reverse=True)
    assert model.last_generation_stats.verifier == "artifact" and len(runners) == 1
    # plain compiled batches (use_heads=False) on the artifact too
    out = model.generate(ids, attention_mask=mask, compile=True, use_heads=False, **kwargs)
    assert check_rows(model, prompts, out, width, kwargs) == 0
    assert model.last_generation_stats.verifier == "artifact"


def test_a_batchs_steps_of_one_and_two_tokens_run_on_the_batch_steps(built, monkeypatch):
    """With the batch steps built, a batch's one-token steps run on the one-token batch step and its width-2 steps on
    the two-token one (wider blocks on the step), every row its prompt's lone greedy output. The width is forced to
    alternate (1, 2, 3) here: which graph serves a width is under test, not the width choice."""
    from hf_bpd.generation import controller
    from tests.test_batch import PAD, check_rows, left_padded, random_prompts

    _, base, path = built
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=3).eval()
    prompts = random_prompts(4, seed=9, longest=12)
    kwargs = dict(max_new_tokens=18, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    ids, mask = left_padded(prompts)
    widths = iter(range(10_000))
    monkeypatch.setattr(controller.BatchWidth, "choose", lambda self, rows, *a, **k: 1 + next(widths) % 3)
    ran, call = [], artifacts.Artifact.__call__
    monkeypatch.setattr(artifacts.Artifact, "__call__",
                        lambda self, *args: ran.append((self.path.name, args[0].shape[1])) or call(self, *args))
    out = model.generate(ids, attention_mask=mask, compile=True, **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    names = {graph: artifacts.graph_files(path.parent, graph)[0].name
             for graph in (artifacts.ONE_TOKEN, artifacts.TWO_TOKENS)}
    steps = [(name, width) for name, width in ran if width > 0]
    assert {width for name, width in steps if name == names[artifacts.ONE_TOKEN]} == {1}
    assert {width for name, width in steps if name == names[artifacts.TWO_TOKENS]} == {2}
    assert {width for name, width in steps if name == artifacts.PACKAGE} >= {3}


def test_an_artifact_runner_times_its_own_steps_once_per_machine(built, monkeypatch):
    """The width choice of a batch on the artifact reads the runner's own step costs (blocks of 1 to the widest
    width on every row, one token on halved rows), timed once and kept beside the artifact: a later runner of as
    many rows reads them and times nothing."""
    from hf_bpd.runtime import batched

    _, base, path = built
    (path.parent / COSTS_FILE).unlink(missing_ok=True)
    runner = batched.ArtifactBatchedRunner(base, 4, 64, artifacts.load(base))
    runner.set_length(20)
    before = [t.clone() for t in runner.kv]
    costs = runner.measured_costs(3)
    assert sorted(costs) == [1, 2, 4, 8, 12] and all(ms > 0 for ms in costs.values())
    assert int(runner.cache.layers[0].cumulative_length) == 20  # rolled back
    assert all(torch.equal(a[:, :, :20], b[:, :, :20]) for a, b in zip(before, runner.kv))  # the used slots kept
    stored = json.loads((path.parent / COSTS_FILE).read_text())
    assert {int(n) for n in stored["4 rows"]} == set(costs)
    calls = []
    monkeypatch.setattr(batched.ArtifactBatchedRunner, "run", lambda self, *a, **k: calls.append(a))
    again = batched.ArtifactBatchedRunner.__new__(batched.ArtifactBatchedRunner)
    again.__dict__.update(runner.__dict__, kept=KeptCosts(None, ""))
    assert again.measured_costs(3) == pytest.approx(costs, abs=1e-3) and not calls
    # the one-token batch step's costs are its own: with it, the runner times its steps again
    again.one_token = artifacts.load(base, graph=artifacts.ONE_TOKEN)
    again.measured_costs(3)
    assert calls and "4 rows, one-token batch step" in json.loads((path.parent / COSTS_FILE).read_text())


def test_a_drafting_batch_on_the_artifact_weighs_widths_by_the_runners_costs(built, monkeypatch):
    """A drafting batch on the artifact prices its widths by its runner's timed steps, never by the eager forward's
    table (which would fail here), and stays row-exact."""
    from hf_bpd.generation import batch
    from tests.test_batch import PAD, check_rows, left_padded, random_prompts

    _, base, _ = built
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=3).eval()
    prompts = random_prompts(3, seed=5, longest=12)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    ids, mask = left_padded(prompts)

    def no_table(*args, **kw):
        raise AssertionError("the eager forward's table was read")

    monkeypatch.setattr(batch, "eager_costs", no_table)
    out = model.generate(ids, attention_mask=mask, compile=True, **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    assert model.last_generation_stats.verifier == "artifact"


def test_a_lone_calls_block_costs_are_timed_once_per_machine(built, monkeypatch):
    """The block lengths a lone call's cost schedule reads (`warm_up`) are timed once and kept beside the artifact: a
    later runner reads them and times only lengths not kept; a table whose longer block timed clearly faster than a
    shorter one (noise) is used by its call but not kept. Timings are fixed here (`_time_step`: 9 ms + 1 ms a
    token): what is tested is what is kept and read."""
    from hf_bpd.runtime import compiled

    _, base, path = built
    kept = path.parent / COSTS_FILE
    kept.unlink(missing_ok=True)
    noisy, timed = {}, []

    def one_row():
        return json.loads(kept.read_text())[compiled.ONE_ROW]


    def fixed(self, calls, past, tokens, positions, mask):
        n = tokens.shape[1]
        timed.append(n)
        return [noisy.get(n, 0.009 + 0.001 * n)] * calls

    monkeypatch.setattr(compiled.CompiledRunner, "_time_step", fixed)
    artifact = artifacts.load(base)
    runner = ArtifactRunner(base, 64, artifact)
    runner.warm_up([1, 4], torch.device("cpu"))
    assert runner.bucket_ms == pytest.approx({1: 10.0, 4: 13.0}) and set(timed) == {1, 4}
    assert one_row() == {"1": 10.0, "4": 13.0}
    timed.clear()
    again = ArtifactRunner(base, 64, artifact)
    assert again.bucket_ms == pytest.approx({1: 10.0, 4: 13.0})
    again.warm_up([1, 2, 3, 4], torch.device("cpu"))
    assert set(timed) == {2, 3} and one_row() == {"1": 10.0, "2": 11.0, "3": 12.0, "4": 13.0}
    # a new process's first call (`generate`) reads the kept table: nothing timed, the output exact
    timed.clear()
    _RUNNERS.pop(base, None)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2).eval()
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(ids, compile=True, draft_schedule="cost", **kw), base.generate(ids, **kw))
    assert model.last_generation_stats.verifier == "artifact" and not timed
    # a kept length timed on a loaded machine (5 tokens at 40 ms): new timings that disagree with it replace the table
    kept.write_text(json.dumps({compiled.ONE_ROW: {"5": 40.0}}))
    loaded = ArtifactRunner(base, 64, artifact)
    loaded.warm_up([1, 4, 8], torch.device("cpu"))
    assert one_row() == {"1": 10.0, "4": 13.0, "8": 17.0}
    kept.unlink()
    noisy[4] = 0.008  # 4 tokens timed 20 % under 1: noise, not kept
    fresh = ArtifactRunner(base, 64, artifact)
    fresh.warm_up([1, 4], torch.device("cpu"))
    assert fresh.bucket_ms == pytest.approx({1: 10.0, 4: 8.0}) and not kept.exists()
    _RUNNERS.pop(base, None)


def test_a_kept_cost_table_that_the_steps_contradict_is_timed_again(built):
    """A kept block-cost table timed on a loaded machine would price every later process's steps wrongly for good: a
    process checks each kept length against the median of its first `STALE_STEPS` steps of it. Costs that far off
    (500 ms a step for a tiny model) are dropped with their file, and the next call times them again and keeps what
    it timed; costs the steps confirm stay kept."""
    from hf_bpd.runtime import cache_files, compiled

    _, base, path = built
    kept = path.parent / COSTS_FILE
    _RUNNERS.pop(base, None)
    kept.write_text(json.dumps({compiled.ONE_ROW: {str(n): 500.0 + 10 * n for n in range(1, artifacts.MAX_BLOCK + 1)}}))
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2).eval()
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(8))
    kw = dict(max_new_tokens=64, do_sample=False, eos_token_id=None)
    # every node verified: each step is a block of the same kept length, so its first `STALE_STEPS` steps are checked
    assert torch.equal(model.generate(ids, compile=True, draft_schedule="fixed", **kw), base.generate(ids, **kw))
    assert len(model.last_generation_stats.accepted_lengths) > cache_files.STALE_STEPS
    runner = next(r for r in _RUNNERS[base].values() if isinstance(r, ArtifactRunner))
    assert runner.bucket_ms.get(1) != 500.0 and compiled.ONE_ROW not in json.loads(kept.read_text())  # dropped
    assert torch.equal(model.generate(ids, compile=True, draft_schedule="cost", **kw), base.generate(ids, **kw))
    timed = json.loads(kept.read_text())[compiled.ONE_ROW]  # timed again in the next call's warm-up, and kept
    assert set(timed) >= {"1"} and max(timed.values()) < 100.0
    # a table the steps confirm stays: the same costs read back by a new runner, checked against matching steps
    again = ArtifactRunner(base, 64, artifacts.load(base))
    assert again.kept.check.unchecked == {int(b) for b in timed}
    for _ in range(cache_files.STALE_STEPS):
        again._check_kept(1, timed["1"])
    assert 1 not in again.kept and again.bucket_ms[1] == timed["1"]
    assert json.loads(kept.read_text())[compiled.ONE_ROW] == timed
    _RUNNERS.pop(base, None)


def test_a_kept_batch_cost_table_that_the_steps_contradict_is_timed_again(built):
    """The batched runner's kept step costs (`KeptCosts` entries) are checked as the lone runner's are: a row count's
    table that its steps contradict (500 ms a step for a tiny model) is dropped with its entry in the file during the
    call, the next call times the steps again and keeps them, the other row counts' entries stay; rows stay exact."""
    from hf_bpd.runtime import batched, cache_files
    from tests.test_batch import PAD, check_rows, left_padded, random_prompts

    _, base, path = built
    kept = path.parent / COSTS_FILE
    kept.unlink(missing_ok=True)  # what earlier tests kept (with run() replaced, 0 ms a step) is not this one's
    batched.discard_batched_runners(base)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2).eval()
    prompts = random_prompts(4, seed=3, longest=10)
    kwargs = dict(max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    ids, mask = left_padded(prompts)
    model.generate(ids, attention_mask=mask, compile=True, **kwargs)  # the honest table, timed and kept
    stored = json.loads(kept.read_text())
    entries = [e for e in stored if e.startswith("4 rows")]  # the one the call used (one-token batch step or not)
    honest = {e: stored[e] for e in entries}
    stored.update({e: {n: 500.0 + ms for n, ms in table.items()} for e, table in honest.items()})
    stored["2 rows"] = {"1": 7.0}  # another row count's entry: not this runner's to drop
    kept.write_text(json.dumps(stored))
    batched.discard_batched_runners(base)
    out = model.generate(ids, attention_mask=mask, compile=True, **kwargs)
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    runner = next(iter(batched._RUNNERS[base].values()))
    assert not runner.kept.check.unchecked and not runner.kept.table  # found wrong during the call, dropped
    stored = json.loads(kept.read_text())
    dropped = [e for e in entries if e not in stored]
    assert len(dropped) == 1 and stored["2 rows"] == {"1": 7.0}  # the entry its steps priced, no other
    out = model.generate(ids, attention_mask=mask, compile=True, **kwargs)  # times them again, and keeps them
    assert check_rows(model, prompts, out, ids.shape[1], kwargs) == 0
    entry = runner.kept.entry
    retimed = json.loads(kept.read_text())[entry]
    assert entry == dropped[0] and set(retimed) == set(honest[entry]) and max(retimed.values()) < 100.0
    # a table the steps confirm stays: checked against steps that match it
    ms = runner.kept.table[4]
    runner.kept.check = cache_files.KeptCostCheck([4])
    for _ in range(cache_files.STALE_STEPS):
        runner._check_kept(4, ms)
    assert 4 not in runner.kept and runner.kept.table[4] == ms and json.loads(kept.read_text())[entry] == retimed
    batched.discard_batched_runners(base)


def test_weights_changed_in_place_are_never_verified_by_the_old_artifact(built, monkeypatch):
    """A compiled call, then a write through `.data` (no version bump, as a LoRA merge does): the next call gets no
    artifact of the old weights (it verifies eagerly while the new weights' build starts) and equals eager
    `generate()` of the changed base, which differs from the old base's."""
    from hf_bpd.runtime import background

    cache, _, _ = built
    base = saved_base(cache)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2).eval()
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(11))
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    before = base.generate(ids, **kw)
    assert torch.equal(model.generate(ids, compile=True, **kw), before)
    assert model.last_generation_stats.verifier == "artifact"
    old_key = artifacts.cached_key(base)
    with torch.no_grad():
        for layer in base.model.layers:
            layer.mlp.down_proj.weight.data.mul_(-3.0)
    started = []
    monkeypatch.setattr(background, "start_build", lambda base, key, directory, graph=artifacts.STEP:
                        started.append((key, graph)))
    after = base.generate(ids, **kw)
    assert not torch.equal(after, before)  # the change matters, so the old artifact would be caught
    assert torch.equal(model.generate(ids, compile=True, **kw), after)
    assert model.last_generation_stats.verifier != "artifact"
    assert started and started[0][0]["weights"] != old_key["weights"] and started[0][0] == artifacts.cached_key(base)


def test_bases_that_share_the_sampled_fingerprint_get_different_artifacts(built):
    """Every weight x (1 + 2^-20) keeps the bf16-rounded fingerprint (heads still belong to the base) but not the
    artifact's key, which is the weights' exact digest."""
    from hf_bpd import fingerprint

    cache, base, _ = built
    other = saved_base(cache)
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(1 + 2 ** -20)
    assert fingerprint(other) == fingerprint(base)
    assert artifacts.artifact_key(other, 1)["weights"] != artifacts.artifact_key(base, 1)["weights"]


@pytest.mark.parametrize("flaw", ["group-writable", "symlinked lock"])
def test_an_artifact_folder_others_could_write_is_not_used(built, flaw, tmp_path, monkeypatch):
    """A group-writable artifact folder, or a build lock that is a symbolic link: the artifact is not loaded (one
    warning), nothing is built there, and `generate(compile=True)` decodes eagerly, exact."""
    from hf_bpd.runtime import background

    cache, _, package = built
    directory = package.parent
    mode = directory.stat().st_mode
    lock = directory / artifacts.LOCK
    if flaw == "group-writable":
        directory.chmod(mode | 0o020)
    else:
        lock.unlink(missing_ok=True)
        lock.symlink_to(tmp_path / "elsewhere")
    monkeypatch.setattr(cache_files, "_DISTRUSTED", set())
    monkeypatch.setattr(background, "start_build", lambda *a, **k: pytest.fail("a build started in that folder"))
    try:
        base = saved_base(cache)
        model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2).eval()
        ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(12))
        kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
        with pytest.warns(UserWarning, match="no compiled step is used from") as caught:
            out = model.generate(ids, compile=True, **kw)
            again = model.generate(ids, compile=True, **kw)
        assert len([w for w in caught if "no compiled step" in str(w.message)]) == 1
        assert torch.equal(out, base.generate(ids, **kw)) and torch.equal(again, out)
        assert model.last_generation_stats.verifier != "artifact"
        with pytest.raises(OSError, match="not a cache folder of this user's"):
            artifacts.build(base, 1)
    finally:
        directory.chmod(mode)
        if lock.is_symlink():
            lock.unlink()
    assert artifacts.load(saved_base(cache), 1) is not None  # trusted again


def test_an_empty_cache_variable_is_unset_and_clear_removes_only_artifact_folders(tmp_path, monkeypatch):
    """`HF_BPD_CACHE=""` means the default cache, never the working directory; `--clear` removes only folders named
    like artifacts, and none that a build holds."""
    import fcntl

    from hf_bpd.cli import main
    from hf_bpd.hub.locate import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_BPD_CACHE", "")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "artifacts" / "0123456789abcdef0123").mkdir(parents=True)  # the working directory's own files
    assert cache_dir() == tmp_path / "home" / ".cache" / "hf_bpd"
    root = cache_dir() / "artifacts"
    for name in ("0123456789abcdef0123", "fedcba9876543210fedc", "notes"):
        (root / name).mkdir(parents=True)
    with artifacts.open_lock(root / "fedcba9876543210fedc") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a build under way
        assert main(["compile", "--clear"]) == 0
    assert (tmp_path / "artifacts" / "0123456789abcdef0123").is_dir()
    assert sorted(p.name for p in root.iterdir()) == ["fedcba9876543210fedc", "notes"]
    for name in ("kernels", "models", "kenlm"):
        (cache_dir() / name).mkdir()
    (cache_dir() / "gguf").symlink_to(tmp_path / "artifacts")  # a link is left alone, and so is what it points to
    assert main(["compile", "--all"]) == 2  # --all goes with --clear
    assert main(["compile", "--clear", "--all"]) == 0
    assert sorted(p.name for p in cache_dir().iterdir()) == ["artifacts", "gguf", "kenlm"]
    assert (tmp_path / "artifacts" / "0123456789abcdef0123").is_dir()
