"""Lossless sampling: BPD sampling draws from exactly the base model's distribution (chi-square tests).

A tiny Llama with a 5-token vocabulary and random heads (drafts are accepted and rejected). The exact distribution
of the first three sampled tokens is computed from the base's logits; 3,000 BPD samples must fit it (enough to tell
the base at temperature 1.0 from 0.7: the power check below)."""

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_bpd import BlockwiseParallelForCausalLM, sparse_tree
from hf_bpd.feature_drafter import FeatureDrafter

V, NEW, N = 5, 3, 3000
PROMPT = torch.tensor([[1, 3, 0, 2]])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    base = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # spread the logits so that every outcome is reasonably likely
        base.lm_head.weight.mul_(8.0)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    drafter = FeatureDrafter(base)  # a random feature-level drafter too (drafter="feature")
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    folder = tmp_path_factory.mktemp("feature-drafter")
    drafter.save(folder, dtype=None)
    model.load_feature_drafter(folder)
    yield model.eval()
    torch.set_num_threads(threads)


def exact_joint(base, temperature):
    """P(x1, x2, x3 | prompt) under temperature sampling, from the base's logits."""
    outcomes = list(itertools.product(range(V), repeat=NEW))
    seqs = torch.cat([PROMPT.repeat(len(outcomes), 1), torch.tensor(outcomes)], dim=1)
    with torch.no_grad():
        logits = base(seqs).logits[:, PROMPT.shape[1] - 1: -1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(outcomes)[..., None])[..., 0].sum(-1)
    return {o: float(p) for o, p in zip(outcomes, logp.exp())}


def sample_counts(generate):
    torch.manual_seed(1234)
    counts = {}
    for _ in range(N):
        out = tuple(generate()[0, PROMPT.shape[1]:].tolist())
        counts[out] = counts.get(out, 0) + 1
    return counts


def chi2_pvalue(counts, probs, group=lambda o: o):
    """Chi-square goodness of fit over the outcome groups; groups expected < 5 times in as many draws as `counts`
    holds are pooled."""
    draws = sum(counts.values())
    expected, observed = {}, {}
    for o, p in probs.items():
        g = group(o)
        expected[g] = expected.get(g, 0.0) + p * draws
        observed[g] = observed.get(g, 0) + counts.get(o, 0)
    small = [g for g in expected if expected[g] < 5]
    exp = [expected[g] for g in expected if g not in small] + [sum(expected[g] for g in small)]
    obs = [observed[g] for g in expected if g not in small] + [sum(observed[g] for g in small)]
    if not small:
        exp, obs = exp[:-1], obs[:-1]
    scale = sum(obs) / sum(exp)  # the exact probabilities sum to 1 only up to float rounding
    return chisquare(obs, [e * scale for e in exp]).pvalue


MODES = {"chain": {}, "tree": {"tree": sparse_tree((3, 2))}, "pbest": {"num_drafts": 3, "draft_top_k": 3},
         # the shipped default's shape: p-best paths and prompt lookup's copy competing for a node budget
         "nodes": {"num_drafts": 3, "draft_top_k": 3, "draft_nodes": 3, "prompt_lookup": True},
         # the feature-level drafter's chain and prompt lookup's copy
         "feature": {"drafter": "feature", "draft_depth": 2, "prompt_lookup": True}}


# every mode once, the temperatures alternating between them (a temperature is one logits processor for all modes)
@pytest.mark.parametrize("mode, temperature", [(mode, (0.7, 1.0)[i % 2]) for i, mode in enumerate(sorted(MODES))])
def test_bpd_sampling_matches_the_base_distribution(model, mode, temperature):
    probs = exact_joint(model.base_lm, temperature)
    counts = sample_counts(lambda: model.generate(PROMPT, do_sample=True, temperature=temperature, top_k=0,
                                                  max_new_tokens=NEW, **MODES[mode]))
    for name, group in [("next token", lambda o: o[:1]), ("two tokens", lambda o: o[:2]),
                        ("tokens 2-3 (drafted)", lambda o: o[1:]), ("three tokens", lambda o: o)]:
        p = chi2_pvalue(counts, probs, group)
        assert p > 1e-3, f"{mode} T={temperature}: {name} distribution differs from the base (p={p:.2e})"


@pytest.mark.parametrize("mode", ["chain", "feature"])
def test_drafts_are_really_accepted_while_sampling(model, mode):
    """The heads' (and the feature-level drafter's) drafts are accepted often enough that the test above exercises
    acceptance and rejection."""
    torch.manual_seed(0)
    accepted = rejected = 0
    for _ in range(200):
        model.generate(PROMPT, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=NEW, **MODES[mode])
        steps = model.last_generation_stats.accepted_lengths[1:]
        accepted += sum(1 for a in steps if a > 0)
        rejected += sum(1 for a in steps if a == 0)
    assert accepted > 20 and rejected > 20


def test_chi_square_detects_a_slightly_wrong_temperature(model):
    """Power check: N draws from the base's exact T=1.0 distribution are rejected against the T=0.7 one (and N draws
    from the T=0.7 one are not: the check is not rejecting everything)."""
    wanted = exact_joint(model.base_lm, 0.7)
    for probs, rejected in ((exact_joint(model.base_lm, 1.0), True), (wanted, False)):
        outcomes = list(probs)
        torch.manual_seed(1234)
        draws = torch.multinomial(torch.tensor([probs[o] for o in outcomes]), N, replacement=True).tolist()
        counts = Counter(outcomes[i] for i in draws)
        assert (chi2_pvalue(counts, wanted) < 1e-6) == rejected, rejected
