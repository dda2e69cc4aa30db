"""The paper's Section 6 analyses of block drafts, and drivers that collect them from a model on a prompt file.

Plain functions on drafts, entropies and lattices (no model needed):

* `consecutive_repetition(blocks)`: % of consecutive identical draft tokens and mean maximum repeated run (Table 3);
* `entropy(logits)`, `h_max(mean_entropies)`: per-head confidence (Fig. 3a) and the last head up to which mean
  entropy rises monotonically (Fig. 3b);
* `oracle_accepted(lattice, reference, ks)` and `simulated_block_efficiency(accepted)`: oracle top-k block
  efficiency as a function of k (Fig. 6);
* `wins_ties_losses(...)`: rescored vs vanilla drafts by accepted length, with % repair / % regress of repetitions
  (Table 5).

Drivers: `analyze_prompt(model, input_ids, ...)` decodes the base greedily once, runs one forward over the whole
reference sequence (every hidden state at once) and evaluates every decoding step `j` of that reference: the block
that step would draft from the hidden state that produced new token `j`. `summarize(...)` turns the per-step records
into the tables; `markdown_tables`, `plot_analysis` render them.

Conventions (the paper's, mapped onto hf_bpd's heads):

* A *block* is the base's own next token `y[j]` followed by the draft (head `i` drafts `y[j + 1 + i]`): the paper's
  block draft of h tokens, whose first token is the base LM's (its "head 1"). Repetition is measured on blocks.
* Entropies are listed in the paper's head order: index 0 is the base's next-token distribution (the paper's head
  1), index `i` is hf_bpd head `i` (0-based `i - 1`). `h_max` is 1-based in that order.
* Block efficiency is tokens per serial call, the prompt pass counted as a call that decodes one token
  (`GenerationStats`' convention), so a decode where every step accepts `a` draft tokens has
  `N / (1 + ceil((N - 1) / (a + 1)))`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..lattice import Lattice

DEFAULT_TOP_KS = (1, 2, 4, 8, 16)


# ------------------------------------------------------------------ repetition (Table 3)
def max_run(tokens: Sequence[int]) -> int:
    """Length of the longest run of identical consecutive tokens (1 for a block with no repetition, 0 if empty)."""
    best = run = 0
    previous = object()
    for token in tokens:
        run = run + 1 if token == previous else 1
        best = max(best, run)
        previous = token
    return best


def has_repetition(tokens: Sequence[int]) -> bool:
    """Whether any two consecutive tokens are identical."""
    return max_run(tokens) > 1


def consecutive_repetition(blocks: Iterable[Sequence[int]]) -> dict:
    """Table 3's statistics over block drafts.

    Returns `{"blocks", "pairs", "repeated_pairs", "consec_pct", "mean_max_run"}`: `consec_pct` is the percentage
    of consecutive token pairs (within a block) that are identical, `mean_max_run` the mean over blocks of the
    longest repeated run (upper bound: the block length).
    """
    blocks = [list(b) for b in blocks]
    pairs = sum(max(len(b) - 1, 0) for b in blocks)
    repeated = sum(sum(1 for a, b in zip(block, block[1:]) if a == b) for block in blocks)
    return {
        "blocks": len(blocks),
        "pairs": pairs,
        "repeated_pairs": repeated,
        "consec_pct": 100.0 * repeated / pairs if pairs else 0.0,
        "mean_max_run": sum(max_run(b) for b in blocks) / len(blocks) if blocks else 0.0,
    }


# ------------------------------------------------------------------ confidence (Fig. 3)
def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of `softmax(logits)` over the last dimension: `(..., vocab)` -> `(...)`."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return (-(logprobs.exp() * logprobs).sum(-1)).clamp(min=0.0)


def h_max(mean_entropies: Sequence[float]) -> int:
    """The paper's `h_max = max{k : for all i < k, H[i] <= H[i + 1]}` (1-based): the last head up to which the mean
    entropy rises monotonically. 0 for no heads."""
    values = list(mean_entropies)
    if not values:
        return 0
    k = 1
    while k < len(values) and values[k - 1] <= values[k]:
        k += 1
    return k


# ------------------------------------------------------------------ acceptance and oracle (Fig. 6)
def accepted_length(draft: Sequence[int], reference: Sequence[int]) -> int:
    """Draft tokens the verifier accepts: the longest common prefix of `draft` and the base's greedy `reference`."""
    n = 0
    for a, b in zip(draft, reference):
        if int(a) != int(b):
            break
        n += 1
    return n


