"""Section 6 analyses: known answers on constructed drafts, entropies and lattices, then on tiny models."""

import math

import pytest
import torch

from hf_bpd import BlockwiseParallelForCausalLM, Lattice, Rescorer
from hf_bpd.evaluation.analysis import (
    accepted_length,
    analyze_prompt,
    consecutive_repetition,
    entropy,
    h_max,
    has_repetition,
    markdown_tables,
    max_run,
    oracle_accepted,
    plot_analysis,
    simulated_block_efficiency,
    simulated_steps,
    summarize,
    summarize_by_category,
    wins_ties_losses,
)
from hf_bpd.lattice import Draft
from tests.conftest import VOCAB, tiny_base


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ repetition (Table 3)
def test_max_run_and_repetition():
    assert max_run([]) == 0
    assert max_run([5]) == 1
    assert max_run([1, 2, 3]) == 1
    assert max_run([1, 1, 2, 2, 2, 3]) == 3
    assert max_run([7, 7, 7, 7]) == 4
    assert not has_repetition([1, 2, 1, 2]) and has_repetition([1, 2, 2])


def test_consecutive_repetition_known_rate():
    # 6 pairs, 2 of them repeated (1-1 and 1-1 in the first block): 33.3 %; max runs 3 and 1: mean 2
    stats = consecutive_repetition([[1, 1, 1, 2], [3, 4, 5, 6]])
    assert stats["pairs"] == 6 and stats["repeated_pairs"] == 2 and stats["blocks"] == 2
    assert stats["consec_pct"] == pytest.approx(100 / 3)
    assert stats["mean_max_run"] == pytest.approx(2.0)
    # a fully repeated block of 5 tokens: every pair repeats, max run = the block length
    full = consecutive_repetition([[9] * 5])
    assert full["consec_pct"] == 100.0 and full["mean_max_run"] == 5.0
    assert consecutive_repetition([])["consec_pct"] == 0.0


# ------------------------------------------------------------------ entropy and h_max (Fig. 3)
def test_entropy_known_values():
    logits = torch.tensor([
        [0.0] * 8,                       # uniform over 8: log 8
        [0.0, 0.0] + [-1e9] * 6,         # two equal tokens: log 2
        [50.0] + [0.0] * 7,              # one-hot: ~0
    ])
    got = entropy(logits)
    torch.testing.assert_close(got, torch.tensor([math.log(8), math.log(2), 0.0]), atol=1e-5, rtol=0)
    assert (entropy(torch.randn(4, 3, 50)) >= 0).all()


@pytest.mark.parametrize("means, expected", [
    ([1.0, 2.0, 3.0], 3),          # rises all the way
    ([1.0, 2.0, 1.5, 4.0], 2),     # drops after head 2
    ([3.0, 2.0, 1.0], 1),          # never rises
    ([1.0, 1.0, 2.0], 3),          # ties count as non-decreasing (the paper's <=)
    ([2.0], 1),
    ([], 0),
])
def test_h_max(means, expected):
    assert h_max(means) == expected


# ------------------------------------------------------------------ oracle top-k (Fig. 6)
def lattice_with_ranks():
    """3 heads x top-3; the reference [10, 20, 30] sits at ranks 0, 2, 1."""
    tokens = torch.tensor([[10, 11, 12], [21, 22, 20], [31, 30, 32]])
    logprobs = torch.tensor([[-0.1, -1.0, -2.0]] * 3)
    return Lattice(tokens, logprobs)


def test_oracle_accepted_as_a_function_of_k():
    lattice = lattice_with_ranks()
    assert oracle_accepted(lattice, [10, 20, 30], [1, 2, 3]) == {1: 1, 2: 1, 3: 3}
    # a token outside every top-k stops the path there
    assert oracle_accepted(lattice, [10, 99, 30], [1, 3]) == {1: 1, 3: 1}
    assert oracle_accepted(lattice, [99, 20, 30], [3]) == {3: 0}
    # k beyond the lattice width uses the whole lattice; a short reference caps the path
    assert oracle_accepted(lattice, [10, 20], [8]) == {8: 2}


