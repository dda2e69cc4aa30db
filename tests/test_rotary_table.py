"""Rotary embeddings from a table (`hf_bpd.runtime.rotary_table`): the table's rows are the module's own outputs, and
only modules whose outputs depend on the position alone are replaced."""

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hf_bpd.runtime.rotary_table import RotaryTable, table_rotary_embeddings, tabled


def _rotary(**fields) -> LlamaRotaryEmbedding:
    return LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=1024,
                                            **fields))


def test_a_table_gives_the_module_s_outputs_in_every_dtype():
    rotary = _rotary()
    table = tabled(rotary, 1024)
    positions = torch.tensor([[0, 1, 2, 511, 1023], [5, 5, 6, 7, 8]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.zeros(1, dtype=dtype)
        for got, want in zip(table(x, positions), rotary(x, positions)):
            assert got.dtype == want.dtype == dtype and torch.equal(got, want)


def test_only_position_only_rotaries_of_bounded_size_are_replaced():
    assert tabled(_rotary(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 1024) is None  # depends on length
    assert tabled(_rotary(), 10**7) is None  # over MAX_TABLE_BYTES
    assert tabled(torch.nn.Linear(2, 2), 16) is None

    class WithLayerType(LlamaRotaryEmbedding):  # Gemma 3's signature: a layer type picks the frequencies
        def forward(self, x, position_ids, layer_type=None):
            return super().forward(x, position_ids)

    assert tabled(WithLayerType(LlamaConfig(hidden_size=64, num_attention_heads=4)), 16) is None
    model = torch.nn.Module()
    model.rotary_emb = _rotary()
    assert table_rotary_embeddings(model, 64) == 1 and isinstance(model.rotary_emb, RotaryTable)
