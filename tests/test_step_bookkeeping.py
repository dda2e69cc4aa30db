"""The lean step's bookkeeping gives exactly what the general code gives: the greedy walk read in place
(`GreedyRows`, `walk_greedy`) against `walk`, the usual stopping criteria checked on token ids (`StopGuard`) against
calling them, the compiled verifier's in-place attention mask against one built from scratch, and a compiled call
whose last block ends at the static cache's end."""

import random

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation import (EosTokenCriteria, MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList,
                                     StopStringCriteria)

from hf_bpd.generation.stopping import StopGuard
from hf_bpd.generation.tree import DraftTree, GreedyRows, walk, walk_greedy
from hf_bpd.runtime.compiled import CACHE_BUCKET
from hf_bpd.runtime.compiled_verifier import CompiledVerifier
from tests.conftest import VOCAB


def random_tree(rng, vocab, max_nodes=7):
    drafts = [tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 4))]
    tree = DraftTree(drafts)
    while len(tree) > max_nodes:
        drafts = drafts[:-1]
        tree = DraftTree(drafts)
    return tree


def test_the_greedy_walk_read_in_place_equals_walk():
    rng = random.Random(0)
    vocab = 50
    for trial in range(300):
        tree = random_tree(rng, vocab)
        logits = torch.randn(len(tree) + 1, vocab, generator=torch.Generator().manual_seed(trial))
        if trial % 3 == 0:  # make the base agree with the tree along some path
            node, row = -1, 0
            while tree.children[node]:
                token = rng.choice(list(tree.children[node]))
                logits[row, token] = logits[row].max() + 1.0
                node = tree.children[node][token]
                row = node + 1
        if trial % 5 == 0:  # exact ties: the first of equal maxima wins, as in torch.argmax
            logits[0, 7] = logits[0, 3] = logits[0].max() + 2.0
        sequence = torch.tensor([[1, 2, 3]])
        tokens, path, position, step_logits, step_scores = walk(tree, logits, sequence, LogitsProcessorList(), False)
        rows = GreedyRows(logits)
        fast_tokens, fast_path, fast_position, visited = walk_greedy(tree, rows)
        assert (fast_tokens, fast_path, fast_position) == (tokens, path, position), trial
        assert visited == [0] + [c + 1 for c in path]
        for row, token, scores in zip(visited, fast_tokens, step_scores):
            top = scores[0].topk(2).values
            assert rows.top(row, token) == (float(top[0]), float(top[0] - top[1]))  # the referee's margin, bit for bit
        if trial % 5 == 0:
            assert rows.top(0, tokens[0])[1] == 0.0


def test_greedy_rows_off_the_numpy_path_agree():
    """A tensor NumPy cannot view (here float64) takes the one-transfer path: the same choices."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    fast, other = GreedyRows(logits), GreedyRows(logits.double())
    assert other.array is None
    for row in range(6):
        token = fast.choice(row)
        assert token == other.choice(row) == int(logits[row].argmax())
        assert fast.top(row, token) == pytest.approx(other.top(row, token))


class _EveryThird(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] % 3 == 0 and input_ids.shape[1] > 12)


@pytest.mark.parametrize("kind", ["simple", "eos-list", "custom"])
def test_stop_guard_on_token_ids_equals_calling_the_criteria(kind):
    rng = random.Random(1)
    for trial in range(200):
        prompt = rng.randint(1, 6)
        sequence = torch.tensor([[rng.randrange(12) for _ in range(prompt + rng.randint(0, 30))]])
        criteria = [MaxLengthCriteria(rng.randint(prompt + 1, prompt + 35))]
        if kind == "simple":
            criteria.append(EosTokenCriteria(rng.randrange(12)))
        elif kind == "eos-list":
            criteria.append(EosTokenCriteria(torch.tensor([rng.randrange(12), rng.randrange(12)])))
        else:
            criteria.append(_EveryThird())
        fast, slow = StopGuard(StoppingCriteriaList(criteria), prompt), StopGuard(StoppingCriteriaList(criteria),
                                                                                   prompt)
        assert fast.simple == (kind != "custom")
        slow.simple = False
        at = prompt
        while at < sequence.shape[1]:  # grow the sequence by steps of 1-4 tokens, as decoding does
            step = rng.randint(1, 4)
            prefix = sequence[:, : at + step]
            new = prefix[0, at:].tolist()
            assert fast.first_stop(prefix, new) == slow.first_stop(prefix), (kind, trial, at)
            at += step


def test_stop_strings_use_the_general_check():
    import hf_bpd

    tokenizer = hf_bpd.load_tokenizer("smollm2-135m-instruct")
    guard = StopGuard(StoppingCriteriaList([MaxLengthCriteria(20), StopStringCriteria(tokenizer, ["stop"])]), 1)
    assert not guard.simple


class _Runner:  # the attributes of a `CompiledRunner` the mask reads (no compiled step is needed for the mask)
    max_cache_len = 64
    cache = None
    ordered = False  # a float32 base: slot-order masks


class _Model:
    class base_lm:  # noqa: N801
        dtype = torch.float32


def reference_mask(tree: DraftTree, past: int, b: int, length: int) -> torch.Tensor:
    """The mask built from scratch (what the verifier built before it kept its buffers)."""
    q = len(tree) + 1
    allowed = torch.zeros(b, length, dtype=torch.bool)
    allowed[:, :past] = True
    allowed[:q, past: past + q] = tree.ancestors_mask()
    pad = torch.arange(q, b)
    allowed[pad, past + pad] = True
    mask = torch.zeros(b, length)
    mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


def test_the_in_place_attention_mask_equals_one_built_from_scratch():
    rng = random.Random(2)
    verifier = CompiledVerifier(_Model(), _Runner())
    past = rng.randint(0, 5)
    for step in range(60):
        tree = random_tree(rng, 9)
        b = 8 if step % 7 else 5
        if len(tree) + 1 > b:
            continue
        depths, block, _ = verifier._block_pattern(tree, b, "cpu")
        mask = verifier._mask(b, past, block, "cpu")
        assert torch.equal(mask, reference_mask(tree, past, b, _Runner.max_cache_len)), step
        expected_depths = torch.arange(b)
        expected_depths[: len(tree) + 1] = tree.block_depths()
        assert torch.equal(depths, expected_depths)
        # the next step starts after the accepted path (0 .. the tree's depth), sometimes over again (a new call)
        past = rng.randint(0, 5) if step % 13 == 12 else past + 1 + rng.randint(0, max(tree.depths, default=0))
        past = min(past, _Runner.max_cache_len - 8)


def test_a_compiled_call_that_ends_at_the_cache_end_is_exact(one_thread):
    """The last step's block is padded past the sequence's end: a sequence that fills the static cache's bucket
    (prompt + max_new_tokens = CACHE_BUCKET) used to write beyond it."""
    from tests.test_decoding import random_bpd

    model = random_bpd("llama", 2)
    ids = torch.randint(3, VOCAB, (1, CACHE_BUCKET - 9), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=9, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(ids, compile=True, **kwargs), model.base_lm.generate(ids, **kwargs))
