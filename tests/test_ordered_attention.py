"""Half-precision bases: position-ordered attention makes a verification block round like one-token steps, so the
compiled default equals compiled plain decoding token for token (`hf_bpd.runtime.ordered_attention`)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from hf_bpd import BlockwiseParallelForCausalLM
from hf_bpd.generation.tree import DraftTree
from hf_bpd.runtime import compiled as verify_runtime
from hf_bpd.runtime.compiled_verifier import CompiledVerifier
from hf_bpd.runtime.ordered_attention import block_key_order, ordered_attention_forward, placed_key_order
from tests.test_decoding import prompt_ids, random_bpd

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _path(tree: DraftTree, row: int) -> list[int]:
    """Block slots of the root, `row`'s ancestors and `row` (block row `row` is node `row - 1`), in depth order."""
    path = [row]
    while path[-1] > 0:
        path.append(tree.parents[path[-1] - 1] + 1)
    return path[::-1]


def _block_attention(attend, q, k, v, past, tree: DraftTree):
    """A tree block's attention (root + `tree` after `past` cached slots) through `attend`, with the maps the
    compiled verifier builds (`block_key_order`, `placed_key_order`) and its position mask."""
    rows, slots = q.shape[2], k.shape[2]
    depths = torch.arange(rows)
    depths[:len(tree) + 1] = tree.block_depths()
    key_slots, key_ranks = placed_key_order(block_key_order(tree.parents, rows), past, slots, "cpu")
    open_ = torch.arange(slots)[None] <= (past + depths)[:, None]
    mask = torch.zeros(1, 1, rows, slots, dtype=q.dtype).masked_fill(~open_, torch.finfo(q.dtype).min)
    return attend(q, k, v, mask, key_slots, key_ranks), depths


def _lone_rows(attend, q, k, v, past, tree: DraftTree, depths):
    """Each tree row alone, as plain decoding computes it: one query at the row's position, its sequence (the cache,
    the root, its ancestors) in slots 0..position."""
    slots = k.shape[2]
    identity = torch.arange(slots)[None]
    for row in range(len(tree) + 1):
        chain = _path(tree, row)
        lone_k, lone_v = k.clone(), v.clone()
        lone_k[:, :, past:past + len(chain)] = k[:, :, [past + c for c in chain]]
        lone_v[:, :, past:past + len(chain)] = v[:, :, [past + c for c in chain]]
        mask = torch.zeros(1, 1, 1, slots, dtype=q.dtype)
        mask[..., past + int(depths[row]) + 1:] = torch.finfo(q.dtype).min
        yield row, attend(q[:, :, row:row + 1], lone_k, lone_v, mask, identity, identity)[0, 0]


def _ordered(q, k, v, mask, key_slots, key_ranks):
    return ordered_attention_forward(None, q, k, v, mask, key_slots=key_slots, key_ranks=key_ranks)[0]


# Siblings between ancestors leave gaps in slot order; 6 nodes + the root + 1 padding row: a compiled block of 8.
TREE = DraftTree([(5, 6), (8, 9, 1), (5, 10)])


def test_compiled_ordered_attention_rows_equal_one_token_steps_whatever_the_tree():
    """Each row of a tree block equals, bit for bit, a lone query at the row's position attending to its own sequence
    in slot order (what plain decoding computes), at SmolLM2's sizes (9 query heads over 3 key/value heads of 64,
    a 512-slot cache) on 2 threads; and it is attention (close to PyTorch's kernel). PyTorch's CPU kernel with the
    tree's mask fails the same comparison (measured: 12 of 140 rows over 20 draws), and so does the ordered attention
    run eagerly (MKL's GEMMs are not row-invariant): the property is the compiled step's."""
    from hf_bpd.runtime.compiled import _Patches

    torch._dynamo.reset()
    attend = torch.compile(_ordered, dynamic=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad(), _Patches(ordered=True):
            for trial in range(4):
                assert_tree_rows_equal_lone_rows(attend, trial)
    finally:
        torch.set_num_threads(threads)


def assert_tree_rows_equal_lone_rows(attend, trial: int) -> None:
    """A random tree block at SmolLM2's sizes (9 query heads over 3 key/value heads of 64, 512 slots) through
    `attend`: every row equals the lone query at its position bit for bit, and (trial 0) it is attention."""
    generator = torch.Generator().manual_seed(trial)
    past, slots = 237, 512
    q = torch.randn(1, 9, 8, 64, generator=generator).to(torch.bfloat16)
    k = (2 * torch.randn(1, 3, slots, 64, generator=generator)).to(torch.bfloat16)
    v = torch.randn(1, 3, slots, 64, generator=generator).to(torch.bfloat16)
    block, depths = _block_attention(attend, q, k, v, past, TREE)
    if trial == 0:
        allowed = torch.zeros(8, slots, dtype=torch.bool)
        allowed[:, :past + 8] = True
        allowed[:, past:past + 8] = torch.eye(8, dtype=torch.bool)
        allowed[:len(TREE) + 1, past:past + len(TREE) + 1] = TREE.ancestors_mask()
        mask = torch.zeros(1, 1, 8, slots).masked_fill(~allowed, float("-inf"))
        reference = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True).transpose(1, 2)
        rows = len(TREE) + 1  # (the padding row attends differently, and is never read)
        torch.testing.assert_close(block[:, :rows].float(), reference[:, :rows], atol=2e-2, rtol=2e-2)
    for row, lone in _lone_rows(attend, q, k, v, past, TREE, depths):
        assert torch.equal(lone, block[0, row]), (trial, row)


