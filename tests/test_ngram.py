"""Global n-gram rescoring: exact p-best search (Python and compiled) against brute force, KenLM model building,
errors, and end-to-end exactness of generate() with an NgramRescorer."""

import gzip
import itertools
import json
import random
import subprocess

import datasets
import kenlm
import pytest
import torch

import hf_bpd
from hf_bpd import BlockwiseParallelForCausalLM, BPDConfigError, HeadScoreRescorer, Lattice, NgramRescorer
from hf_bpd.rescorers import kenlm as bpd_kenlm
from hf_bpd.rescorers import ngram
from hf_bpd.rescorers.kenlm import KenLMNotFoundError, NgramError
from tests.conftest import VOCAB, tiny_base

V = 24  # synthetic corpus vocabulary: ids 0..V-1; larger ids are unseen (<unk>)
BACKENDS = ["python", "compiled"]


def markov_corpus(path, seed=0, sentences=400):
    """Token-id lines where `t` is mostly followed by `t + 1 (mod V)`: a corpus with real n-gram structure."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(sentences):
            t, line = rng.randrange(V), []
            for _ in range(rng.randint(3, 12)):
                line.append(t)
                t = (t + 1) % V if rng.random() < 0.7 else rng.randrange(V)
            f.write(" ".join(map(str, line)) + "\n")
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Order -> KenLM trie binary of the Markov corpus."""
    root = tmp_path_factory.mktemp("ngram")
    corpus = markov_corpus(root / "ids.txt")
    return {order: bpd_kenlm.build_ngram_from_ids(corpus, root / f"m{order}.bin", order, memory="50M",
                                              discount_fallback=True) for order in (2, 3, 4)}


@pytest.fixture(scope="module")
def model_kinds(tmp_path_factory, models):
    """The order-4 model as each kind of KenLM file the compiled path dispatches on."""
    root = tmp_path_factory.mktemp("kinds")
    corpus = markov_corpus(root / "ids.txt")
    kinds = {"trie": models[4]}
    kinds["probing"] = bpd_kenlm.build_ngram_from_ids(corpus, root / "probing.bin", 4, memory="50M",
                                                  discount_fallback=True, binary_type="probing")
    kinds["quantized"] = bpd_kenlm.build_ngram_from_ids(corpus, root / "quantized.bin", 4, memory="50M",
                                                    discount_fallback=True, quantize=8)
    subprocess.run([bpd_kenlm.kenlm_binary("lmplz"), "-o", "4", "-S", "50M", "--discount_fallback", "--text", corpus,
                    "--arpa", root / "model.arpa"], check=True, capture_output=True)
    kinds["arpa"] = root / "model.arpa"
    return kinds


def rescorer(path, backend, **kwargs):
    if backend == "compiled":
        assert bpd_kenlm.load_fast_path() is not None, "the compiled n-gram rescorer is not built: run bash install.sh"
    return NgramRescorer(path, backend=backend, **kwargs)


def random_lattice(rng, h, k, unseen=4):
    """`(h, k)` lattice of distinct ids per head (some unseen by the n-gram), random log-probabilities best first."""
    tokens = torch.tensor([rng.sample(range(V + unseen), k) for _ in range(h)])
    logits = torch.tensor([[rng.gauss(0, 2) for _ in range(k)] for _ in range(h)])
    return Lattice(tokens, torch.log_softmax(logits, -1).sort(-1, descending=True).values)