def truncate_lattice(lattice: Lattice, k: int) -> Lattice:
    """The top-`k` lattice inside a wider one (rows are sorted best first)."""
    return Lattice(lattice.tokens[:, :k], lattice.logprobs[:, :k])


def oracle_accepted(lattice: Lattice, reference: Sequence[int], ks: Sequence[int]) -> dict[int, int]:
    """`{k: length of the longest prefix of reference inside the top-k lattice}` (`Lattice.oracle_path`)."""
    return {int(k): len(truncate_lattice(lattice, min(int(k), lattice.k)).oracle_path(list(reference)))
            for k in ks}


def simulated_steps(accepted: Sequence[int], new_tokens: int | None = None) -> list[int]:
    """The decoding steps a decode visits when the step after new token `j` accepts `accepted[j]` draft tokens.

    `accepted[j]` (j = 0 .. N-1) is what the block drafted from the hidden state that produced new token `j` would
    get accepted. The prompt pass decodes token 0; each verification call decodes the accepted tokens plus one of
    its own. Returns the `j` of every verification call, in order.
    """
    n = len(accepted) if new_tokens is None else new_tokens
    decoded, steps = min(n, 1), []
    while decoded < n:
        j = decoded - 1
        steps.append(j)
        decoded += min(int(accepted[j]) + 1, n - decoded)
    return steps


def simulated_block_efficiency(accepted: Sequence[int], new_tokens: int | None = None) -> float:
    """Block efficiency (tokens per serial call, the prompt pass included) of a decode that accepts `accepted[j]`
    draft tokens at the step after new token `j` (see `simulated_steps`)."""
    n = len(accepted) if new_tokens is None else new_tokens
    if n <= 0:
        return 0.0
    return n / (1 + len(simulated_steps(accepted, n)))


# ------------------------------------------------------------------ rescored vs vanilla (Table 5)
def wins_ties_losses(vanilla_accepted: Sequence[int], rescored_accepted: Sequence[int],
                     vanilla_blocks: Sequence[Sequence[int]], rescored_blocks: Sequence[Sequence[int]]) -> dict:
    """Table 5: steps where the rescored draft is accepted further (win), as far (tie) or less far (loss) than the
    vanilla draft. For wins and losses, `repair_pct` is the % where the vanilla block repeats a token and the
    rescored one does not, `regress_pct` the % where the rescored block introduces a repetition."""
    if not len(vanilla_accepted) == len(rescored_accepted) == len(vanilla_blocks) == len(rescored_blocks):
        raise ValueError("wins_ties_losses needs one accepted length and one block per step for both drafts")
    out = {"ties": 0, "win": {"total": 0, "repair": 0, "regress": 0}, "loss": {"total": 0, "repair": 0, "regress": 0}}
    for va, ra, vb, rb in zip(vanilla_accepted, rescored_accepted, vanilla_blocks, rescored_blocks):
        if ra == va:
            out["ties"] += 1
            continue
        bucket = out["win" if ra > va else "loss"]
        bucket["total"] += 1
        v_rep, r_rep = has_repetition(vb), has_repetition(rb)
        bucket["repair"] += int(v_rep and not r_rep)
        bucket["regress"] += int(r_rep and not v_rep)
    for key in ("win", "loss"):
        bucket = out[key]
        bucket["repair_pct"] = 100.0 * bucket["repair"] / bucket["total"] if bucket["total"] else 0.0
        bucket["regress_pct"] = 100.0 * bucket["regress"] / bucket["total"] if bucket["total"] else 0.0
    return out