@pytest.fixture(scope="module")
def bf16_model(one_thread):
    model = copy.deepcopy(random_bpd("llama", 8)).to(torch.bfloat16)
    yield model
    verify_runtime.discard_runners(model.base_lm)
    torch._dynamo.reset()  # dynamo keeps at most MAX_COMPILED_SHAPES graphs of the step's code: leave room for others


def assert_tree_rows_equal_one_token_steps(model, runner, ids=None):
    """A compiled tree block's logits equal, bit for bit, the one-token compiled steps at the same positions (the
    tree's path decoded plainly), and so do the final hidden states, after the prompt `ids`."""
    ids = prompt_ids(3, 11) if ids is None else ids
    path = [7, 8, 9]
    tree = DraftTree([(20, 21), tuple(path), (7, 30)])
    with runner.lock, torch.no_grad():
        verifier = CompiledVerifier(model, runner)
        verifier.buckets = [1, 8]
        verifier.prefill(ids)
        block, block_hidden = verifier.verify(5, tree, "cpu")
        node, rows = -1, [0]
        for token in path:
            node = tree.children[node][token]
            rows.append(node + 1)
        verifier.close(10 ** 9)
        verifier = CompiledVerifier(model, runner)
        verifier.prefill(ids)
        for step, token in enumerate([5] + path):
            logits, hidden = verifier.verify(token, DraftTree([]), "cpu")
            assert torch.equal(logits[0], block[rows[step]]), step
            assert torch.equal(hidden[0], block_hidden[rows[step]]), step
            verifier.keep(1, [0])
        verifier.close(10 ** 9)


def test_compiled_bf16_block_rows_equal_one_token_steps(bf16_model):
    """The compiled step's logits for a tree block equal, bit for bit, the one-token compiled steps at the same
    positions (the tree's path decoded plainly)."""
    runner = verify_runtime.compiled_runner(bf16_model.base_lm, 64)
    assert runner.ordered
    assert_tree_rows_equal_one_token_steps(bf16_model, runner)


@pytest.fixture(scope="module")
def wide_bf16_model():
    """A four-layer bf16 Qwen2 as wide as Qwen2.5-1.5B (hidden size 1,536, q/k/v biases), run on two threads: there a
    one-token step's norm is long enough for inductor to split it over the threads (`inlining.SERIAL_LOOPS`)."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=1536, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=256)
    base = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # entries of many magnitudes, as a trained base's: a norm's fp32 sums then round
        embeddings = base.get_input_embeddings().weight
        embeddings.copy_(torch.randn(embeddings.shape) * torch.exp(2 * torch.randn(embeddings.shape)))
    model = BlockwiseParallelForCausalLM.from_base(base.to(torch.bfloat16), num_heads=3).eval()
    yield model
    verify_runtime.discard_runners(model.base_lm)
    torch._dynamo.reset()


def test_compiled_bf16_block_rows_equal_one_token_steps_on_two_threads(wide_bf16_model):
    """Rows of a wide base's block equal its one-token steps at many positions, on two threads (where inductor would
    otherwise split a one-token step's norm over the threads and sum it in another order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (this test only: the module's other tests run on one thread)
    try:
        runner = verify_runtime.compiled_runner(wide_bf16_model.base_lm, 64)
        for length in range(4, 20):  # (without `SERIAL_LOOPS` a row differed at length 15)
            assert_tree_rows_equal_one_token_steps(wide_bf16_model, runner, prompt_ids(length, length))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("options", [{}, {"tree": (2, 2, 1)}, {"num_drafts": 3, "draft_top_k": 2},
                                     {"num_drafts": 3, "draft_top_k": 2, "draft_nodes": 3, "prompt_lookup": True},
                                     {"num_drafts": 3, "draft_top_k": 2, "draft_nodes": 3, "prompt_lookup": True,
                                      "draft_schedule": "cost"}],
                         ids=["chain", "tree", "pbest", "nodes", "nodes-cost"])
def test_compiled_bf16_decoding_equals_compiled_plain_decoding(bf16_model, options):
    assert_drafting_equals_plain(bf16_model, options)


def assert_drafting_equals_plain(model, options: dict) -> None:
    """Compiled drafted decoding with `options` gives compiled plain decoding's tokens on three prompts."""
    kwargs = dict(do_sample=False, eos_token_id=None, compile=True)
    for seed in range(3):
        ids = prompt_ids(seed, 4 + 5 * seed)  # ids below the tiny vocabularies (96, 128)
        plain = model.generate(ids, use_heads=False, max_new_tokens=24, **kwargs)
        got = model.generate(ids, max_new_tokens=24, **options, **kwargs)
        assert torch.equal(got, plain), (options, seed)
        assert model.last_generation_stats.verifier == "compiled"


def test_half_precision_bases_off_the_kernels_compile_in_process_not_through_artifacts(bf16_model):
    """An artifact's attention reads only the used slots (its reductions regroup as the context grows), so
    half-precision bases off hf_bpd's kernels (head dim 8 here) compile in-process, and `hf-bpd compile` says so in
    one line (bases on the kernels get code-only artifacts: tests/test_ordered_artifacts.py)."""
    from hf_bpd.runtime import artifacts

    reason = artifacts.unsupported_reason(bf16_model.base_lm)
    assert reason is not None and "in-process" in reason and "\n" not in reason
    assert verify_runtime.compiled_runner(bf16_model.base_lm, 64).ordered