def brute_force(model, lattice, context, weights, p, order):
    """Score every one of the k^h paths with KenLM from scratch (histories of order-1 tokens) and sort."""
    keep = order - 1
    tokens, logprobs = lattice.tokens.tolist(), lattice.logprobs.double().tolist()

    def state_of(tail):
        state = kenlm.State()
        model.NullContextWrite(state)
        for t in tail:
            following = kenlm.State()
            model.BaseScore(state, str(t), following)
            state = following
        return state

    paths = []
    for ranks in itertools.product(range(lattice.k), repeat=lattice.num_heads):
        history, score = list(context), 0.0
        for i, r in enumerate(ranks):
            state = state_of(history[max(len(history) - keep, 0):] if keep else [])
            score += logprobs[i][r] + weights[i] * model.BaseScore(state, str(tokens[i][r]), kenlm.State())
            history.append(tokens[i][r])
        paths.append((-score, ranks))
    paths.sort()
    return [(lattice.path_tokens(ranks), -neg) for neg, ranks in paths[:p]]


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("backend", BACKENDS)
def test_pbest_equals_brute_force(models, backend):
    rng = random.Random(1)
    reference = {order: kenlm.Model(str(path)) for order, path in models.items()}
    for trial in range(210):
        model_order = 2 + trial % 3
        order = rng.choice([model_order] * 3 + list(range(1, model_order)))  # sometimes a lower order
        alpha = rng.choice([0.0, 0.3, 1.0, 2.5])
        lattice = random_lattice(rng, rng.randint(1, 4), rng.randint(1, 4))
        context = [rng.randrange(V + 2) for _ in range(rng.randint(0, 6))]
        p = rng.randint(1, 8)
        scorer = rescorer(models[model_order], backend, alpha=alpha, order=order,
                          entropy_adaptive=rng.random() < 0.3)
        drafts = scorer.rescore(lattice, context, p)
        expected = brute_force(reference[model_order], lattice, context, scorer.head_weights(lattice), p, order)
        assert [d.tokens for d in drafts] == [t for t, _ in expected], (trial, order, alpha, p)
        assert [d.score for d in drafts] == pytest.approx([s for _, s in expected], abs=1e-9)


def test_compiled_bounds_drop_no_path(models):
    """The compiled search skips partial paths that cannot reach the p best (a floor from the lattice cut to 4 ranks,
    and the last head's bucket): on lattices wider than that cut, with tied scores, it still equals brute force."""
    rng = random.Random(4)
    reference = {order: kenlm.Model(str(path)) for order, path in models.items()}
    for trial in range(120):
        model_order = 2 + trial % 3
        h, k = rng.randint(2, 3), rng.randint(5, 7)
        lattice = random_lattice(rng, h, k)
        if trial % 3 == 0:  # ties everywhere: equal head scores (and alpha 0 below: equal totals)
            lattice = Lattice(lattice.tokens, torch.full((h, k), -1.5))
        alpha = 0.0 if trial % 6 == 0 else rng.choice([0.3, 1.0, 2.5])
        context = [rng.randrange(V + 2) for _ in range(rng.randint(0, 4))]
        p = rng.randint(1, 12)
        scorer = rescorer(models[model_order], "compiled", alpha=alpha)
        drafts = scorer.rescore(lattice, context, p)
        expected = brute_force(reference[model_order], lattice, context, scorer.head_weights(lattice), p, model_order)
        assert [d.tokens for d in drafts] == [t for t, _ in expected], (trial, alpha, p)
        assert [d.score for d in drafts] == pytest.approx([s for _, s in expected], abs=1e-9)


