"""Devices, dtypes and loading options: `from_pretrained(..., dtype=, device_map=, attn_implementation=,
quantization_config=)`, `--device`/`--dtype` on the command line, and exactness against the base in the same dtype.

In bf16 a block verification and the base's one-token steps round differently, so where the base's two best logits
are within bf16's resolution of each other the two can pick different tokens (measured here: 2 of 96 generations of
random tiny models, both at such a near-tie). The tests allow exactly that and nothing else: a generation may only
leave the base's output at a step whose top-2 margin is within `TIE` of the base's own logits.
CUDA tests are skipped without a GPU.
"""

import copy
import subprocess
import sys

import pytest
import torch

from hf_bpd import BaseModelError, BlockwiseParallelForCausalLM
from tests.conftest import ARCHS, differs_at_a_near_tie, tiny_base
from tests.test_decoding import MODES, prompt_ids, random_bpd

TIE = 0.02  # |top1 - top2| <= TIE * max(1, |top1|): bf16 keeps 8 significant bits (2**-7 = 0.0078 relative)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def compare_with_base(model, prompts, options, max_new_tokens=30) -> tuple[int, int]:
    """Generate with the heads and with the base (same dtype and device); every difference must start at a base
    near-tie. Returns (generations, generations that differ)."""
    differ = 0
    for ids in prompts:
        ids = ids.to(model.device)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
        alone = model.base_lm.generate(ids, **kwargs, output_scores=True, return_dict_in_generate=True)
        got = model.generate(ids, **options, **kwargs)[0, ids.shape[1]:]
        differ += differs_at_a_near_tie(got, alone, ids.shape[1], TIE, f"{options}")
    return len(prompts), differ


def test_bf16_on_cpu_is_the_bf16_base_output():
    total = differ = 0
    for arch in ARCHS:
        model = copy.deepcopy(random_bpd(arch, 1)).to(torch.bfloat16)
        assert {p.dtype for p in model.heads.parameters()} == {torch.bfloat16}
        for mode, options in MODES.items():
            n, d = compare_with_base(model, [prompt_ids(seed, 5 + 3 * seed) for seed in range(6)], options)
            total, differ = total + n, differ + d
    assert differ <= total // 20, f"{differ} of {total} bf16 generations left the base's output"


def test_from_pretrained_passes_loading_options_to_the_base(tmp_path):
    base_dir, ckpt = tmp_path / "base", tmp_path / "heads"
    tiny_base("llama").save_pretrained(base_dir)
    BlockwiseParallelForCausalLM.from_base(str(base_dir), num_heads=2).save_pretrained(ckpt)

    model = BlockwiseParallelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cpu",
                                                         attn_implementation="eager")
    assert model.base_lm.dtype == torch.bfloat16 and model.base_lm.device.type == "cpu"
    assert model.base_lm.config._attn_implementation == "eager"
    assert {p.dtype for p in model.heads.parameters()} == {torch.bfloat16}
    compare_with_base(model, [prompt_ids(3, 7)], {})

    legacy = BlockwiseParallelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.bfloat16)  # transformers' old name
    assert legacy.base_lm.dtype == torch.bfloat16
    assert BlockwiseParallelForCausalLM.from_pretrained(ckpt, dtype="auto").base_lm.dtype == torch.float32

    with pytest.raises(BaseModelError, match="when the base is loaded by name"):
        BlockwiseParallelForCausalLM.from_pretrained(ckpt, base_model=tiny_base("llama"), device_map="cpu")


def test_a_checkpoint_recording_bf16_loads_its_base_in_bf16_where_the_kernels_run_it(tmp_path):
    """Without `dtype`, the base loads in the dtype the checkpoint's config records (as transformers' `dtype="auto"`
    reads a config's) where hf_bpd's kernels run it, else in float32; an explicit `dtype` wins."""
    import json

    from hf_bpd.runtime.kernels import kernels_unsupported_reason

    base_dir, ckpt = tmp_path / "base", tmp_path / "heads"
    tiny_base("llama").save_pretrained(base_dir)
    BlockwiseParallelForCausalLM.from_base(str(base_dir), num_heads=2).save_pretrained(ckpt)
    assert BlockwiseParallelForCausalLM.from_pretrained(ckpt).base_lm.dtype == torch.float32  # records none
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    expected = torch.bfloat16 if kernels_unsupported_reason() is None else torch.float32
    model = BlockwiseParallelForCausalLM.from_pretrained(ckpt)
    assert model.base_lm.dtype == expected and {p.dtype for p in model.heads.parameters()} == {expected}
    assert BlockwiseParallelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).base_lm.dtype == torch.float32


