"""Compiling is quiet: no inductor autotune tables or compiler warnings on stderr during `generate(compile=True)`,
unless `HF_BPD_DEBUG=1` asks for them (`hf_bpd.runtime.quiet`)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from hf_bpd import BlockwiseParallelForCausalLM

    torch.set_num_threads(1)
    def run(width):
        # every GEMM width x width (vocabulary, MLP and heads too): one shape for inductor to autotune (~5 s each)
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=width, hidden_size=width, intermediate_size=width, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
        base = AutoModelForCausalLM.from_config(config).eval()
        model = BlockwiseParallelForCausalLM.from_base(base, num_heads=2).eval()
        ids = torch.randint(3, width, (1, 5), generator=torch.Generator().manual_seed(0))
        out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, compile=True)
        assert torch.equal(out, base.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None))
    run(64)  # drafted decoding, compiled
    from torch._dynamo.utils import counters
    assert counters["inductor"]["select_algorithm_autotune"] > 0  # it autotuned GEMMs: the quiet was not for nothing
    sys.stderr.write("=== debug\\n")
    sys.stderr.flush()
    os.environ["HF_BPD_DEBUG"] = "1"
    # hf_bpd's compiles are quieted by `quiet_compilation()`; with HF_BPD_DEBUG=1 it lets the tables through (one
    # linear layer of another GEMM shape, autotuned afresh with the compiled steps' options)
    import torch._inductor.config as inductor_config
    from hf_bpd.runtime.inlining import INDUCTOR_OPTIONS
    from hf_bpd.runtime.quiet import quiet_compilation
    linear = torch.nn.Linear(96, 80).eval()
    with torch.no_grad(), quiet_compilation(), inductor_config.patch({**INDUCTOR_OPTIONS, "max_autotune": True}):
        torch.compile(linear)(torch.randn(3, 96))
""")


def test_compiled_generate_prints_no_autotune_tables_unless_debugging(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_BPD_DEBUG"}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    quiet, _, debug = done.stderr.partition("=== debug\n")
    assert "AUTOTUNE" not in quiet and "Autotune Choices" not in quiet, quiet[:2000]
    assert "Warning" not in quiet, quiet[:2000]
    assert "AUTOTUNE" in debug  # the switch is what silences them: with HF_BPD_DEBUG=1 they are back
