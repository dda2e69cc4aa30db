"""Memory-mapped weights handed back to the page cache (`hf_bpd.runtime.page_cache`): resident pages go, values
stay, anonymous memory is never touched; a bf16 base of an offline alias loads from its bf16 copy, mapped, and its
int8 weights (`Int8WeightsConfig`) are saved once beside it, then mapped."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_bpd.runtime import page_cache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise: Linux only")

MB = 1 << 20


def _rss_file_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no RssFile in /proc/self/status")


def _mapped(path: Path, megabytes: int) -> torch.Tensor:
    """A bf16 tensor over a file of `megabytes`, mapped privately (as transformers maps safetensors)."""
    values = torch.arange(megabytes * MB // 2, dtype=torch.float32).remainder(1000).to(torch.bfloat16)
    path.write_bytes(values.view(torch.uint8).numpy().tobytes())
    return torch.from_file(str(path), shared=False, size=megabytes * MB // 2, dtype=torch.bfloat16)


def test_release_drops_a_mapped_tensors_pages_and_keeps_its_values(tmp_path):
    weight = _mapped(tmp_path / "w.bin", 64)
    if not page_cache.file_mappings():
        pytest.skip("no file mappings listed")
    total = float(weight.float().sum())  # read every page
    before = _rss_file_mb()
    advised = page_cache.release([weight])
    assert advised >= 60 * MB
    after = _rss_file_mb()
    assert before - after > 40, (before, after)  # the kernel dropped (most of) them
    assert float(weight.float().sum()) == total  # read again from the file, unchanged
    weight[0] = 7.0  # a written page becomes private to this process: released, it keeps its value
    page_cache.release([weight])
    assert float(weight[0]) == 7.0


def test_release_leaves_anonymous_memory_alone():
    weight = torch.randn(4 * MB, dtype=torch.bfloat16)
    copy = weight.clone()
    assert page_cache.release([weight, weight[::2], torch.empty(0)]) == 0
    assert torch.equal(weight, copy)


def test_a_bf16_alias_loads_mapped_from_its_bf16_copy():
    import hf_bpd
    from hf_bpd.hub.base_models import PACKAGED_MODELS, resolve_base_path

    alias = "smollm2-135m-instruct"
    try:
        PACKAGED_MODELS[alias].gguf()
    except Exception as error:  # noqa: BLE001 - the package is an install.sh step
        pytest.skip(f"{alias} not installed: {error}")
    bf16 = hf_bpd.load_base_model(alias, dtype=torch.bfloat16)
    fp32 = hf_bpd.load_base_model(alias, dtype=torch.float32)
    assert Path(resolve_base_path(alias, dtype=torch.bfloat16)).name == "bf16"
    assert bf16.config.name_or_path == alias
    for (name, a), (_, b) in zip(bf16.state_dict().items(), fp32.state_dict().items()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16)), name  # what converting gives
    weight = bf16.get_output_embeddings().weight
    ranges = page_cache.file_mappings()
    assert any(start <= weight.data_ptr() < end for start, end in ranges)  # on disk until read


def test_a_bf16_copy_that_cannot_be_saved_falls_back_to_converting(monkeypatch):
    from hf_bpd.hub import base_models

    alias = "smollm2-135m-instruct"
    fp32 = base_models.cache_dir() / "models" / alias
    if not (fp32 / "config.json").exists():
        pytest.skip(f"{alias} not converted into the cache")
    monkeypatch.setattr(base_models, "_bf16_copy", lambda source: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.warns(UserWarning, match="could not save .*bf16 copy.*No space left"):
        path = base_models.resolve_base_path(alias, dtype=torch.bfloat16)
    assert Path(path) == fp32


def test_an_aliass_int8_weights_are_saved_once_then_mapped():
    import hf_bpd
    from hf_bpd.hub import base_models
    from hf_bpd.runtime.int8_weights import Int8WeightLinear, quantize_int8_weights, saved_int8_file

    alias = "smollm2-135m-instruct"
    try:
        base_models.PACKAGED_MODELS[alias].gguf()
    except Exception as error:  # noqa: BLE001 - the package is an install.sh step
        pytest.skip(f"{alias} not installed: {error}")
    config = hf_bpd.Int8WeightsConfig()
    saved = saved_int8_file(base_models.resolve_base_path(alias, dtype=torch.bfloat16), config)
    saved.unlink(missing_ok=True)
    first = hf_bpd.load_base_model(alias, dtype=torch.bfloat16, quantization_config=config)  # quantizes, saves
    assert saved.is_file()
    second = hf_bpd.load_base_model(alias, dtype=torch.bfloat16, quantization_config=config)  # maps the file
    plain = hf_bpd.load_base_model(alias, dtype=torch.bfloat16)
    quantize_int8_weights(plain, config)  # in memory, no file
    ranges = page_cache.file_mappings()
    layers = [(n, m) for n, m in second.named_modules() if isinstance(m, Int8WeightLinear)]
    assert len(layers) == 30 * 7 + 1
    for name, layer in layers:
        for other in (first, plain):
            twin = other.get_submodule(name)
            assert torch.equal(layer.weight, twin.weight) and torch.equal(layer.weight_scale, twin.weight_scale), name
        assert any(start <= layer.weight.data_ptr() < end for start, end in ranges), name  # on disk until read
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(second(ids).logits, plain(ids).logits)
    # a file that holds other layers (another base's, a different quantizer's) is replaced, not read
    save_file({"elsewhere.weight": torch.zeros(2, dtype=torch.int8)}, str(saved))
    third = hf_bpd.load_base_model(alias, dtype=torch.bfloat16, quantization_config=config)
    assert torch.equal(third.get_submodule(layers[0][0]).weight, layers[0][1].weight)
    assert f"{layers[0][0]}.weight" in load_file(str(saved))