@pytest.mark.parametrize("kind", ["trie", "probing", "quantized", "arpa"])
def test_compiled_equals_python_on_large_lattices(model_kinds, kind):
    rng = random.Random(2)
    fast = rescorer(model_kinds[kind], "compiled")
    slow = rescorer(model_kinds[kind], "python")
    for trial in range(8):
        lattice = random_lattice(rng, 8, 8, unseen=8)
        context = [rng.randrange(V) for _ in range(5)]
        fast.alpha = slow.alpha = rng.choice([0.5, 1.0, 3.0])
        fast.entropy_adaptive = slow.entropy_adaptive = trial % 2 == 1
        drafts = fast.rescore(lattice, context, 16)
        assert len(drafts) == 16 and drafts == slow.rescore(lattice, context, 16)  # bit-identical scores


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_are_broken_by_rank_vector(models, backend):
    lattice = Lattice(torch.tensor([[3, 4, 5], [6, 7, 8]]), torch.zeros(2, 3))
    drafts = rescorer(models[3], backend, alpha=0.0).rescore(lattice, [1, 2], 9)
    assert [d.tokens for d in drafts] == [lattice.path_tokens(r) for r in itertools.product(range(3), repeat=2)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unseen_ids_score_as_unk(models, backend):
    model = kenlm.Model(str(models[3]))
    state, unk = kenlm.State(), kenlm.State()
    model.NullContextWrite(state)
    for t in (5, 6):
        following = kenlm.State()
        model.BaseScore(state, str(t), following)
        state = following
    unk_log10 = model.BaseScore(state, "<unk>", unk)
    lattice = Lattice(torch.tensor([[10_000, 99_999]]), torch.tensor([[-0.5, -0.7]]))
    drafts = rescorer(models[3], backend, alpha=2.0).rescore(lattice, [5, 6], 2)
    assert [d.tokens for d in drafts] == [(10_000,), (99_999,)]
    assert drafts[0].score == pytest.approx(-0.5 + 2.0 * ngram.LN10 * unk_log10)
    assert drafts[1].score - drafts[0].score == pytest.approx(-0.2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alpha_zero_is_the_head_ranking(models, backend):
    rng = random.Random(3)
    for _ in range(20):
        lattice = random_lattice(rng, rng.randint(1, 5), rng.randint(1, 5))
        p = rng.randint(1, 10)
        drafts = rescorer(models[4], backend, alpha=0.0).rescore(lattice, [1, 2, 3], p)
        heads = lattice.best_paths(p)
        assert [d.tokens for d in drafts] == [d.tokens for d in heads]
        assert [d.score for d in drafts] == pytest.approx([d.score for d in heads])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rescoring_repairs_a_repetition(models, backend):
    # The base's next token is 5; the heads are one step late ("the the ..."): top-1 drafts 5 6 7, repeating 5.
    # The corpus follows t by t + 1, so the n-gram prefers the fluent 6 7 8, which is in the lattice.
    lattice = Lattice(torch.tensor([[5, 6], [6, 7], [7, 8]]), torch.log(torch.tensor([[0.6, 0.4]] * 3)))
    context = [2, 3, 4, 5]
    assert HeadScoreRescorer().rescore(lattice, context, 1)[0].tokens == (5, 6, 7)
    drafts = rescorer(models[3], backend, alpha=1.0).rescore(lattice, context, 2)
    assert drafts[0].tokens == (6, 7, 8)
    assert drafts[0].tokens[0] != context[-1]


def test_entropy_adaptive_weights(models):
    flat, peaked = [0.25] * 4, [0.97, 0.01, 0.01, 0.01]
    lattice = Lattice(torch.arange(8).view(2, 4), torch.log(torch.tensor([flat, peaked])))
    weights = NgramRescorer(models[2], alpha=2.0, entropy_adaptive=True, backend="python").head_weights(lattice)
    entropies = [-sum(q * torch.log(torch.tensor(q)).item() for q in row) for row in (flat, peaked)]
    mean = sum(entropies) / 2
    assert weights == pytest.approx([2.0 * ngram.LN10 * e / mean for e in entropies])
    assert weights[0] > 2.0 * ngram.LN10 > weights[1]  # the uncertain head leans on the n-gram more
    one_best = Lattice(torch.arange(2).view(2, 1), torch.zeros(2, 1))  # k = 1: no entropy, plain alpha
    assert NgramRescorer(models[2], alpha=2.0, entropy_adaptive=True).head_weights(one_best) == \
        pytest.approx([2.0 * ngram.LN10] * 2)


# ------------------------------------------------------------------ building models
@pytest.fixture(scope="module")
def tokenizer():
    return hf_bpd.load_tokenizer("smollm2-135m-instruct")


SENTENCES = ["The cat sat on the mat.", "The dog sat on the rug.", "A cat and a dog sat on the mat together.",
             "The cat likes the mat.", "The dog likes the rug."]


def test_build_ngram_with_the_smollm2_tokenizer(tmp_path, tokenizer):
    text = tmp_path / "wiki.txt.gz"
    with gzip.open(text, "wt") as f:
        for i in range(20):
            f.write(f'<doc id="{i}" url="x" title="t">\n\n' + "\n".join(SENTENCES) + "\n</doc>\n")
    path = bpd_kenlm.build_ngram(text, tokenizer, tmp_path / "lm.bin", order=3, discount_fallback=True,
                             strip_wiki_markup=True, memory="50M", progress=False)
    scorer = NgramRescorer(path, alpha=1.0)
    assert scorer.model_order == 3
    # Lattice: each head's top-1 is a wrong word; the true sentence is each head's second choice.
    ids = tokenizer("The cat sat on the mat.", add_special_tokens=False)["input_ids"]
    decoys = tokenizer(" rug likes together A dog", add_special_tokens=False)["input_ids"]
    truth = ids[1:]
    tokens = torch.tensor([[decoys[i % len(decoys)], t] for i, t in enumerate(truth)])
    lattice = Lattice(tokens, torch.log(torch.tensor([[0.55, 0.45]] * len(truth))))
    assert scorer.rescore(lattice, ids[:1], 1)[0].tokens == tuple(truth)
    assert NgramRescorer(path, alpha=1.0, backend="python").rescore(lattice, ids[:1], 3) == \
        scorer.rescore(lattice, ids[:1], 3)


def test_token_id_files_from_text_json_and_datasets(tmp_path, tokenizer):
    text = tmp_path / "a.txt"
    text.write_text('<doc id="1">\nHello world.\n\n   \nSecond line here.\n</doc>\nThird.\n')
    out = tmp_path / "ids.txt"
    assert bpd_kenlm.write_token_ids(text, tokenizer, out, strip_wiki_markup=True, progress=False)[0] == 3
    first = out.read_text().splitlines()[0]
    assert first == " ".join(map(str, tokenizer("Hello world.", add_special_tokens=False)["input_ids"]))
    assert bpd_kenlm.write_token_ids([text], tokenizer, out, max_lines=2, progress=False)[0] == 2
    records = tmp_path / "b.jsonl"
    records.write_text("".join(json.dumps({"content": s}) + "\n" for s in SENTENCES))
    assert bpd_kenlm.write_token_ids(records, tokenizer, out, json_field="content", progress=False)[0] == 5
    dataset = datasets.Dataset.from_dict({"text": SENTENCES})
    lines, tokens = bpd_kenlm.write_token_ids(dataset, tokenizer, out, progress=False)
    assert lines == 5 and tokens == sum(len(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in SENTENCES)


def test_cli_builds_a_quantized_model(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(SENTENCES * 20) + "\n")
    out = tmp_path / "q.bin"
    assert bpd_kenlm.cli_build_ngram(["--text", str(text), "--order", "2", "--memory", "50M", "--discount-fallback",
                                  "--quantize", "8", "--output", str(out)]) == 0
    assert NgramRescorer(out).model_order == 2
    assert bpd_kenlm.cli_build_ngram(["--text", str(tmp_path / "missing.txt"), "--output", str(out)]) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("build_ngram: error: no text file")


# ------------------------------------------------------------------ errors
def one_line(excinfo, fragment):
    message = str(excinfo.value)
    assert "\n" not in message and fragment in message, message


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_and_corrupt_models(tmp_path, models, backend):
    with pytest.raises(NgramError) as err:
        rescorer(tmp_path / "nope.bin", backend)
    one_line(err, "build one with hf_bpd.build_ngram")
    junk = tmp_path / "junk.bin"
    data = models[3].read_bytes()
    for content in (b"", b"\x00\x01garbage" * 100, b"\\data\\\nngram 1=5\n", data[: len(data) // 2]):
        junk.write_bytes(content)
        with pytest.raises(NgramError) as err:
            rescorer(junk, backend)
        one_line(err, "is not a KenLM model")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [({"alpha": -0.1}, "alpha"), ({"alpha": float("nan")}, "alpha"), ({"alpha": "1"}, "alpha"),
     ({"order": 0}, "order must be an integer in [1, 3]"), ({"order": 4}, "[1, 3]"), ({"order": 2.0}, "order"),
     ({"backend": "gpu"}, "backend")],
)
def test_bad_rescorer_arguments(models, kwargs, fragment):
    with pytest.raises(BPDConfigError) as err:
        NgramRescorer(models[3], **kwargs)
    one_line(err, fragment)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p", [0, -1, True, 1.5])
def test_bad_num_drafts(models, backend, p):
    lattice = Lattice(torch.tensor([[1, 2]]), torch.tensor([[-0.1, -2.0]]))
    with pytest.raises(BPDConfigError) as err:
        rescorer(models[2], backend).rescore(lattice, [1], p)
    one_line(err, "num_drafts must be an integer >= 1")


def test_missing_kenlm_programs(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("HF_BPD_KENLM_BIN", str(tmp_path))
    with pytest.raises(KenLMNotFoundError) as err:
        bpd_kenlm.build_ngram(datasets.Dataset.from_dict({"text": SENTENCES}), tokenizer, tmp_path / "x.bin")
    one_line(err, "lmplz is not in HF_BPD_KENLM_BIN")
    assert "install.sh" in str(err.value)
    monkeypatch.delenv("HF_BPD_KENLM_BIN")
    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(KenLMNotFoundError) as err:
        bpd_kenlm.kenlm_binary("build_binary")
    one_line(err, "run `bash install.sh`")


def test_bad_build_inputs(tmp_path, tokenizer):
    dataset = datasets.Dataset.from_dict({"text": SENTENCES})
    with pytest.raises(BPDConfigError) as err:
        bpd_kenlm.build_ngram(dataset, tokenizer, tmp_path / "x.bin", order=6)
    one_line(err, "order must be an integer in [2, 5]")
    with pytest.raises(NgramError) as err:
        bpd_kenlm.build_ngram(tmp_path / "missing.txt", tokenizer, tmp_path / "x.bin")
    one_line(err, "no text file")
    with pytest.raises(NgramError) as err:
        bpd_kenlm.build_ngram(datasets.Dataset.from_dict({"text": ["one two three four"] * 3}), tokenizer,
                          tmp_path / "x.bin", order=3, memory="50M", progress=False)
    one_line(err, "pass discount_fallback=True")
    with pytest.raises(NgramError) as err:
        bpd_kenlm.build_ngram(datasets.Dataset.from_dict({"text": ["", "  "]}), tokenizer, tmp_path / "x.bin",
                          progress=False)
    one_line(err, "the input is empty")
    assert not (tmp_path / "x.bin").exists()


def test_python_fallback_warns_once(models, tmp_path, monkeypatch):
    monkeypatch.setattr(bpd_kenlm, "_library", None)
    monkeypatch.setattr(ngram, "_warned_python", False)
    monkeypatch.setattr(bpd_kenlm, "fast_path_file", lambda: tmp_path / "absent.so")
    with pytest.raises(KenLMNotFoundError) as err:
        NgramRescorer(models[2], backend="compiled")
    one_line(err, "install.sh")
    with pytest.warns(UserWarning, match="pure-Python"):
        assert NgramRescorer(models[2]).backend == "python"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert NgramRescorer(models[2]).backend == "python"


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def bpd_and_ngram(tmp_path_factory):
    """A tiny random Llama with random heads, and a 3-gram over the base's own greedy continuations (ids < 96)."""
    model = BlockwiseParallelForCausalLM.from_base(tiny_base("llama"), num_heads=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    model.eval()
    root = tmp_path_factory.mktemp("e2e")
    with open(root / "ids.txt", "w") as f:
        for seed in range(40):
            prompt = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(seed))
            out = model.base_lm.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
            f.write(" ".join(map(str, out[0].tolist())) + "\n")
    return model, bpd_kenlm.build_ngram_from_ids(root / "ids.txt", root / "lm.bin", 3, memory="50M",
                                             discount_fallback=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_drafts", [1, 4, 16])
def test_generate_with_ngram_rescoring_equals_greedy(bpd_and_ngram, backend, num_drafts):
    model, path = bpd_and_ngram
    scorer = rescorer(path, backend, alpha=1.0)
    for seed in range(100, 106):
        prompt = torch.randint(3, VOCAB, (1, 3 + seed % 7), generator=torch.Generator().manual_seed(seed))
        kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
        expected = model.base_lm.generate(prompt, **kwargs)
        out = model.generate(prompt, rescorer=scorer, num_drafts=num_drafts, draft_top_k=4, **kwargs)
        assert torch.equal(out, expected), seed
        stats = model.last_generation_stats
        assert stats.method == ("chain" if num_drafts == 1 else "p-best") and sum(stats.draft_tokens) > 0
