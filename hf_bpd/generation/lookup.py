"""Prompt-lookup drafts inside the lattice (`prompt_lookup=True`): a copy of the context competes with the heads.

Answers often repeat their context: names, numbers, code identifiers, the question's own words. Prompt lookup
(Saxena 2023; transformers' `prompt_lookup_num_tokens`) drafts the tokens that followed the latest earlier occurrence
of the context's last n-gram. Here that continuation joins the heads' drafts as one more path of the same step: the
verifier checks both in one pass (a two-branch draft tree), so the step keeps whichever the base agrees with longer.
"""

from __future__ import annotations

import numpy as np

MAX_LOOKUP_NGRAM = 3  # the longest suffix n-gram looked up (then shorter ones)
LOOKUP_WINDOW = 4096  # only the last this many tokens are searched (bounded work per step)


def prompt_lookup(context: list[int], num_tokens: int, max_ngram: int = MAX_LOOKUP_NGRAM,
                  min_ngram: int = 1) -> tuple[int, ...]:
    """The (up to) `num_tokens` tokens after the latest earlier occurrence of the context's last n-gram, trying
    n = `max_ngram` down to `min_ngram`; `()` when no n-gram recurs."""
    if num_tokens <= 0:
        return ()
    window = np.asarray(context[-LOOKUP_WINDOW:], dtype=np.int64)
    length = len(window)
    if length < 2:
        return ()
    ends = np.flatnonzero(window[:-1] == window[-1])[::-1]  # earlier positions holding the last token, latest first
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = window[length - n:]
        for end in ends:
            if end >= n - 1 and np.array_equal(window[end - n + 1: end + 1], suffix):
                return tuple(int(t) for t in window[end + 1: end + 1 + num_tokens])
    return ()
