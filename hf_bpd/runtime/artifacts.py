"""Compiled verification steps that outlive the process: built once per machine, loaded in seconds.

`torch.compile`'s caches cannot hold a frozen graph, so each process would trace, freeze and autotune the step again
(minutes). Here the step is exported once (`torch.export`) and compiled ahead of time with AOTInductor into one
package file (the same inductor options: freezing, the CPP GEMM templates, the inlining options, the GEMM prefetch),
which every later process loads with `aoti_load_package` in seconds.

One artifact serves block lengths 1 to `MAX_BLOCK`, every context length and batches of up to `MAX_ROWS` rows: rows,
block length, the KV cache's capacity and the attended length are dynamic. Inputs must be dense (the code reads rows
by the strides it was built with). The KV tensors are inputs written in place, so the cache stays the caller's.

Graphs beside the step, each with static shapes where that lets inductor pick better kernels: the batch steps of one
and two tokens a row (`ONE_TOKEN`, `TWO_TOKENS`). They are built after the step, in the background or by `hf-bpd
compile`; the step serves their shapes until they exist. A base with sliding-window layers has no batch steps; its
step takes the sliding layers' mask as an input of its own (`_WindowedStep`). docs/performance.md#compiled-steps has
their costs.

A position-ordered bf16 base on hf_bpd's kernels gets an artifact of code only, its constants (the packed weights)
given at load by the process (`hf_bpd.runtime.ordered_artifact`). So does any base whose weights exceed
`MAX_FROZEN_WEIGHTS` (an fp32 1.5B: 6 GB): built without freezing, given the base's own tensors at load, so neither the
disk nor the memory holds its weights twice.

An artifact is valid for what it was built from, all in its key: the base's weights (`weights.digest`: every byte;
for an artifact of code only, the layout of the constants it is given, and the kernels' build),
dtype and config, the torch / transformers / hf_bpd versions, the CPU's instruction set and flags (AMX tiles are not
in the capability's name) and the thread count (baked into the GEMM code). It lives in
`$HF_BPD_CACHE/artifacts/<key>/` beside `key.json` with the package's sha256 (a corruption check on every load: a
damaged file is rebuilt, not run); builds write a temporary file and rename it into place, under the folder's lock.
Folders that fail `hub.locate.trust_problem` are never loaded from or built in.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import weakref
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import weights
from .cache_files import (ATTEMPTS, LOCK, claim_lock, distrusted, inductor_cache, inductor_cache_env,  # noqa: F401
                          open_lock, wait_for_lock)
from .attention import attention_implementation, stacked_query_attention
from .ordered_attention import uses_ordered_attention
from .ordered_artifact import constants_layout, export_ordered, supplied_constants, supplies_constants
from .unfrozen_artifact import UNFROZEN_FORMAT, UNFROZEN_OPTIONS, onednn_linears, own_constants, weight_bytes
from .step import VerificationStep, compile_unsupported_reason, example_inputs, place_kv, sliding_window_of, \
    window_mask

FORMAT = 5  # bump when the exported step or the key changes (5: keyed on the weights' exact digest)
STEP, ONE_TOKEN, TWO_TOKENS = "step", "one_token", "two_tokens"  # the graphs: every block; 1 or 2 tokens a row
BATCH_GRAPHS = (ONE_TOKEN, TWO_TOKENS)  # the batch steps beside the step (none for sliding-window bases)
GRAPH_FORMAT = {ONE_TOKEN: 1, TWO_TOKENS: 1}  # bump when an exported graph beside the step changes
ONE_TOKEN_ROWS = 16  # the one-token batch step's example rows (inductor tunes its kernels for that many tokens)
TWO_TOKENS_ROWS = 4  # the two-token batch step's (batches of 4 draft; at 16 rows a second token rarely pays)
BATCH_EXAMPLE = {ONE_TOKEN: (1, ONE_TOKEN_ROWS), TWO_TOKENS: (2, TWO_TOKENS_ROWS)}  # (tokens a row, example rows)
WINDOWED_FORMAT = 1  # bump when the step of sliding-window bases (its second mask input) changes
ORDERED_FORMAT = 1  # bump when a position-ordered base's step (code only: `ordered_artifact.OrderedStep`) changes
MAX_BLOCK = 16  # block lengths one artifact serves (1..MAX_BLOCK)
MAX_ROWS = 64  # batch rows one artifact serves (1..MAX_ROWS)
MAX_CONTEXT = 32768
MAX_FROZEN_WEIGHTS = 2 ** 31  # bytes of weights an artifact holds (frozen into its package); larger: code only
PACKAGE = "step.pt2"
FAILED = "build.failed"  # the last build's error (a background build is not started again while it is there)
DESCRIPTION = {STEP: "the compiled step", ONE_TOKEN: "the compiled one-token batch step",  # in log lines
               TWO_TOKENS: "the compiled two-token batch step"}
_FILES = {STEP: (PACKAGE, "key.json", FAILED),  # graph -> (package, its record, its last build's error)
          ONE_TOKEN: ("one_token.pt2", "one_token.json", "one_token.failed"),
          TWO_TOKENS: ("two_tokens.pt2", "two_tokens.json", "two_tokens.failed")}
ATTENTION_NAME = "hf_bpd_attended_sdpa"
ONE_TOKEN_ATTENTION_NAME = "hf_bpd_attended_stacked_sdpa"


def attended_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          is_causal=None, **kwargs):
    """SDPA over the first `L` cache slots, `L` = the mask's last dimension; grouped key/value heads read in place."""
    attended = attention_mask.shape[-1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key[:, :, :attended], value[:, :, :attended], attn_mask=attention_mask, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def attended_stacked_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                                  is_causal=None, **kwargs):
    """`attended_sdpa_forward` for one query token per row, each key/value head's query heads stacked as that head's
    queries (`stacked_query_attention`)."""
    heads, width, kv_heads = query.shape[1], query.shape[2], key.shape[1]
    if width != 1 or heads == kv_heads or heads % kv_heads:
        return attended_sdpa_forward(module, query, key, value, attention_mask, scaling=scaling)
    attended = attention_mask.shape[-1]
    out = stacked_query_attention(query, key[:, :, :attended], value[:, :, :attended], attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


for _name, _forward in ((ATTENTION_NAME, attended_sdpa_forward),
                        (ONE_TOKEN_ATTENTION_NAME, attended_stacked_sdpa_forward)):
    AttentionInterface.register(_name, _forward)
    AttentionMaskInterface.register(_name, sdpa_mask)


def enabled() -> bool:
    """Whether artifacts are used at all (`HF_BPD_OFF=artifacts`: never; `compile=True` then compiles in-process)."""
    from ..environment import off

    return not off("artifacts")


def artifacts_dir() -> Path:
    from ..hub.locate import cache_dir

    return cache_dir() / "artifacts"


def unsupported_reason(base) -> str | None:
    """Why an artifact cannot serve `base` (None when it can)."""
    reason = compile_unsupported_reason(base)
    if reason is not None:
        return reason
    if base.device.type != "cpu":
        return "artifacts are built for CPU bases"
    if uses_ordered_attention(base) and not supplies_constants(base):
        return ("half-precision bases off hf_bpd's kernels attend in position order: generate(compile=True) "
                "compiles them in-process")
    if getattr(base.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return f"attention implementation {base.config._attn_implementation!r}"
    if not hasattr(torch._inductor, "aoti_compile_and_package"):
        return f"torch {torch.__version__} has no AOTInductor packaging"
    return None


_PROVENANCE = ("architectures", "_name_or_path", "name_or_path", "transformers_version", "_commit_hash")


def weights_supplied(base) -> bool:
    """Whether `base`'s artifact is code only, its weights given by the process at load: position-ordered bases on
    hf_bpd's kernels (`supplies_constants`: their packed weights) and bases over `MAX_FROZEN_WEIGHTS` (their own)."""
    return supplies_constants(base) or weight_bytes(base) > MAX_FROZEN_WEIGHTS


def artifact_key(base, threads: int | None = None) -> dict:
    """Everything an artifact's validity depends on (see the module docstring)."""
    import transformers

    from .. import __version__
    from .inlining import autotune_off
    from .int8_heads import cpu_features

    # the config's values, without the fields that only record where it came from (`save_pretrained` sets some)
    config = {k: v for k, v in base.config.to_dict().items() if k not in _PROVENANCE}
    config = json.dumps(config, sort_keys=True, default=str)
    ordered, supplied = supplies_constants(base), weights_supplied(base)
    if ordered:
        from .kernels import kernel_file
    return {"format": FORMAT, "weights": "supplied" if supplied else weights.digest(base), "dtype": str(base.dtype),
            "config": hashlib.sha256(config.encode()).hexdigest()[:16], "torch": torch.__version__,
            "transformers": transformers.__version__, "hf_bpd": __version__,
            "cpu": torch.backends.cpu.get_cpu_capability(), "threads": threads or torch.get_num_threads(),
            # every CPU flag: inductor's GEMM code uses AMX tiles where they are, which the capability does not name
            "cpu_flags": hashlib.sha256(cpu_features().encode()).hexdigest()[:16],
            "max_block": MAX_BLOCK, "max_rows": MAX_ROWS,
            # built without GEMM autotuning (inductor's own switch): kept apart, so autotuned calls never load it
            **({"autotune": False} if autotune_off() else {}),
            # sliding-window bases: the step takes the sliding layers' mask as an input of its own
            **({"windowed": WINDOWED_FORMAT} if sliding_window_of(base) is not None else {}),
            # code only: the layout of the constants it is given; an ordered base's also the kernels it calls (their
            # library's name hashes the build)
            **({"constants": constants_layout(base)} if supplied else {}),
            **({"unfrozen": UNFROZEN_FORMAT} if supplied and not ordered else {}),
            **({"ordered": ORDERED_FORMAT, "kernels": kernel_file().name} if ordered else {})}


def key_dir(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return artifacts_dir() / digest


def graph_key(key: dict, graph: str = STEP) -> dict:
    """What `graph`'s record must hold: the artifact's key, and for a graph beside the step its own format and the GEMM
    register block it is built with where it is not inductor's choice (AVX2: `register_block.batch_step_block`)."""
    from .register_block import batch_step_block

    _check_graph(graph)
    if graph == STEP:
        return key
    block = batch_step_block()
    return {**key, "graph": graph, "graph_format": GRAPH_FORMAT[graph],
            **({"register_block": "x".join(map(str, block[:2]))} if block else {})}


def graph_files(directory: Path, graph: str = STEP) -> tuple[Path, Path, Path]:
    """`(package, record, failure note)` of `graph` in the artifact folder `directory`."""
    _check_graph(graph)
    return tuple(directory / name for name in _FILES[graph])


def _check_graph(graph: str) -> None:
    if graph not in _FILES:
        raise ValueError(f"an artifact's graphs are {', '.join(_FILES)}, got {graph!r}")


class _Step(VerificationStep):
    """The exported unit: `VerificationStep` with the KV tensors as inputs, this block written at `length`."""

    def forward(self, input_ids, position_ids, attention_mask, length, kv):
        return super().forward(input_ids, position_ids, place_kv(self.cache, input_ids, length, kv), attention_mask)


class _WindowedStep(_Step):
    """The exported unit of a base with sliding-window layers: both layer types' masks are inputs, so a batch's rows
    (whose slots hold other positions than their index) pass the windows they built (`hf_bpd.generation.batch`)."""

    def forward(self, input_ids, position_ids, attention_mask, sliding_mask, length, kv):
        masks = {"full_attention": attention_mask, "sliding_attention": sliding_mask}
        return super().forward(input_ids, position_ids, masks, length, kv)


def one_token_unsupported_reason(base) -> str | None:
    """Why `base`'s artifact has no batch steps (one-token, two-token; None when it can have them): sliding-window
    bases run their batches' steps on the step (each graph would hold the weights again;
    docs/performance.md, "Gemma-3-270m"); position-ordered bases compile their batches in the call."""
    if uses_ordered_attention(base):
        return "bf16 batches on hf_bpd's kernels have no artifact"
    if sliding_window_of(base) is not None:
        return "sliding-window bases run a batch's one-token steps on the step"
    return None


def export_step(base, graph: str = STEP):
    """`torch.export` of the step with dynamic batch rows, block length, cache capacity and attended length (the
    one-token batch step: one token per row, `ONE_TOKEN_ROWS` example rows, stacked query heads; the two-token batch
    step: two tokens per row, `TWO_TOKENS_ROWS` example rows). A position-ordered base's step:
    `ordered_artifact.export_ordered`."""
    if supplies_constants(base):
        _check_graph(graph)
        if graph != STEP:
            raise ValueError(f"a position-ordered base's artifact has no {graph} graph")
        return export_ordered(base, MAX_BLOCK, MAX_CONTEXT)
    one_token = graph == ONE_TOKEN
    if graph == STEP:
        cache, args = example_inputs(base)
    else:
        width, example_rows = BATCH_EXAMPLE[graph]
        cache, args = example_inputs(base, block=width, rows=example_rows)
    rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
    block = torch.export.Dim("block", min=1, max=MAX_BLOCK) if graph == STEP else torch.export.Dim.STATIC
    attended = torch.export.Dim("attended", min=2, max=MAX_CONTEXT)
    capacity = torch.export.Dim("capacity", min=16, max=MAX_CONTEXT)
    mask = {0: rows, 2: block, 3: attended}
    shapes = {"input_ids": {0: rows, 1: block}, "position_ids": {0: rows, 1: block}, "attention_mask": mask,
              "length": None, "kv": [{0: rows, 2: capacity}] * len(args[-1])}
    step = _Step
    if sliding_window_of(base) is not None:  # the sliding layers' mask: an input of its own, after the full one
        step, args, shapes = _WindowedStep, args[:3] + (args[2].clone(),) + args[3:], {**shapes, "sliding_mask": mask}
    attention = ONE_TOKEN_ATTENTION_NAME if one_token else ATTENTION_NAME
    with torch.no_grad(), attention_implementation(base, attention):
        exported = torch.export.export(step(base, cache).eval(), args, dynamic_shapes=shapes, strict=False)
    return onednn_linears(exported) if weights_supplied(base) else exported


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build(base, threads: int | None = None, log=None, key: dict | None = None, graph: str = STEP,
          lock=None) -> Path:
    """Build `graph` of the artifact of `base` for this machine (unless a valid one exists) in
    `$HF_BPD_CACHE/artifacts/<key>/`. Holds the folder's file lock while building (`lock`: the lock file a
    background worker inherited, already held); returns the package path. `key`: the key to build under (a
    background worker's copy of another process's base: its weights and dtype must be the key's)."""
    from .inlining import INDUCTOR_OPTIONS, ORDERED_OPTIONS, compiler_options
    from .prefetch import prefetching_gemm_template
    from .quiet import quiet_compilation
    from .register_block import batch_step_block, register_block

    own = artifact_key(base, threads if key is None else key["threads"])
    fields = ("weights", "dtype", "constants")
    if key is not None and [own.get(f) for f in fields] != [key.get(f) for f in fields]:
        raise ValueError(f"this base is not the one the key names (weights {own['weights']} vs {key['weights']}, "
                         f"dtype {own['dtype']} vs {key['dtype']}, constants {own.get('constants')} vs "
                         f"{key.get('constants')})")
    key = key or own
    directory = key_dir(key)
    package, record_file, failed = graph_files(directory, graph)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    if distrusted(directory):
        raise OSError(f"{directory} is not a cache folder of this user's (see the warning): nothing built there")
    with (lock if lock is not None else open_lock(directory)) as lock:
        wait_for_lock(lock, directory, log)  # a second builder waits here, then finds the artifact built
        if valid(directory, key, graph):
            return package
        failed.unlink(missing_ok=True)
        start = time.perf_counter()
        if log:
            log(f"building {DESCRIPTION[graph]} for this machine ({key['cpu']}, {key['threads']} threads) ...")
        exported = export_step(base, graph)
        options = {**INDUCTOR_OPTIONS, **compiler_options(), "cpp.threads": key["threads"]}
        if "ordered" in key:  # code only: built as the in-process ordered step is, its constants given at load
            options.update({**ORDERED_OPTIONS, "aot_inductor.package_constants_in_so": False})
        elif "constants" in key:  # code only, the base's own weights given at load
            options.update(UNFROZEN_OPTIONS)
        partial = directory / f".partial-{os.getpid()}-{package.name}"
        block = batch_step_block() if graph != STEP else None
        with torch.no_grad(), prefetching_gemm_template(), register_block(block), quiet_compilation(), \
                torch._inductor.config.patch(compiler_options()), inductor_cache():
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial), inductor_configs=options)
        record = {**graph_key(key, graph), "sha256": _sha256(partial), "bytes": partial.stat().st_size,
                  "build_seconds": round(time.perf_counter() - start, 1)}
        os.replace(partial, package)
        tmp = directory / f".{record_file.name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, record_file)
        (directory / ATTEMPTS.format(graph=graph)).unlink(missing_ok=True)  # this build did not die
        if log:
            log(f"built in {record['build_seconds']:.0f} s: {package} ({record['bytes'] / 1e6:.0f} MB)")
        return package


def valid(directory: Path, key: dict, graph: str = STEP) -> bool:
    """Whether `directory` holds an intact `graph` of `key` (its recorded key and the package's sha256)."""
    package, record_file, _ = graph_files(directory, graph)
    expected = graph_key(key, graph)
    try:
        record = json.loads(record_file.read_text())
    except (OSError, ValueError):
        return False
    if {k: record.get(k) for k in expected} != expected or not package.is_file():
        return False
    return record.get("sha256") == _sha256(package)


class Artifact:
    """A loaded artifact: `(logits, hidden) = artifact(input_ids, position_ids, attention_mask, length, kv)`. A
    sliding-window base's `attention_mask` is its full layers' mask (the sliding layers' is derived from it, slot `i`
    holding position `i`: `window_mask`) or a dict of both (`"full_attention"`, `"sliding_attention"`: batches).
    An artifact of code only is given its `constants` (kept alive here: the package holds pointers to them); an
    `ordered` one takes each row's key order: `artifact(..., length, kv, order=(key_slots, key_ranks))`."""

    def __init__(self, path: Path, window: int | None = None, constants: dict[str, torch.Tensor] | None = None,
                 ordered: bool = False):
        self.path, self.window, self.constants, self.ordered = path, window, constants, ordered
        self.model = torch._inductor.aoti_load_package(str(path))
        if constants is not None:
            names = self.model.get_constant_fqns()
            missing = [name for name in names if name not in constants]
            if missing:
                raise RuntimeError(f"the artifact {path} needs constants this base lacks ({missing[0]}, ...): "
                                   "`hf-bpd compile --clear` and build it again")
            self.model.load_constants({name: constants[name] for name in names}, check_full_update=True,
                                      user_managed=True)

    def __call__(self, input_ids, position_ids, attention_mask, length, kv, order=None):
        if self.ordered:
            return self.model(input_ids, position_ids, attention_mask, length, *order, kv)
        if self.window is None:
            return self.model(input_ids, position_ids, attention_mask, length, kv)
        if isinstance(attention_mask, dict):  # (a base of one layer type: its mask stands in for the other's)
            full = attention_mask.get("full_attention", attention_mask.get("sliding_attention"))
            sliding = attention_mask.get("sliding_attention", full)
        else:
            full, sliding = attention_mask, window_mask(attention_mask, position_ids, self.window)
        return self.model(input_ids, position_ids, full, sliding, length, kv)


# base -> {(graph, threads): Artifact (None: none on disk)}; the thread count is baked into the GEMM code
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base -> (threads, weights' marker, key)
_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base -> its weights' marker when last loaded for


def cached_key(base, threads: int | None = None) -> dict:
    """`artifact_key(base, threads)`, computed again only when the weights changed (`weights.marker`; the digest
    reads every byte, too slow to repeat on every call)."""
    threads = threads or torch.get_num_threads()
    mark = weights.marker(base)
    known = _KEYS.get(base)
    if known is None or known[:2] != (threads, mark):
        known = _KEYS[base] = (threads, mark, artifact_key(base, threads))
    return known[2]


def load(base, threads: int | None = None, again: bool = False, graph: str = STEP) -> Artifact | None:
    """`graph` of the artifact of `base` for this machine if it is built and intact (loaded once per process), else
    None. A base found without it is looked up again only with `again`. `threads`: the thread count it was built
    for (default: torch's now; a process that changes it gets that count's artifact)."""
    threads = threads or torch.get_num_threads()
    if weights.changed_since(base, _SEEN):  # changed in place: every graph loaded for it holds the old weights
        _LOADED.pop(base, None)
    loaded, slot = _LOADED.setdefault(base, {}), (graph, threads)
    if slot in loaded and not (again and loaded[slot] is None):
        return loaded[slot]
    artifact = None
    if unsupported_reason(base) is None:
        key = cached_key(base, threads)
        directory = key_dir(key)
        if directory.is_dir() and not distrusted(directory) and valid(directory, key, graph):
            ordered = "ordered" in key
            constants = supplied_constants(base) if ordered else own_constants(base) if "constants" in key else None
            artifact = Artifact(graph_files(directory, graph)[0], sliding_window_of(base), constants, ordered)
    loaded[slot] = artifact
    return artifact


def ensure(base, log=None, graph: str = STEP) -> Artifact:
    """`graph` of `base`'s artifact, built here first when it is not (`build`, with `log`), then loaded."""
    artifact = load(base, again=True, graph=graph)
    if artifact is None:
        build(base, log=log, graph=graph)
        artifact = load(base, again=True, graph=graph)
        if artifact is None:
            raise RuntimeError("the artifact just built did not load")
    return artifact


def preload(base, generation_config=None) -> None:
    """Load `base`'s artifact now (at `from_pretrained`) when its generation config compiles and one is built, so the
    first `generate()` runs at full speed; nothing when none is built (`HF_BPD_OFF=artifacts`: never)."""
    if getattr(generation_config, "compile", False) and enabled():
        load(base)


def forget(base) -> None:
    _LOADED.pop(base, None)


def listing() -> list[dict]:
    """Every graph of every artifact in the cache: its record and directory."""
    found = []
    records = [name for _, name, _ in _FILES.values()]
    for key_file in sorted(f for name in records for f in artifacts_dir().glob(f"*/{name}")):
        try:
            found.append({"graph": STEP, **json.loads(key_file.read_text()), "path": str(key_file.parent)})
        except (OSError, ValueError):
            found.append({"path": str(key_file.parent), "broken": True})
    return found


def clear() -> int:
    """Remove every artifact folder (named by its key's digest) that no one is building, each under its lock; leaves
    anything else alone. Returns how many were removed."""
    import re

    root = artifacts_dir()
    if not root.is_dir() or distrusted(root):
        return 0
    removed = 0
    for folder in sorted(root.iterdir()):
        if not re.fullmatch(r"[0-9a-f]{20}", folder.name) or folder.is_symlink() or not folder.is_dir():
            continue
        lock = claim_lock(folder)
        if lock is None:  # a build under way keeps its folder
            continue
        with lock:
            shutil.rmtree(folder)
        removed += 1
    return removed
