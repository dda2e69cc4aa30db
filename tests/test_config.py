import json

import pytest

from hf_bpd import BlockwiseParallelConfig, BPDConfigError
from tests.conftest import TINY_CONFIGS


def test_defaults_and_block_size():
    config = BlockwiseParallelConfig(num_heads=3, text_config=TINY_CONFIGS["llama"]())
    assert config.block_size == 4
    assert config.head_loss_weights == [1.0, 1.0, 1.0]
    assert config.hidden_size == 32 and config.vocab_size == 96
    assert config.draft_vocab_size is None and config.draft_size == 96


def test_json_round_trip(tmp_path):
    config = BlockwiseParallelConfig(
        num_heads=2, head_type="ffn", draft_vocab=[3, 5, 7], text_config=TINY_CONFIGS["qwen2"](),
        base_model_name_or_path="some/base", base_model_fingerprint="sha256:abc",
    )
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["model_type"] == "blockwise_parallel"
    assert data["text_config"]["model_type"] == "qwen2"
    assert "draft_vocab" not in data and data["draft_vocab_size"] == 3  # the ids are stored with the heads
    loaded = BlockwiseParallelConfig.from_pretrained(tmp_path)
    assert loaded.draft_vocab is None and loaded.draft_vocab_size == 3 and loaded.draft_size == 3
    assert loaded.head_type == "ffn"
    assert loaded.text_config.model_type == "qwen2"
    assert loaded.base_model_fingerprint == "sha256:abc"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"num_heads": 0}, "num_heads must be an integer >= 1"),
        ({"num_heads": -2}, "num_heads must be an integer >= 1"),
        ({"head_type": "transformer"}, "unknown head_type 'transformer': use one of ffn, resblock"),
        ({"num_layers_per_head": 0}, "num_layers_per_head"),
        ({"draft_vocab": [1, 2, 96]}, "outside the base vocabulary [0, 96)"),
        ({"draft_vocab": [-1, 2]}, "outside the base vocabulary"),
        ({"draft_vocab": []}, "draft_vocab is empty"),
        ({"draft_vocab": [4, 4]}, "repeated token ids"),
        ({"num_heads": 2, "head_loss_weights": [1.0]}, "head_loss_weights must hold 2"),
        ({"draft_vocab_size": 97}, "draft_vocab_size must be an integer in [1, 96]"),
        ({"draft_vocab": [1, 2], "draft_vocab_size": 3}, "draft_vocab_size=3 but draft_vocab holds 2"),
        ({"rescorers": {"trigram": {"path": "x.bin"}}}, "bad bundled rescorer 'trigram'"),
    ],
)
def test_bad_config_is_one_line_error(kwargs, fragment):
    with pytest.raises(BPDConfigError) as info:
        BlockwiseParallelConfig(text_config=TINY_CONFIGS["llama"](), **kwargs)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_bad_config_on_load(tmp_path):
    """A config file edited into an invalid state is rejected when loaded, not at first use."""
    BlockwiseParallelConfig(num_heads=2, text_config=TINY_CONFIGS["llama"]()).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["head_type"] = "mlp"
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(BPDConfigError, match="unknown head_type 'mlp'"):
        BlockwiseParallelConfig.from_pretrained(tmp_path)


def test_old_decoding_fields_are_not_config_fields(tmp_path):
    """Decoding settings moved to generation_config.json: old config.json values are kept aside for loading."""
    config = BlockwiseParallelConfig(text_config=TINY_CONFIGS["llama"](), rescorer="ngram", num_drafts=2,
                                     draft_top_k=8, rescorer_alpha=0.5)
    assert config.legacy_generation_options == {"rescorer": "ngram", "num_drafts": 2, "draft_top_k": 8}
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert not {"rescorer", "num_drafts", "draft_top_k", "rescorer_alpha", "legacy_generation_options"} & set(data)