# ------------------------------------------------------------------ collecting from a model
@dataclass
class PromptAnalysis:
    """Per-step records of one prompt's greedy reference continuation `new_tokens` (N tokens).

    Step `j` (0 .. N-2) drafts from the hidden state that produced new token `j`; its reference is
    `new_tokens[j + 1:]`. `entropies[j]` = [base, head 1, ..., head h]; `oracle[k][j]` = oracle accepted length in
    the top-k lattice; `rescored_*` are empty without a rescorer.
    """

    id: str
    category: str
    new_tokens: list[int]
    vanilla_drafts: list[list[int]] = field(default_factory=list)
    vanilla_accepted: list[int] = field(default_factory=list)
    rescored_drafts: list[list[int]] = field(default_factory=list)
    rescored_accepted: list[int] = field(default_factory=list)
    entropies: list[list[float]] = field(default_factory=list)
    oracle: dict[int, list[int]] = field(default_factory=dict)

    def blocks(self, drafts: list[list[int]]) -> list[list[int]]:
        """The base's next token followed by each step's draft."""
        return [[self.new_tokens[j]] + list(d) for j, d in enumerate(drafts)]

    def as_dict(self) -> dict:
        return {
            "id": self.id, "category": self.category, "new_tokens": self.new_tokens,
            "vanilla_drafts": self.vanilla_drafts, "vanilla_accepted": self.vanilla_accepted,
            "rescored_drafts": self.rescored_drafts, "rescored_accepted": self.rescored_accepted,
            "entropies": [[round(e, 5) for e in row] for row in self.entropies],
            "oracle": {str(k): v for k, v in self.oracle.items()},
        }


@torch.no_grad()
def teacher_forced_heads(model, reference: torch.Tensor, prompt_length: int, num_heads: int, chunk: int = 32):
    """The heads on a greedy output, teacher-forced: `(base logits (steps, vocab), chunks)` for `reference`
    `(1, seq)` whose first `prompt_length` tokens are the prompt, where `chunks` yields `(start, head logits (heads,
    n, draft vocab))` for positions `start .. start + n - 1` in chunks of `chunk`. Position `j` is the hidden state
    after new token `j` (it predicts new token `j + 1` with the base, `j + 2 + i` with head `i`). One base forward
    over the output gives every hidden state; sequential heads read the output's tokens (a head's draft only counts
    when every earlier one was accepted, i.e. equal to the output: then it read exactly what it would at decoding).
    """
    steps = reference.shape[1] - prompt_length - 1
    out = model(reference[:, : prompt_length - 1 + steps], return_head_logits=False)
    hidden = out.last_hidden_state[0, prompt_length - 1:]

    def chunks():
        for start in range(0, steps, chunk):
            first = prompt_length - 1 + start
            tokens = reference[:, first: first + chunk + num_heads + 1]
            yield start, model.heads(hidden[None, start: start + chunk], num_heads, tokens=tokens)[0]

    return out.logits[0, prompt_length - 1:], chunks()


def analyze_prompt(model, input_ids: torch.Tensor, max_new_tokens: int, top_ks: Sequence[int] = DEFAULT_TOP_KS,
                   rescorer=None, rescore_top_k: int = 16, attention_mask: torch.Tensor | None = None,
                   prompt_id: str = "", category: str = "", reference: torch.Tensor | None = None,
                   chunk: int = 32) -> PromptAnalysis:
    """Every Section 6 statistic for one prompt `input_ids` `(1, prompt_len)` and a `BlockwiseParallelForCausalLM`.

    The reference is the base's greedy continuation (`model.base_lm.generate`, or `reference` `(1, seq)` when
    given). One forward over the reference gives every hidden state; the heads read them in chunks of `chunk`
    positions. `rescorer` (a `hf_bpd.Rescorer`, or None) picks a draft from each step's top-`rescore_top_k` lattice.
    """
    prompt_length = input_ids.shape[1]
    if reference is None:
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        reference = model.base_lm.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    sequence = reference[0].tolist()
    new = sequence[prompt_length:]
    record = PromptAnalysis(id=prompt_id, category=category, new_tokens=new)
    ks = sorted({int(k) for k in top_ks})
    record.oracle = {k: [] for k in ks}
    steps = len(new) - 1
    if steps <= 0:
        return record
    num_heads = model.config.num_heads
    width = min(max(ks + ([rescore_top_k] if rescorer is not None else [])), model.config.draft_size)
    base_logits, chunks = teacher_forced_heads(model, reference, prompt_length, num_heads, chunk)
    base_entropy = entropy(base_logits)
    if rescorer is not None:
        rescorer.reset()
    for start, head_logits in chunks:  # (h, chunk, draft_vocab)
        head_entropy = entropy(head_logits)
        for offset in range(head_logits.shape[1]):
            j = start + offset
            truth = new[j + 1: j + 1 + num_heads]
            lattice = Lattice.from_head_logits(head_logits[:, offset], width, model.heads.to_vocab_ids)
            vanilla = lattice.tokens[:, 0].tolist()
            record.vanilla_drafts.append(vanilla)
            record.vanilla_accepted.append(accepted_length(vanilla, truth))
            record.entropies.append([float(base_entropy[j])] + head_entropy[:, offset].tolist())
            for k, length in oracle_accepted(lattice, truth, ks).items():
                record.oracle[k].append(length)
            if rescorer is not None:
                context = sequence[: prompt_length + j + 1]
                drafts = rescorer.rescore(truncate_lattice(lattice, min(rescore_top_k, lattice.k)), context, 1)
                draft = list(drafts[0].tokens) if drafts else []
                record.rescored_drafts.append(draft)
                record.rescored_accepted.append(accepted_length(draft, truth))
    return record


