"""A saved heads checkpoint carries its modeling code: plain transformers (`trust_remote_code=True`) loads it and drafts
with the heads where hf_bpd cannot be imported, and the output is the base model's own."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_bpd
from hf_bpd import BlockwiseParallelForCausalLM
from hf_bpd.hub.remote_code import AUTO_MAP, HEADS_SOURCE, remote_config_fields, remote_files, write_remote_code
from tests.conftest import VOCAB, tiny_base

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "smollm2-135m-instruct-bpd"
PROMPTS = [[5, 9, 11, 4], [7, 3, 30], [12, 40, 41, 8, 19]]
MAX_NEW_TOKENS = 40
CASES = {  # name -> (base architecture, BlockwiseParallelConfig fields; "vocab": with a draft vocabulary)
    "ffn": ("llama", dict(head_type="ffn", num_heads=3, tie_head_projection=False, vocab=True)),
    "resblock": ("llama", dict(head_type="resblock", num_heads=3)),
    "hydra": ("llama", dict(head_type="hydra", num_heads=3, num_layers_per_head=2, vocab=True)),
    # sliding-window layers (window 8 < the sequences) and logit softcapping: the cache rollback must hold
    "gemma3": ("gemma3", dict(head_type="resblock", num_heads=3)),
}

# Run in a fresh interpreter that cannot import hf_bpd: everything comes from the checkpoints' remote code.
CHILD = r"""
import importlib.abc, json, sys