def test_accepted_length():
    assert accepted_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted_length([1, 5, 3], [1, 2, 3]) == 1
    assert accepted_length([4], [1]) == 0
    assert accepted_length([1, 2, 3], [1]) == 1


@pytest.mark.parametrize("n, a", [(10, 0), (10, 2), (25, 3), (1, 4), (7, 9)])
def test_simulated_block_efficiency_with_constant_acceptance(n, a):
    # prompt pass: 1 token; then every call decodes a + 1 (the last one capped by the remaining tokens)
    expected = n / (1 + math.ceil((n - 1) / (a + 1)))
    assert simulated_block_efficiency([a] * n) == pytest.approx(expected)


def test_simulated_steps_follow_the_acceptances():
    # token 0 from the prompt pass; step after token 0 accepts 2 -> tokens 1..3; step after token 3 accepts 0 -> 4
    accepted = [2, 9, 9, 0, 1, 0]
    assert simulated_steps(accepted) == [0, 3, 4]
    assert simulated_block_efficiency(accepted) == pytest.approx(6 / 4)
    assert simulated_block_efficiency([]) == 0.0


# ------------------------------------------------------------------ wins / ties / losses (Table 5)
def test_wins_ties_losses_with_repair_and_regress():
    vanilla_acc = [0, 1, 2, 2, 3]
    rescored_acc = [2, 1, 3, 0, 1]
    vanilla_blocks = [[1, 5, 5], [1, 2, 3], [4, 6, 6], [1, 2, 3], [7, 8, 9]]
    rescored_blocks = [[1, 5, 6], [1, 2, 3], [4, 6, 6], [1, 1, 3], [7, 8, 8]]
    out = wins_ties_losses(vanilla_acc, rescored_acc, vanilla_blocks, rescored_blocks)
    assert out["ties"] == 1
    # wins: step 0 (repair: vanilla repeats, rescored does not) and step 2 (both repeat: neither)
    assert out["win"]["total"] == 2 and out["win"]["repair"] == 1 and out["win"]["regress"] == 0
    assert out["win"]["repair_pct"] == 50.0
    # losses: steps 3 and 4, both introduce a repetition
    assert out["loss"]["total"] == 2 and out["loss"]["regress"] == 2 and out["loss"]["regress_pct"] == 100.0
    with pytest.raises(ValueError):
        wins_ties_losses([1], [1, 2], [[1]], [[1]])


# ------------------------------------------------------------------ collected from models
def constant_gpt2():
    """Every hidden state is the final LayerNorm's bias: the base always predicts one token c, and fresh
    (identity) heads predict c too. The greedy continuation is c c c ..., every draft is accepted whole."""
    base = tiny_base("gpt2")
    with torch.no_grad():
        base.transformer.ln_f.weight.zero_()
        base.transformer.ln_f.bias.copy_(torch.linspace(-1, 1, base.config.n_embd))
    return base


@pytest.mark.parametrize("h", [1, 3])
def test_heads_that_copy_the_base(h):
    model = BlockwiseParallelForCausalLM.from_base(constant_gpt2(), num_heads=h).eval()
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    n = 17
    record = analyze_prompt(model, ids, n, top_ks=(1, 4))
    c = record.new_tokens[0]
    assert record.new_tokens == [c] * n
    assert len(record.vanilla_accepted) == n - 1
    assert all(d == [c] * h for d in record.vanilla_drafts)
    assert record.vanilla_accepted[0] == h and record.vanilla_accepted[-1] == 1  # capped by the end
    summary = summarize([record])
    expected = n / (1 + math.ceil((n - 1) / (h + 1)))
    assert summary["vanilla"]["block_efficiency"] == pytest.approx(expected)
    assert summary["oracle_block_efficiency"] == {"1": pytest.approx(expected), "4": pytest.approx(expected)}
    # blocks [c] * (h + 1): everything repeats
    assert summary["vanilla"]["repetition"]["consec_pct"] == 100.0
    assert summary["vanilla"]["repetition"]["mean_max_run"] == h + 1
    # heads are the base's own head: equal entropies, which rise (weakly) through every head
    means = summary["entropy"]["mean"]
    assert len(means) == h + 1 and max(means) - min(means) < 1e-4
    assert summary["entropy"]["h_max"] == h + 1
    # the same decode through generate() has that block efficiency
    model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
    assert model.last_generation_stats.block_efficiency == pytest.approx(expected)