def test_quantized_base_keeps_fp32_heads_and_exact_output(tmp_path):
    """A real int8 weight-quantized base (optimum-quanto through transformers' QuantoConfig, CPU): the base's linear
    layers are quantized, its output layer and the heads stay fp32, and the output is the quantized base's own."""
    pytest.importorskip("optimum.quanto")
    from transformers import QuantoConfig

    base_dir, ckpt = tmp_path / "base", tmp_path / "heads"
    tiny_base("llama").save_pretrained(base_dir)
    trained = copy.deepcopy(random_bpd("llama", 2))
    trained.config.base_model_name_or_path = str(base_dir)
    trained.save_pretrained(ckpt)

    model = BlockwiseParallelForCausalLM.from_pretrained(ckpt, quantization_config=QuantoConfig(weights="int8"))
    assert type(model.base_lm.model.layers[0].mlp.up_proj).__name__ == "QLinear"
    assert {p.dtype for p in model.heads.parameters()} == {torch.float32}
    total, differ = 0, 0
    for options in MODES.values():
        n, d = compare_with_base(model, [prompt_ids(seed, 6 + seed) for seed in range(4)], options)
        total, differ = total + n, differ + d
    assert differ <= total // 10
    assert model.last_generation_stats.serial_calls > 0


def test_quantized_base_loads_its_bundled_base_prefix_rescorer(tmp_path):
    """The bundled neural rescorer reuses the base's first layers: on an int8-weight base it is derived from their
    dequantized weights (it loads, and decoding with it stays the quantized base's own output)."""
    pytest.importorskip("optimum.quanto")
    from peft import LoraConfig, get_peft_model
    from transformers import QuantoConfig

    from hf_bpd.rescorers.neural import truncated_base

    base_dir, ckpt = tmp_path / "base", tmp_path / "heads"
    tiny_base("llama").save_pretrained(base_dir)
    trained = copy.deepcopy(random_bpd("llama", 2))
    trained.config.base_model_name_or_path = str(base_dir)
    prefix = get_peft_model(truncated_base(trained.base_lm, 1), LoraConfig(r=2, target_modules="all-linear"))
    prefix.save_pretrained(tmp_path / "adapter")
    trained.bundle_rescorer("neural", tmp_path / "adapter", alpha=0.5, type="base_prefix", num_layers=1)
    trained.save_pretrained(ckpt)

    model = BlockwiseParallelForCausalLM.from_pretrained(ckpt, quantization_config=QuantoConfig(weights="int8"))
    assert type(model.base_lm.model.layers[0].mlp.up_proj).__name__ == "QLinear"
    rescorer_layer = model.bundled_rescorers["neural"].model.model.layers[0].mlp.up_proj
    assert type(rescorer_layer).__name__ == "Linear"  # a plain fp32 layer holding the dequantized weights
    n, d = compare_with_base(model, [prompt_ids(seed, 6 + seed) for seed in range(3)],
                             {"rescorer": "neural", "draft_top_k": 3})
    assert d <= n // 3


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "--device", "gpu0"], "--device must be cpu, cuda, cuda:N, mps or auto"),
    (["bench", "--device", "cuda:x"], "--device must be"),
])
def test_bad_device_flag_is_a_one_line_error_before_any_import(argv, fragment):
    done = subprocess.run([sys.executable, "-m", "hf_bpd.cli", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and fragment in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_flag_without_a_gpu_says_so(tmp_path, capsys):
    from hf_bpd.cli import main

    base_dir = tmp_path / "base"
    tiny_base("llama").save_pretrained(base_dir)
    assert main(["profile", "--model", str(base_dir), "--device", "cuda", "--lengths", "1", "--no-compile"]) == 2
    assert "sees no cuda device here: use --device cpu" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_training_on_cuda_without_a_gpu_says_so(tmp_path):
    from hf_bpd.training.train_heads import main as train

    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "Say hi", "output": "hi"}\n')
    with pytest.raises(SystemExit, match="--device cuda: torch .* sees no CUDA device here: use --device cpu"):
        train(["--model", "unused", "--data", str(data), "--device", "cuda", "--output-dir", str(tmp_path / "o")])


# ------------------------------------------------------------------ CUDA (skipped without a GPU)
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_generation_matches_the_base_on_the_gpu(tmp_path, dtype):
    base_dir, ckpt = tmp_path / "base", tmp_path / "heads"
    tiny_base("llama").save_pretrained(base_dir)
    trained = copy.deepcopy(random_bpd("llama", 1))
    trained.config.base_model_name_or_path = str(base_dir)
    trained.save_pretrained(ckpt)
    model = BlockwiseParallelForCausalLM.from_pretrained(ckpt, dtype=dtype, device_map="cuda")
    assert model.device.type == "cuda" and {p.device.type for p in model.heads.parameters()} == {"cuda"}
    total = differ = 0
    for options in (*MODES.values(), {"compile": True}):
        n, d = compare_with_base(model, [prompt_ids(seed, 6 + seed) for seed in range(4)], options)
        total, differ = total + n, differ + d
    assert differ <= total // 10