def _padded(accepted: list[int]) -> list[int]:
    # the last new token drafts nothing (decoding ends there): pad so accepted[j] exists for every token j
    return list(accepted) + [0]


def summarize(records: Sequence[PromptAnalysis]) -> dict:
    """Aggregate per-step records (all steps of all prompts) into the Section 6 tables for one group."""
    out: dict = {"prompts": len(records), "steps": sum(len(r.vanilla_accepted) for r in records),
                 "new_tokens": sum(len(r.new_tokens) for r in records)}
    def efficiency(accepted_of) -> float:
        calls = sum(1 + len(simulated_steps(_padded(accepted_of(r)), len(r.new_tokens)))
                    for r in records if r.new_tokens)
        return out["new_tokens"] / calls if calls else 0.0

    vanilla_blocks = [b for r in records for b in r.blocks(r.vanilla_drafts)]
    out["vanilla"] = {"block_efficiency": efficiency(lambda r: r.vanilla_accepted),
                      "repetition": consecutive_repetition(vanilla_blocks)}
    rescored = [r for r in records if r.rescored_accepted]
    if rescored and len(rescored) == len(records):
        rescored_blocks = [b for r in records for b in r.blocks(r.rescored_drafts)]
        out["rescored"] = {"block_efficiency": efficiency(lambda r: r.rescored_accepted),
                           "repetition": consecutive_repetition(rescored_blocks)}
        out["wins_ties_losses"] = wins_ties_losses(
            [a for r in records for a in r.vanilla_accepted], [a for r in records for a in r.rescored_accepted],
            vanilla_blocks, rescored_blocks)
    ks = sorted({k for r in records for k in r.oracle})
    out["oracle_block_efficiency"] = {str(k): efficiency(lambda r, k=k: r.oracle[k]) for k in ks}
    rows = [e for r in records for e in r.entropies]
    if rows:
        means = torch.tensor(rows).mean(0).tolist()
        out["entropy"] = {"mean": means, "h_max": h_max(means)}
    return out


def summarize_by_category(records: Sequence[PromptAnalysis]) -> dict[str, dict]:
    """`{"all": summarize(records), category: summarize(those), ...}` (categories only when there are several)."""
    groups: dict[str, list[PromptAnalysis]] = {}
    for r in records:
        groups.setdefault(r.category or "all", []).append(r)
    out = {"all": summarize(records)}
    if len(groups) > 1:
        out.update({name: summarize(rs) for name, rs in sorted(groups.items())})
    return out


