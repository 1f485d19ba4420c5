"""pushactors.testing.greedy: a tie broken the other way agrees, anything else does not."""

from __future__ import annotations

from typing import Any

import pytest

from pushactors.testing.greedy import Greedy, disagreement, from_choice, from_chunks


def choice(tokens: list[str], logprobs: list[float], top: list[dict[str, float]], text: str = "") -> dict[str, Any]:
    logprobs_field = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top}
    return {"text": text or "".join(tokens), "logprobs": logprobs_field}


# What CI's stalled-P run returned at the position where D's tokens left the reference: the
# reference's two best tokens tied to the last digit, the pushed run had them one rounding apart.
TIED_REF = choice(
    ["a", "b", "tie1"],
    [-4.1, -4.8580, -4.879996],
    [{"a": -4.1}, {"b": -4.8580}, {"tie1": -4.879996, "tie2": -4.879996}],
)
TIED_GOT = choice(
    ["a", "b", "tie2"],
    [-4.1, -4.8580, -4.879921],
    [{"a": -4.1}, {"b": -4.8580}, {"tie2": -4.879921, "tie1": -4.887734}],
)


def test_identical_completions_agree() -> None:
    g = from_choice(TIED_REF)
    assert disagreement(g, g) is None


def test_a_tie_broken_the_other_way_agrees() -> None:
    assert disagreement(from_choice(TIED_GOT), from_choice(TIED_REF)) is None


def test_a_different_token_that_is_no_tie_disagrees() -> None:
    got = choice(["a", "x"], [-4.1, -4.2], [{"a": -4.1}, {"x": -4.2, "y": -4.9}])
    want = choice(["a", "y"], [-4.1, -4.3], [{"a": -4.1}, {"y": -4.3, "x": -4.9}])
    why = disagreement(from_choice(got), from_choice(want))
    assert why is not None and "not a tie" in why


def test_a_tie_in_one_run_only_disagrees() -> None:
    # Tied where D computed it, clearly apart in the reference: the KV differed, not the rounding.
    got = choice(["a", "x"], [-4.1, -4.2], [{"a": -4.1}, {"x": -4.2, "y": -4.2}])
    want = choice(["a", "y"], [-4.1, -4.2], [{"a": -4.1}, {"y": -4.2, "x": -4.5}])
    why = disagreement(from_choice(got), from_choice(want))
    assert why is not None and "the reference" in why


def test_a_token_outside_the_alternatives_disagrees() -> None:
    got = choice(["a", "z"], [-4.1, -4.2], [{"a": -4.1}, {"z": -4.2, "x": -4.21}])
    want = choice(["a", "y"], [-4.1, -4.2], [{"a": -4.1}, {"y": -4.2, "x": -4.21}])
    why = disagreement(from_choice(got), from_choice(want))
    assert why is not None and "not both among the top tokens" in why


def test_the_same_tokens_with_moved_logprobs_disagree() -> None:
    # Wrong KV whose argmax happens to stay put still moves the distribution.
    got = choice(["a", "b"], [-4.1, -4.6], [{"a": -4.1}, {"b": -4.6}])
    want = choice(["a", "b"], [-4.1, -4.8], [{"a": -4.1}, {"b": -4.8}])
    why = disagreement(from_choice(got), from_choice(want))
    assert why is not None and why.startswith("token 1")


def test_another_length_disagrees() -> None:
    short = choice(["a"], [-4.1], [{"a": -4.1}])
    assert disagreement(from_choice(short), from_choice(TIED_REF)) is not None


def test_streamed_chunks_read_as_one_completion() -> None:
    chunks = [
        choice(["a"], [-4.1], [{"a": -4.1}]),
        {"text": "", "logprobs": None},  # an event without tokens (the final usage/finish event)
        choice(["b", "tie2"], [-4.8580, -4.879921], [{"b": -4.8580}, {"tie2": -4.879921, "tie1": -4.887734}]),
    ]
    streamed = from_chunks(chunks)
    assert streamed.tokens == ("a", "b", "tie2") and streamed.text == "abtie2"
    assert disagreement(streamed, from_choice(TIED_REF)) is None


def test_a_reference_without_logprobs_is_refused() -> None:
    bare = Greedy("text", (), (), ())
    with pytest.raises(ValueError, match="LOGPROB_FIELDS"):
        disagreement(from_choice(TIED_REF), bare)


def test_ragged_logprobs_are_refused() -> None:
    with pytest.raises(ValueError, match="ragged"):
        from_choice(choice(["a", "b"], [-4.1], [{"a": -4.1}]))
