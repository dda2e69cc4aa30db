"""Stopping inside a block: plain decoding checks its stopping criteria after every token, a drafted step accepts
several tokens at once, so the criteria are applied at every prefix of what a step accepted."""

from __future__ import annotations

import torch
from transformers.generation import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList, StopStringCriteria

from ..errors import BPDConfigError


class StopGuard:
    """Finds the first length at which plain decoding would have stopped (max length, EOS, a stop string, a custom
    criterion), so the output is cut exactly there."""

    def __init__(self, criteria: StoppingCriteriaList, prompt_length: int):
        self.criteria = criteria
        self.checked = prompt_length
        self.stop_length: int | None = None
        # The usual criteria, a maximum length and end-of-sequence tokens, are checked on the new token ids
        # themselves (as they decide: length >= max_length, or the prefix's last token is an EOS); any other
        # criterion is called on every prefix.
        self.max_length, self.eos = None, set()
        self.simple = all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in criteria)
        for c in criteria if self.simple else ():
            if type(c) is MaxLengthCriteria:
                self.max_length = c.max_length if self.max_length is None else min(self.max_length, c.max_length)
            else:
                self.eos.update(int(t) for t in torch.as_tensor(c.eos_token_id).flatten().tolist())

    def first_stop(self, sequence: torch.LongTensor, new_tokens: list[int] | None = None) -> int | None:
        """The length at which decoding stops, once `sequence` `(1, length)` reaches it (None until then);
        `new_tokens` are the ids `sequence` ends with that were not checked yet (read from `sequence` if not
        given)."""
        if self.simple and self.stop_length is None:
            if new_tokens is None or len(new_tokens) != sequence.shape[1] - self.checked:
                new_tokens = sequence[0, self.checked:].tolist()
            for token in new_tokens:
                self.checked += 1
                if (self.max_length is not None and self.checked >= self.max_length) or token in self.eos:
                    self.stop_length = self.checked
                    break
            return self.stop_length
        while self.stop_length is None and self.checked < sequence.shape[1]:
            self.checked += 1
            if bool(self.criteria(sequence[:, : self.checked], None).any()):
                self.stop_length = self.checked
        return self.stop_length


class DecodedSequence:
    """A sequence as decoding grows it, one step's accepted tokens at a time, cut at the first length where plain
    decoding would have stopped (`StopGuard`). Keeps each kept token's processed scores and raw logits when asked,
    and feeds a streamer what was kept (the prompt first; `end()` at the stop).

    `pad` left-padding tokens (a batch row) stay in `sequence`, which processors and criteria see as in transformers'
    batched decoding; `tokens` is the row's own."""

    def __init__(self, prompt: torch.LongTensor, criteria: StoppingCriteriaList, keep_scores: bool = False,
                 keep_logits: bool = False, streamer=None, pad: int = 0):
        self.sequence, self.pad = prompt, pad  # (1, length)
        self.guard = StopGuard(criteria, prompt.shape[1])
        self.keep_scores, self.keep_logits = keep_scores, keep_logits
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.streamer = streamer
        self._tokens: list[int] = prompt[0, pad:].tolist()
        if streamer is not None:
            streamer.put(prompt[:, pad:].cpu())

    @property
    def stopped(self) -> bool:
        return self.guard.stop_length is not None

    @property
    def tokens(self) -> list[int]:
        """The sequence's own tokens (no padding): what drafters and rescorers read (kept as a list, not to be
        changed)."""
        return self._tokens

    def accept(self, tokens: list[int], step_logits: list[torch.Tensor], step_scores: list[torch.Tensor]) -> None:
        """Append one step's decoded tokens (with their raw and processed logits), up to the first stop."""
        start = self.sequence.shape[1]
        new = torch.tensor([tokens], dtype=self.sequence.dtype, device=self.sequence.device)
        self.sequence = torch.cat([self.sequence, new], dim=1)
        stop = self.guard.first_stop(self.sequence, tokens)
        if stop is not None:
            self.sequence = self.sequence[:, :stop]
        kept = self.sequence.shape[1] - start
        self._tokens.extend(tokens[:kept])
        if self.keep_scores:
            self.scores.extend(step_scores[:kept])
        if self.keep_logits:
            self.logits.extend(step_logits[:kept])
        if self.streamer is not None:
            if kept > 0:
                self.streamer.put(self.sequence[0, start:].cpu())
            if stop is not None:
                self.streamer.end()


def stop_strings_as_criteria(kwargs: dict, generation_config, model_config) -> None:
    """`stop_strings` (+ `tokenizer`) as a `StopStringCriteria` in `stopping_criteria`: transformers hands a
    `custom_generate` callable no tokenizer, so the criterion is built here, exactly as plain decoding builds it."""
    tokenizer = kwargs.pop("tokenizer", None)
    if "stop_strings" in kwargs:
        stop_strings = kwargs["stop_strings"]
    else:
        stop_strings = getattr(generation_config, "stop_strings", None) if generation_config is not None else None
        if stop_strings is None:
            stop_strings = getattr(model_config, "stop_strings", None)
    if stop_strings is None:
        return
    if tokenizer is None:
        raise BPDConfigError("stop_strings need the model's tokenizer: pass tokenizer=... to generate()")
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None
