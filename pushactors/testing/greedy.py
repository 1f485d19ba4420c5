"""Compare two greedy completions of one prompt, where bf16 arithmetic may break a tie.

An engine test checks that D's tokens with pushed KV equal D's tokens with local prefill. With a
small bf16 model the top two logits are sometimes exactly equal: bf16 keeps 8 significant bits,
so a logit is only known to about 0.4%. Two correct runs whose arithmetic differs in the last bit
(another batch composition, KV read from the cache instead of computed in the same step) can then
pick different tokens at that position, and everything after it differs. CI saw that once in a
test that freezes P (D then receives many requests' KV in one burst); the reference showed the two
tokens tied to the last digit.

So a completion agrees with its reference when every position before the first differing token
has the same token with nearly the same log-probability, and at that position the two tokens are
tied within ``tol`` in both runs. Wrong KV moves log-probabilities far more than a rounding step,
and a corrupted position almost never sits exactly on a tie in both runs.

Ask the engine for ``logprobs`` (5 here, ``LOGPROB_FIELDS``) and ``return_tokens_as_token_ids`` (token strings of
byte-level pieces are not unique) so each position carries its alternatives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# About four bf16 rounding steps of a logit near 1 (2**-7 each): far below what a wrong key or
# value does to a distribution, above what reordered arithmetic does.
TIE_TOLERANCE = 0.03

# The request fields that make an OpenAI-style completion carry what ``disagreement`` reads. Five
# alternatives, not two: a tiny model's flat distribution can tie three tokens, and a run whose
# pick ranks third in the other run must still be told apart from wrong KV (CI saw that once).
LOGPROB_FIELDS: dict[str, Any] = {"logprobs": 5, "return_tokens_as_token_ids": True}


@dataclass(frozen=True)
class Greedy:
    """One completion's tokens, each with its log-probability and the top alternatives."""

    text: str
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    top: tuple[Mapping[str, float], ...]


def from_choice(choice: Mapping[str, Any]) -> Greedy:
    """From one ``choices[i]`` of a (non-streamed) completion response."""
    return _build(str(choice.get("text") or ""), [choice.get("logprobs")])


def from_chunks(chunks: Iterable[Mapping[str, Any]]) -> Greedy:
    """From the ``choices[0]`` of each event of a streamed completion, in order."""
    texts: list[str] = []
    parts: list[Any] = []
    for choice in chunks:
        texts.append(str(choice.get("text") or ""))
        parts.append(choice.get("logprobs"))
    return _build("".join(texts), parts)


def _build(text: str, parts: list[Any]) -> Greedy:
    tokens: list[str] = []
    logprobs: list[float] = []
    top: list[Mapping[str, float]] = []
    for part in parts:
        if not part:
            continue
        tokens += [str(t) for t in part.get("tokens") or ()]
        logprobs += [float(x) for x in part.get("token_logprobs") or ()]
        top += [dict(t or {}) for t in part.get("top_logprobs") or ()]
    if not (len(tokens) == len(logprobs) == len(top)):
        raise ValueError(f"logprobs missing or ragged: {len(tokens)} tokens, {len(logprobs)}, {len(top)}")
    return Greedy(text, tuple(tokens), tuple(logprobs), tuple(top))


def disagreement(got: Greedy, want: Greedy, *, tol: float = TIE_TOLERANCE) -> str | None:
    """Why ``got`` is not ``want`` up to a tie broken the other way; None when they agree."""
    if not want.tokens and want.text:
        raise ValueError("the reference carries no logprobs: ask for LOGPROB_FIELDS")
    if len(got.tokens) != len(want.tokens):
        return f"{len(got.tokens)} tokens, the reference has {len(want.tokens)}"
    for i, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=True)):
        if a == b:
            if abs(got.logprobs[i] - want.logprobs[i]) > tol:
                return f"token {i} ({a}): logprob {got.logprobs[i]:.5f}, the reference {want.logprobs[i]:.5f}"
            continue
        # The first differing token: a tie in both runs, or wrong.
        for name, run in (("this run", got), ("the reference", want)):
            alts = run.top[i]
            if a not in alts or b not in alts:
                return f"token {i}: {a} vs {b}, not both among the top tokens of {name}"
            if abs(alts[a] - alts[b]) > tol:
                return f"token {i}: {a} vs {b}, {abs(alts[a] - alts[b]):.5f} apart in {name} (not a tie)"
        return None
    return None