class NoHfBpd(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "hf_bpd":
            raise ImportError("hf_bpd is not installed here")

sys.meta_path.insert(0, NoHfBpd())
import torch
from transformers import AutoConfig, AutoModelForCausalLM

job = json.loads(sys.argv[1])
out = {"cases": {}, "configs": {}}

def greedy(model, ids, **kwargs):
    return model.generate(torch.tensor([ids]), max_new_tokens=job["max_new_tokens"], do_sample=False, **kwargs)

for name, (directory, base_dir) in job["checkpoints"].items():
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()  # loaded on its own, to compare with
    case = out["cases"][name] = {"class": type(model).__module__ + "." + type(model).__name__, "runs": [],
                                 "fingerprint": sys.modules[type(model).__module__].fingerprint(base)}
    for ids in job["prompts"]:
        got = greedy(model, ids)
        stats = model.last_generation_stats
        case["runs"].append({"want": greedy(base, ids)[0].tolist(), "got": got[0].tolist(), "method": stats.method,
                             "forwards": stats.forwards, "new_tokens": stats.new_tokens,
                             "accepted": stats.accepted_lengths})
    # return_dict_in_generate with scores and logits, like the base's
    ids = job["prompts"][0]
    mine = greedy(model, ids, return_dict_in_generate=True, output_scores=True, output_logits=True)
    theirs = greedy(base, ids, return_dict_in_generate=True, output_scores=True, output_logits=True)
    case["dict"] = {"method": model.last_generation_stats.method,
                    "same_sequences": torch.equal(mine.sequences, theirs.sequences),
                    "scores_close": all(torch.allclose(a, b, atol=1e-4) for a, b in zip(mine.scores, theirs.scores))
                    and len(mine.scores) == len(theirs.scores),
                    "logits_close": all(torch.allclose(a, b, atol=1e-4) for a, b in zip(mine.logits, theirs.logits)),
                    "cache_length": mine["cache" if "cache" in mine else "past_key_values"].get_seq_length(),  # name by version
                    "length": mine.sequences.shape[1]}
    # sampling and batches are the base's own generate(): same seed, same tokens
    sampled = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        a = model.generate(torch.tensor([ids]), do_sample=True, max_new_tokens=20, top_k=0)
        torch.manual_seed(seed)
        b = base.generate(torch.tensor([ids]), do_sample=True, max_new_tokens=20, top_k=0)
        sampled.append({"same": torch.equal(a, b), "method": model.last_generation_stats.method})
    case["sampled"] = sampled
    batch = torch.tensor([job["prompts"][0], job["prompts"][0][::-1]])
    case["batch"] = {"same": torch.equal(model.generate(batch, max_new_tokens=8, do_sample=False),
                                         base.generate(batch, max_new_tokens=8, do_sample=False)),
                     "method": model.last_generation_stats.method}
    case["forward_same"] = torch.equal(model(torch.tensor([ids])).logits, base(torch.tensor([ids])).logits)
    try:
        model.generate(torch.tensor([ids]), max_new_tokens=2, drafter="feature")
        case["feature_drafter"] = "no error"
    except ValueError as err:
        case["feature_drafter"] = str(err)

for name, directory in job["configs"].items():
    config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
    out["configs"][name] = {"class": type(config).__module__, "base": config.base_model_hub_id,
                            "draft_size": config.draft_size, "hidden_size": config.hidden_size,
                            "head_type": config.head_type}
try:
    import hf_bpd  # noqa: F401
    out["hf_bpd_importable"] = True
except ImportError:
    out["hf_bpd_importable"] = False
out["hf_bpd_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "hf_bpd")
print("RESULT " + json.dumps(out))
"""


def _train_heads(model, sequences, steps: int = 40) -> None:
    """Fit the heads to the base's own greedy continuations, so their drafts get accepted."""
    model.freeze_base()
    optimizer = torch.optim.Adam([p for p in model.heads.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        loss = sum(model(input_ids=seq, labels=seq, return_head_logits=False).loss for seq in sequences)
        loss.backward()
        optimizer.step()
    model.eval()


@pytest.fixture(scope="module")
def remote_run(tmp_path_factory, one_thread):
    """Tiny bases in `base-<arch>/`, one trained heads checkpoint per case with its remote code, the shipped
    checkpoint's config with its remote code; then one child interpreter (no hf_bpd) loads and runs them all."""
    tmp = tmp_path_factory.mktemp("remote")
    bases, checkpoints, local = {}, {}, {}
    for name, (arch, fields) in CASES.items():
        base_dir = tmp / f"base-{arch}"
        if arch not in bases:
            base = tiny_base(arch)
            base.save_pretrained(base_dir)
            with torch.no_grad():
                sequences = [base.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
                             for ids in PROMPTS]
            bases[arch] = sequences
        sequences = bases[arch]
        fields = dict(fields)
        if fields.pop("vocab", False):  # the tokens the base decodes, and some others
            fields["draft_vocab"] = sorted({int(t) for seq in sequences for t in seq[0]} | set(range(0, VOCAB, 5)))
        torch.manual_seed(0)
        model = BlockwiseParallelForCausalLM.from_base(str(base_dir), **fields)
        _train_heads(model, sequences)
        directory = tmp / f"heads-{name}"
        model.save_pretrained(directory)
        assert write_remote_code(model, directory) == AUTO_MAP
        checkpoints[name] = (str(directory), str(base_dir))
        local[name] = model
    shipped = tmp / "shipped"  # its config only: the weights are not needed to parse it
    shipped.mkdir()
    shutil.copy(SHIPPED / "config.json", shipped / "config.json")
    write_remote_code(hf_bpd.BlockwiseParallelConfig.from_pretrained(SHIPPED), shipped)

    job = {"checkpoints": checkpoints, "configs": {"shipped": str(shipped)},
           "prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS}
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp / "modules"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    return result, local


def test_child_cannot_import_hf_bpd(remote_run):
    result, _ = remote_run
    assert result["hf_bpd_importable"] is False and result["hf_bpd_loaded"] == []
    for case in result["cases"].values():
        assert case["class"].startswith("transformers_modules.") and case["class"].endswith(
            "modeling_bpd.BlockwiseParallelForCausalLM")


@pytest.mark.parametrize("name", sorted(CASES))
def test_remote_greedy_drafts_and_matches_the_base(remote_run, name):
    result, local = remote_run
    runs = result["cases"][name]["runs"]
    for run in runs:
        assert run["got"] == run["want"]  # token for token the base's own greedy output
        assert run["method"] == "bpd"
        assert run["forwards"] == 1 + len(run["accepted"])  # the prompt pass, then one verification per block
        # each pass decodes its accepted drafts plus the base's own next token (unless a draft was the last token)
        assert run["new_tokens"] - run["forwards"] - sum(run["accepted"]) in (0, -1)
    assert sum(sum(run["accepted"]) for run in runs) > 0  # the trained heads were read and used
    assert sum(run["forwards"] for run in runs) < sum(run["new_tokens"] for run in runs)
    # the same heads code drafts the same blocks as hf_bpd's own plain BPD
    for ids, run in zip(PROMPTS, runs):
        local[name].generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        assert local[name].last_generation_stats.accepted_lengths[1:] == run["accepted"]


def test_remote_dict_output_sampling_batch_and_forward_are_the_base(remote_run):
    result, local = remote_run
    for name, case in result["cases"].items():
        assert case["dict"] == {"method": "bpd", "same_sequences": True, "scores_close": True, "logits_close": True,
                                "cache_length": case["dict"]["length"] - 1, "length": case["dict"]["length"]}
        assert case["sampled"] == [{"same": True, "method": "base"}] * 2
        assert case["batch"] == {"same": True, "method": "base"}
        assert case["forward_same"] is True
        assert "drafts with the heads only" in case["feature_drafter"] and "\n" not in case["feature_drafter"]
        assert case["fingerprint"] == hf_bpd.fingerprint(local[name].base_lm)  # the remote copy of fingerprint() agrees


def test_shipped_checkpoint_names_its_base_by_hub_id(remote_run):
    result, _ = remote_run
    assert result["configs"]["shipped"] == {"class": result["configs"]["shipped"]["class"],
                                            "base": "HuggingFaceTB/SmolLM2-135M-Instruct", "draft_size": 8192,
                                            "hidden_size": 576, "head_type": "ffn"}
    assert result["configs"]["shipped"]["class"].startswith("transformers_modules.")


def test_hf_bpd_still_loads_checkpoints_with_remote_code(remote_run, tmp_path):
    """With hf_bpd imported its own classes load such a checkpoint (auto_map and base_model_hub_id are kept)."""
    _, local = remote_run
    model = local["resblock"]
    model.save_pretrained(tmp_path)
    write_remote_code(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, BlockwiseParallelForCausalLM)
    assert loaded.config.auto_map == AUTO_MAP
    assert loaded.config.base_model_hub_id == str(model.config.base_model_name_or_path)
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(loaded.generate(ids, max_new_tokens=12, do_sample=False),
                       model.base_lm.generate(ids, max_new_tokens=12, do_sample=False))


def test_remote_files_are_self_contained_and_share_the_heads_code():
    files = remote_files()
    assert set(files) == {"configuration_bpd.py", "modeling_bpd.py", "heads_bpd.py"}
    assert all("hf_bpd" not in line for text in files.values() for line in text.splitlines()
               if line.lstrip().startswith(("import ", "from ")))
    heads = HEADS_SOURCE.read_text().replace("from .configuration import", "from .configuration_bpd import")
    kv_cache = [line for line in (HEADS_SOURCE.parent / "kv_cache.py").read_text().splitlines()
                if line.startswith(("from transformers", "CACHE_NAME = "))]  # hf_bpd/kv_cache.py's code, inlined
    heads = heads.replace("from .kv_cache import CACHE_NAME  # noqa: F401 - re-exported", "\n".join(kv_cache))
    assert files["heads_bpd.py"].split("\n", 1)[1] == heads
    config = hf_bpd.BlockwiseParallelConfig(num_heads=2, base_model_name_or_path="smollm2-135m-instruct")
    assert remote_config_fields(config) == {"auto_map": AUTO_MAP,
                                            "base_model_hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}