class ReferenceRescorer(Rescorer):
    """Knows the greedy continuation: returns the lattice's oracle path (padded with the top-1 tokens)."""

    def __init__(self, sequence):
        self.sequence = sequence
        self.resets = 0

    def reset(self):
        self.resets += 1

    def rescore(self, lattice, context, num_drafts):
        truth = self.sequence[len(context): len(context) + lattice.num_heads]
        path = list(lattice.oracle_path(truth))
        path += [int(lattice.tokens[i, 0]) for i in range(len(path), lattice.num_heads)]
        return [Draft(tuple(path), 0.0)]


def random_heads_model(seed=0, num_heads=3):
    model = BlockwiseParallelForCausalLM.from_base(tiny_base("llama"), num_heads=num_heads)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model.eval()


def test_random_heads_against_generate_and_an_oracle_rescorer(tmp_path):
    model = random_heads_model()
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    n = 30
    sequence = model.base_lm.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
    rescorer = ReferenceRescorer(sequence[0].tolist())
    record = analyze_prompt(model, ids, n, top_ks=(1, 2, 4, 8), rescorer=rescorer, rescore_top_k=4,
                            reference=sequence, prompt_id="p", category="cat")
    assert rescorer.resets == 1
    # vanilla drafts are the heads' argmax, as generate() drafts them: same simulated block efficiency
    model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
    summary = summarize([record])
    assert summary["vanilla"]["block_efficiency"] == pytest.approx(model.last_generation_stats.block_efficiency)
    oracle = summary["oracle_block_efficiency"]
    assert oracle["1"] == pytest.approx(summary["vanilla"]["block_efficiency"])
    assert oracle["1"] <= oracle["2"] <= oracle["4"] <= oracle["8"]
    # the reference rescorer reaches the k=4 oracle at every step, so it never loses to vanilla
    assert record.rescored_accepted == record.oracle[4]
    assert summary["rescored"]["block_efficiency"] == pytest.approx(oracle["4"])
    assert summary["wins_ties_losses"]["loss"]["total"] == 0
    assert summary["wins_ties_losses"]["win"]["total"] + summary["wins_ties_losses"]["ties"] == n - 1
    # the base's entropy column is the entropy of the base's own next-token distribution
    with torch.no_grad():
        logits = model.base_lm(sequence).logits[0, ids.shape[1] - 1]
    assert record.entropies[0][0] == pytest.approx(float(entropy(logits)), rel=1e-4)

    by_category = summarize_by_category([record, record.__class__(**{**record.__dict__, "category": "other"})])
    assert set(by_category) == {"all", "cat", "other"}
    text = markdown_tables(by_category, "oracle")
    assert "Table 3" in text and "oracle k=8" in text and "Table 5" in text and "| cat |" in text
    written = plot_analysis([record], by_category, tmp_path / "plots")
    assert sorted(p.rsplit("/", 1)[-1] for p in written) == ["entropy.png", "oracle_topk.png"]
    assert all((tmp_path / "plots" / name).stat().st_size > 1000 for name in ("entropy.png", "oracle_topk.png"))
    assert record.as_dict()["oracle"]["4"] == record.oracle[4]


def test_one_token_continuation_has_no_steps():
    model = random_heads_model()
    ids = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(1))
    record = analyze_prompt(model, ids, 1)
    assert len(record.new_tokens) == 1 and record.vanilla_accepted == [] and record.entropies == []
    assert summarize([record])["vanilla"]["block_efficiency"] == 1.0
