"""Stronger drafts (issue 14): sequentially dependent (hydra) heads and soft-target training."""

import pytest
import torch

import hf_bpd
from hf_bpd import BlockwiseParallelForCausalLM, sparse_tree
from tests.conftest import ARCHS, VOCAB, tiny_base


def ids_batch(seed=0, size=(2, 14)):
    return torch.randint(3, VOCAB, size, generator=torch.Generator().manual_seed(seed))


def random_hydra(arch="llama", seed=0, num_heads=3, **kwargs):
    model = BlockwiseParallelForCausalLM.from_base(tiny_base(arch), num_heads=num_heads, head_type="hydra",
                                                   head_intermediate_size=48, **kwargs)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model.eval()


def test_fresh_hydra_heads_equal_base(arch):
    """Zero-initialised output side: a fresh hydra head predicts what the base's next-token head predicts."""
    base = tiny_base(arch)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=3, head_type="hydra", num_layers_per_head=2)
    ids = ids_batch()
    with torch.no_grad():
        out = model(ids)
        ref = base(ids).logits
    assert out.head_logits.shape == (2, 3, 14, VOCAB)
    for h in range(3):
        torch.testing.assert_close(out.head_logits[:, h], ref, rtol=1e-5, atol=1e-5)


def test_hydra_heads_read_the_previous_tokens():
    """Head i at position t reads token t + 1 + i: changing that token changes head i (and later heads) there,
    changing a token after it does not."""
    model = random_hydra()
    ids = ids_batch(1, (1, 14))
    with torch.no_grad():
        hidden = model(ids).last_hidden_state
        ref = model.heads(hidden, 3, tokens=ids)
        t = 4
        for i in range(3):
            changed = ids.clone()
            changed[0, t + 1 + i] = (changed[0, t + 1 + i] + 1) % VOCAB
            got = model.heads(hidden, 3, tokens=changed)
            for j in range(3):
                same = torch.allclose(got[0, j, t], ref[0, j, t])
                assert same == (j < i), (i, j)


def test_step_logits_are_the_teacher_forced_heads_on_their_own_drafts():
    """Drafting (each head reads the previous head's argmax) = the teacher-forced forward on the drafted tokens."""
    model = random_hydra(num_heads=3)
    ids = ids_batch(2, (1, 9))
    with torch.no_grad():
        hidden = model(ids).last_hidden_state[0, -1]
        next_token = 17
        step = model.heads.step_logits(hidden, 3, next_token)
        drafted = model.heads.to_vocab_ids(step.argmax(-1)).tolist()
        tokens = torch.tensor([[ids[0, -1].item(), next_token] + drafted])
        forced = model.heads(hidden[None, None], 3, tokens=tokens)[0, :, 0]
    torch.testing.assert_close(step, forced, rtol=1e-5, atol=1e-5)


def test_hydra_loss_is_the_teacher_forced_objective():
    """loss = sum_i CE(head i at t reading labels[t+1..t+1+i], labels[t+2+i]); positions reading a -100 skipped."""
    model = random_hydra(num_heads=3)
    ids = ids_batch(3)
    labels = ids.clone()
    labels[0, 5] = -100
    labels[1, :3] = -100
    with torch.no_grad():
        hidden = model(ids).last_hidden_state
        loss, losses = model.heads.loss(hidden, labels, [1.0, 1.0, 1.0])
        logits = model.heads(hidden, 3, tokens=labels)
    length = ids.shape[1]
    for i in range(3):
        shift = i + 2
        keep = torch.ones(2, length - shift, dtype=torch.bool)
        for j in range(1, shift + 1):  # the tokens read (t+1..t+1+i) and the target (t+2+i) are all labels
            keep &= labels[:, j: j + length - shift] != -100
        expected = torch.nn.functional.cross_entropy(logits[:, i, : length - shift][keep], labels[:, shift:][keep])
        torch.testing.assert_close(losses[i], expected)
    torch.testing.assert_close(loss, losses.sum())


