"""Stopping inside a block: plain decoding checks its stopping criteria after every token, a drafted step accepts
several tokens at once, so the criteria are applied at every prefix of what a step accepted."""

from __future__ import annotations

import torch
from transformers.generation import StoppingCriteriaList, StopStringCriteria

from ..errors import BPDConfigError


class StopGuard:
    """Finds the first length at which plain decoding would have stopped (max length, EOS, a stop string, a custom
    criterion), so the output is cut exactly there."""

    def __init__(self, criteria: StoppingCriteriaList, prompt_length: int):
        self.criteria = criteria
        self.checked = prompt_length
        self.stop_length: int | None = None

    def first_stop(self, sequence: torch.LongTensor) -> int | None:
        while self.stop_length is None and self.checked < sequence.shape[1]:
            self.checked += 1
            if bool(self.criteria(sequence[:, : self.checked], None).any()):
                self.stop_length = self.checked
        return self.stop_length


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
