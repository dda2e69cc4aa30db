"""Local neural rescoring (Algorithm 2)."""

import random

import pytest
import torch

from hf_bpd import BlockwiseParallelForCausalLM, BPDConfigError, Lattice
from hf_bpd.rescorers.neural import NeuralRescorer
from tests.conftest import ARCHS, VOCAB, tiny_base
from tests.test_decoding import prompt_ids, random_bpd


def random_lattice(rng: random.Random, h: int, k: int) -> Lattice:
    tokens = torch.tensor([rng.sample(range(VOCAB), k) for _ in range(h)])
    logprobs = torch.tensor([sorted((-rng.random() * 4 for _ in range(k)), reverse=True) for _ in range(h)])
    return Lattice(tokens, logprobs)


def naive_rescore(lm, lattice, context, alpha):
    """Algorithm 2 recomputed from scratch for every row: full forward, no cache, full vocabulary."""
    chosen = []
    for i in range(lattice.num_heads):
        with torch.no_grad():
            logits = lm(torch.tensor([context + chosen])).logits[0, -1].float()
        combined = lattice.logprobs[i] + alpha * logits[lattice.tokens[i]]
        chosen.append(int(lattice.tokens[i, int(combined.argmax())]))
    return tuple(chosen)


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_rescoring_equals_naive_recomputation(arch):
    lm = tiny_base(arch, seed=5)
    rescorer = NeuralRescorer(lm, alpha=1.5)
    rng = random.Random(arch)
    context = [rng.randrange(3, VOCAB) for _ in range(5)]
    for _ in range(25):  # a decoding-like sequence of calls: the context grows by accepted tokens + one token
        lattice = random_lattice(rng, h=rng.randint(1, 4), k=rng.randint(1, 5))
        draft = rescorer.rescore(lattice, context, 1)[0].tokens
        assert draft == naive_rescore(lm, lattice, context, 1.5)
        accepted = rng.randint(0, len(draft))
        context = context + list(draft[:accepted]) + [rng.randrange(3, VOCAB)]
        if rng.random() < 0.15:  # occasionally a context unrelated to the cache
            context = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 8))]


def test_alpha_zero_is_the_heads_top1():
    rescorer = NeuralRescorer(tiny_base("llama"), alpha=0.0)
    rng = random.Random(0)
    for _ in range(20):
        lattice = random_lattice(rng, 3, 4)
        assert rescorer.rescore(lattice, [5, 6, 7], 1)[0].tokens == tuple(lattice.tokens[:, 0].tolist())


def test_rescoring_fixes_a_repetition():
    """Heads propose "X X"; a rescorer LM that finds the repeat unlikely picks the fluent alternative Y."""
    lm = tiny_base("gpt2")
    X, Y, A = 10, 20, 30
    with torch.no_grad():  # every position's hidden state is b: the LM's preferences are fixed and known
        b = torch.linspace(-1, 1, lm.config.n_embd)
        lm.transformer.ln_f.weight.zero_()
        lm.transformer.ln_f.bias.copy_(b)
        lm.lm_head.weight.zero_()
        lm.lm_head.weight[Y] = 3 * b / b.dot(b)  # logit 3
        lm.lm_head.weight[X] = -3 * b / b.dot(b)  # logit -3
        lm.lm_head.weight[A] = -3 * b / b.dot(b)
    lattice = Lattice(torch.tensor([[X, A], [X, Y]]), torch.tensor([[-0.1, -2.5], [-0.2, -1.9]]))
    assert tuple(lattice.tokens[:, 0].tolist()) == (X, X)  # vanilla BPD drafts the repetition
    rescored = NeuralRescorer(lm, alpha=1.0).rescore(lattice, [1, 2, X], 1)[0].tokens
    assert rescored == (X, Y)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_drafts", [1, 4, 16])
def test_generate_with_neural_rescorer_is_exact(arch, num_drafts):
    model = random_bpd(arch, 4)
    rescorer = NeuralRescorer(tiny_base(arch, seed=9), alpha=0.75)
    for seed in range(3):
        ids = prompt_ids(seed, 4 + 3 * seed)
        kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
        expected = model.base_lm.generate(ids, **kwargs)
        got = model.generate(ids, rescorer=rescorer, num_drafts=num_drafts, draft_top_k=4, **kwargs)
        assert torch.equal(got, expected)


def test_bad_neural_rescorer_input():
    with pytest.raises(BPDConfigError, match="alpha must be >= 0"):
        NeuralRescorer(tiny_base("llama"), alpha=-0.5)
    other = BlockwiseParallelForCausalLM.from_base(tiny_base("qwen2"), num_heads=2)
    wrong_vocab = type(tiny_base("llama").config)(vocab_size=VOCAB + 4, hidden_size=16, intermediate_size=32,
                                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    from transformers import AutoModelForCausalLM

    rescorer = NeuralRescorer(AutoModelForCausalLM.from_config(wrong_vocab))
    with pytest.raises(BPDConfigError, match=r"vocabulary \(100 tokens\) differs from the base model's \(96\)") as err:
        other.generate(prompt_ids(0, 4), rescorer=rescorer, max_new_tokens=3)
    assert "\n" not in str(err.value)


def test_bundled_neural_rescorers_round_trip(tmp_path, tiny_base_dir):
    """A checkpoint bundles a neural rescorer (a full small LM, or a LoRA over the base's first layers)."""
    from peft import LoraConfig, get_peft_model

    from hf_bpd.rescorers.neural import truncated_base

    base = BlockwiseParallelForCausalLM.from_base(str(tiny_base_dir), num_heads=2).base_lm
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2)
    prefix = get_peft_model(truncated_base(base, 1), LoraConfig(r=2, target_modules="all-linear"))
    prefix.save_pretrained(tmp_path / "prefix-adapter")
    model.bundle_rescorer("neural", tmp_path / "prefix-adapter", alpha=0.5, type="base_prefix", num_layers=1)
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "rescorers" / "prefix-adapter" / "adapter_config.json").exists()

    loaded = BlockwiseParallelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert all(p.is_leaf for p in loaded.base_lm.parameters())  # deriving the rescorer leaves the base untouched
    assert loaded.config.rescorers["neural"] == {"path": "rescorers/prefix-adapter", "alpha": 0.5,
                                                 "type": "base_prefix", "num_layers": 1}
    assert loaded.bundled_rescorers["neural"].alpha == 0.5
    ids = prompt_ids(2, 6)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(loaded.generate(ids, rescorer="neural", draft_top_k=3, **kwargs),
                       loaded.base_lm.generate(ids, **kwargs))
