"""Instruction data: prompts and ShareGPT/Vicuna or Alpaca conversations from JSON, JSONL (optionally gzipped) or text
files.

* `load_prompts(path)`: prompts from Alpaca-style (`instruction`, `input`), GSM8K (`question`), MT-bench
  (`turns`), ShareGPT (`conversations`, first human turn) or plain-text files.
* `conversation_messages(record)`: a ShareGPT (`{"conversations": [{"from": "human"|"gpt", "value": ...}]}`) or
  Alpaca (`instruction`/`input`/`output`) record as a list of `{"role", "content"}` messages.
* `tokenize_conversation(tokenizer, messages)`: chat-template token ids and labels that train on assistant tokens only.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path


ROLE = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
        "system": "system", "bard": "assistant", "bing": "assistant"}


def _records(path: str | Path) -> list[dict]:
    """The records of a JSON array or JSONL file (`.gz` too), every record with every key any record has (missing
    ones None, as `datasets` gives them); any other file: one `{"text": line}` per non-empty line."""
    path = str(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    if not path.removesuffix(".gz").endswith((".json", ".jsonl")):
        return [{"text": line} for line in text.splitlines() if line.strip()]
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.split("\n") if line.strip()]
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not a JSON array or JSON lines file ({err}): pass Alpaca/ShareGPT/MT-bench "
                         "records") from None
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: every record must be a JSON object")
    keys = dict.fromkeys(k for row in rows for k in row)
    return [{k: row.get(k) for k in keys} for row in rows]


def record_prompt(record: dict) -> str | None:
    """The user prompt of one record in any supported layout (None when it has none)."""
    if record.get("instruction"):
        extra = record.get("input") or ""
        if not extra and record.get("instances"):
            extra = record["instances"][0].get("input") or ""
        return record["instruction"].strip() + ("\n\n" + extra.strip() if extra.strip() else "")
    if record.get("question"):
        return record["question"].strip()
    if record.get("turns"):
        return record["turns"][0].strip()
    if record.get("conversations"):
        first = next((t for t in record["conversations"] if ROLE.get(t.get("from")) == "user"), None)
        return first["value"].strip() if first else None
    if record.get("prompt"):
        return record["prompt"].strip()
    if record.get("text"):
        return record["text"].strip()
    return None


def prompt_id(source: str, prompt: str) -> str:
    return f"{source}-{hashlib.sha1(prompt.encode()).hexdigest()[:12]}"


def load_prompts(path: str | Path, source: str | None = None) -> list[dict]:
    """`[{"id", "source", "prompt", "category"}]` from one file; ids are stable hashes of the prompt text."""
    source = source or Path(path).stem
    out, seen = [], set()
    for record in _records(path):
        prompt = record_prompt(record)
        if not prompt or prompt in seen:
            continue
        seen.add(prompt)
        ident = record.get("question_id") or (record.get("id") if isinstance(record.get("id"), str) else None)
        out.append({"id": ident or prompt_id(source, prompt), "source": record.get("source") or source,
                    "prompt": prompt, "category": record.get("category") or source})
    return out


def held_out_prompts(paths) -> set[str]:
    """The prompts of the given prompt files (the benchmark, dev and tuning prompts): never trained on."""
    return {r["prompt"] for path in paths for r in load_prompts(path)}


def conversation_messages(record: dict) -> list[dict]:
    """A ShareGPT or Alpaca record as chat messages."""
    if record.get("conversations"):
        return [{"role": ROLE.get(t["from"], t["from"]), "content": t["value"]} for t in record["conversations"]]
    if record.get("instruction") and (record.get("output") or record.get("response")):
        answer = record.get("output") or record.get("response")
        return [{"role": "user", "content": record_prompt(record)}, {"role": "assistant", "content": answer}]
    if record.get("question") and record.get("answer"):  # GSM8K: drop the <<calculator>> annotations
        answer = re.sub(r"<<[^>]*>>", "", record["answer"]).replace("####", "The answer is")
        return [{"role": "user", "content": record["question"]}, {"role": "assistant", "content": answer}]
    raise ValueError(f"record has neither 'conversations' nor 'instruction'/'output': {sorted(record)[:6]}")


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int = 1024) -> dict:
    """`{"input_ids", "labels"}` for one conversation; labels are -100 except on assistant turns' tokens.

    Each assistant turn's tokens are found by rendering the conversation up to that turn with and without it: the
    chat template decides what the assistant says (including its end-of-turn token). A tokenizer without a chat
    template (a pretrained base such as gemma-3-270m) gets the plain-text form `hf-bpd bench` prompts it with: the
    turns joined by blank lines, the last assistant turn ended by EOS (`plain_conversation`).
    """
    if not getattr(tokenizer, "chat_template", None):
        return plain_conversation(tokenizer, messages, max_length)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    labels = [-100] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True,
                                               return_dict=False)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False)
        before = before if isinstance(before, list) else before["input_ids"]
        upto = upto if isinstance(upto, list) else upto["input_ids"]
        for j in range(len(before), min(len(upto), len(ids))):
            labels[j] = ids[j]
    return {"input_ids": ids[:max_length], "labels": labels[:max_length]}


def plain_conversation(tokenizer, messages: list[dict], max_length: int = 1024) -> dict:
    """`tokenize_conversation` without a chat template: BOS, then the turns' texts joined by blank lines (what
    `hf_bpd.evaluation.bench.encode_messages(chat=False)` prompts with); an assistant turn's tokens (its leading
    blank line included) are labels, and so is an EOS after the last assistant turn."""
    ids = list(tokenizer("", add_special_tokens=True)["input_ids"])  # BOS where the tokenizer adds one
    labels = [-100] * len(ids)
    for i, message in enumerate(messages):
        piece = tokenizer(("\n\n" if i else "") + message["content"], add_special_tokens=False)["input_ids"]
        if message["role"] == "assistant" and i == len(messages) - 1 and tokenizer.eos_token_id is not None:
            piece = piece + [tokenizer.eos_token_id]
        ids += piece
        labels += piece if message["role"] == "assistant" else [-100] * len(piece)
    return {"input_ids": ids[:max_length], "labels": labels[:max_length]}
