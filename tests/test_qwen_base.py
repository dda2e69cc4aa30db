"""The shipped Qwen2.5-Coder-1.5B-Instruct checkpoint on its real base (`hf-bpd install-base
qwen2.5-coder-1.5b-instruct`, which `.ci/run` runs): in bf16 on hf_bpd's kernels, the default's output equals the
base's compiled plain decoding token for token, on its code-only artifact (built here once per machine when missing,
as `hf-bpd compile` would). Outside CI a machine without the base skips it, saying what to run."""

import json
import os
from pathlib import Path

import pytest
import torch

from hf_bpd import BaseModelError, BlockwiseParallelForCausalLM, load_tokenizer
from hf_bpd.runtime import artifacts
from hf_bpd.runtime.kernels import kernels_unsupported_reason

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "checkpoints" / "qwen2.5-coder-1.5b-instruct-bpd"
PROMPTS = ROOT / "benchmarks" / "qwen_code_prompts.jsonl"
REASON = kernels_unsupported_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"the checkpoint runs fp32 without hf_bpd's kernels "
                                                            f"({REASON}): too slow for the suite"),
              pytest.mark.artifacts, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def qwen():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = BlockwiseParallelForCausalLM.from_pretrained(CHECKPOINT)
    except BaseModelError as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs the Qwen base (.ci/run): {error}")
        pytest.skip(f"{error}")
    yield model, load_tokenizer(CHECKPOINT)
    torch.set_num_threads(threads)


def test_the_default_equals_compiled_plain_decoding_on_the_real_base(qwen):
    model, tokenizer = qwen
    assert model.base_lm.dtype == torch.bfloat16 and artifacts.supplies_constants(model.base_lm)
    greedy = dict(max_new_tokens=40, do_sample=False, compile="wait")
    accepted = 0
    for line in PROMPTS.read_text().splitlines()[:2]:
        question = json.loads(line)["turns"][0]
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        plain = model.generate(**inputs, use_heads=False, **greedy)
        assert model.last_generation_stats.verifier == "artifact"
        got = model.generate(**inputs, **greedy)
        stats = model.last_generation_stats
        assert stats.verifier == "artifact" and torch.equal(got, plain), question
        accepted += sum(stats.accepted_lengths)
    assert accepted > 0  # the heads' drafts were accepted: drafting was exercised