@pytest.mark.parametrize("head_type", ["ffn", "hydra"])
def test_soft_targets_are_the_bases_distribution_at_the_target_position(head_type):
    """(1 - w) CE + w T^2 KL(base at t+1+i || head i at t), over the draft vocabulary, checked directly."""
    base = tiny_base("llama")
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2, head_type=head_type,
                                                   draft_vocab=list(range(0, VOCAB, 2)))
    with torch.no_grad():
        for p in model.heads.parameters():
            if p.is_floating_point():
                p.normal_(std=0.3)
    ids = ids_batch(4)
    labels = ids.clone()
    w, temperature = 0.7, 2.0
    with torch.no_grad():
        out = model(ids)
        hidden = out.last_hidden_state
        _, hard = model.heads.loss(hidden, labels, [1.0, 1.0])
        _, mixed = model.heads.loss(hidden, labels, [1.0, 1.0], soft_weight=w, temperature=temperature)
        logits = model.heads(hidden, 2, tokens=labels)
    vocab = model.heads.draft_vocab
    targets = model.heads.to_draft_ids(labels)
    length = ids.shape[1]
    for i in range(2):
        shift = i + 2
        keep = targets[:, shift:] != -100
        student = logits[:, i, : length - shift][keep]
        teacher = out.logits[:, i + 1: length - 1][keep][:, vocab]  # the base's logits at t + 1 + i
        kl = torch.nn.functional.kl_div((student / temperature).log_softmax(-1),
                                        (teacher / temperature).log_softmax(-1), log_target=True,
                                        reduction="batchmean")
        expected = (1 - w) * hard[i] + w * temperature ** 2 * kl
        torch.testing.assert_close(mixed[i], expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(mixed[i], hard[i])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["chain", "pbest", "tree", "lookup"])
def test_hydra_generate_equals_base_generate(arch, mode):
    model = random_hydra(arch, seed=5)
    options = {"chain": {}, "pbest": {"num_drafts": 3, "draft_top_k": 3}, "tree": {"tree": sparse_tree((3, 2, 2))},
               "lookup": {"prompt_lookup": True}}[mode]
    for seed, length in [(0, 3), (1, 11)]:
        ids = ids_batch(seed, (1, length))
        kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
        expected = model.base_lm.generate(ids, **kwargs)
        assert torch.equal(model.generate(ids, **options, **kwargs), expected), (arch, mode, seed)


def test_trained_hydra_heads_draft_accepted_blocks_and_round_trip(tmp_path):
    """Hydra heads trained on the base's own greedy text get their drafts accepted, and save/load keeps them."""
    torch.manual_seed(0)
    base = tiny_base("llama", seed=3)
    prompts = [ids_batch(s, (1, 4)) for s in range(24)]
    texts = [base.generate(p, max_new_tokens=24, do_sample=False, eos_token_id=None) for p in prompts]
    data = torch.cat(texts)
    model = BlockwiseParallelForCausalLM.from_base(base, num_heads=3, head_type="hydra", head_intermediate_size=64)
    model.freeze_base()
    labels = data.clone()
    labels[:, :4] = -100
    with torch.no_grad():
        hidden = model(data, return_head_logits=False).last_hidden_state
    optimizer = torch.optim.AdamW([p for p in model.heads.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(150):
        loss, _ = model.heads.loss(hidden, labels, [1.0, 1.0, 1.0], soft_weight=0.3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    efficiency = []
    for ids in prompts[:4]:
        assert torch.equal(model.generate(ids, **kwargs), base.generate(ids, **kwargs))
        efficiency.append(model.last_generation_stats.block_efficiency)
    assert sum(efficiency) / 4 > 1.5, efficiency  # measured 2.0 (untrained heads: ~1.0)
    ids = prompts[2]
    expected = base.generate(ids, **kwargs)
    model.generate(ids, **kwargs)
    model.save_pretrained(tmp_path / "hydra")
    loaded = BlockwiseParallelForCausalLM.from_pretrained(tmp_path / "hydra", base_model=base)
    assert loaded.config.head_type == "hydra"
    assert torch.equal(loaded.generate(ids, **kwargs), expected)
    assert loaded.last_generation_stats.block_efficiency == model.last_generation_stats.block_efficiency


def test_hydra_heads_need_tokens():
    model = random_hydra()
    hidden = torch.zeros(1, 3, model.config.hidden_size)
    with pytest.raises(ValueError, match="tokens="):
        model.heads(hidden, 2)
    with pytest.raises(ValueError, match="next_token="):
        model.heads.step_logits(hidden[0, 0], 2)
    assert "hydra" in hf_bpd.configuration.HEAD_TYPES