# ------------------------------------------------------------------ rendering
def _table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_tables(summary: dict[str, dict], rescorer_name: str | None = None) -> str:
    """The Section 6 tables (repetition, confidence, oracle top-k, wins/ties/losses) as Markdown."""
    name = rescorer_name or "rescored"
    groups = list(summary.items())
    parts = []
    rows = []
    for group, s in groups:
        v = s["vanilla"]["repetition"]
        r = s.get("rescored", {}).get("repetition")
        rows.append([group, s["steps"], v["consec_pct"], r["consec_pct"] if r else "-", v["mean_max_run"],
                     r["mean_max_run"] if r else "-"])
    parts.append("### Consecutive repetition in block drafts (paper Table 3)\n\n" + _table(
        ["category", "steps", "% consec vanilla", f"% consec {name}", "max run vanilla", f"max run {name}"], rows))

    heads = max((len(s.get("entropy", {}).get("mean", [])) for _, s in groups), default=0)
    if heads:
        rows = [[g] + [float(x) for x in s["entropy"]["mean"]] + [s["entropy"]["h_max"],
                                                                 s["vanilla"]["block_efficiency"]]
                for g, s in groups if "entropy" in s]
        parts.append("### Mean entropy (nats) per head, paper order: 1 = the base's next token (Fig. 3)\n\n" + _table(
            ["category"] + [f"H[{i + 1}]" for i in range(heads)] + ["h_max", "block eff."], rows))

    ks = sorted({int(k) for _, s in groups for k in s["oracle_block_efficiency"]})
    rows = [[g, s["vanilla"]["block_efficiency"], s["rescored"]["block_efficiency"] if "rescored" in s else "-"]
            + [s["oracle_block_efficiency"].get(str(k), "-") for k in ks] for g, s in groups]
    parts.append("### Block efficiency: vanilla, rescored, oracle over the top-k lattice (Fig. 6)\n\n" + _table(
        ["category", "vanilla", name] + [f"oracle k={k}" for k in ks], rows))

    rows = []
    for g, s in groups:
        w = s.get("wins_ties_losses")
        if w:
            rows.append([g, w["ties"], w["win"]["total"], w["win"]["repair_pct"], w["win"]["regress_pct"],
                         w["loss"]["total"], w["loss"]["repair_pct"], w["loss"]["regress_pct"]])
    if rows:
        parts.append(f"### {name} vs vanilla drafts by accepted length (Table 5)\n\n" + _table(
            ["category", "ties", "wins", "win % repair", "win % regress", "losses", "loss % repair",
             "loss % regress"], rows))
    return "\n\n".join(parts) + "\n"


def plot_analysis(records: Sequence[PromptAnalysis], summary: dict[str, dict], directory) -> list[str]:
    """`entropy.png` (per-head entropy densities, Fig. 3a) and `oracle_topk.png` (Fig. 6) in `directory`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    rows = [e for r in records for e in r.entropies]
    if rows:
        values = torch.tensor(rows)
        fig, ax = plt.subplots(figsize=(6, 4))
        top = max(float(values.max()), 1e-3)
        for i in range(values.shape[1]):
            label = "head 1 (base)" if i == 0 else f"head {i + 1}"
            ax.hist(values[:, i].numpy(), bins=40, range=(0, top), density=True, histtype="step", label=label)
        ax.set_xlabel("entropy (nats)")
        ax.set_ylabel("density")
        ax.set_title("Entropy of each head's distribution")
        ax.legend()
        fig.tight_layout()
        fig.savefig(directory / "entropy.png", dpi=120)
        plt.close(fig)
        written.append(str(directory / "entropy.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for group, s in summary.items():
        curve = sorted((int(k), v) for k, v in s["oracle_block_efficiency"].items())
        if curve:
            ax.plot([k for k, _ in curve], [v for _, v in curve], marker="o", label=f"oracle ({group})")
    base = summary.get("all", next(iter(summary.values()), None))
    if base:
        ax.axhline(base["vanilla"]["block_efficiency"], color="gray", linestyle="--", label="vanilla (all)")
        if "rescored" in base:
            ax.axhline(base["rescored"]["block_efficiency"], color="black", linestyle=":", label="rescored (all)")
    ks = sorted({int(k) for s in summary.values() for k in s["oracle_block_efficiency"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set_xlabel("k (top-k lattice)")
    ax.set_ylabel("block efficiency")
    ax.set_title("Oracle top-k block efficiency")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(directory / "oracle_topk.png", dpi=120)
    plt.close(fig)
    written.append(str(directory / "oracle_topk.png"))
    return written


def run_analysis(model, tokenizer, questions: Sequence[dict], max_new_tokens: int,
                 top_ks: Sequence[int] = DEFAULT_TOP_KS, rescorer=None, rescore_top_k: int = 16,
                 chat: bool | None = None, progress: bool = True) -> list[PromptAnalysis]:
    """`analyze_prompt` on every question (`{"id", "category", "turns"}`, turn 1; see `hf_bpd.bench.load_questions`)."""
    from tqdm.auto import tqdm

    from .bench import encode_messages

    records = []
    for q in tqdm(questions, desc="analyze", disable=not progress):
        inputs = encode_messages(tokenizer, [{"role": "user", "content": q["turns"][0]}], chat, model.device)
        records.append(analyze_prompt(model, inputs["input_ids"], max_new_tokens, top_ks, rescorer, rescore_top_k,
                                      attention_mask=inputs.get("attention_mask"), prompt_id=str(q["id"]),
                                      category=q.get("category", "")))
    return records

