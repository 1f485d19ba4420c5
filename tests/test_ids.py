"""base_request_id (docs/protocol.md, 'Matching'): strip exactly one trailing "-" + 8 hex digits,
anchored at the end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushactors.core.ids import base_request_id

HEX = "0123456789abcdefABCDEF"
hex8 = st.text(alphabet=HEX, min_size=8, max_size=8)


@pytest.mark.parametrize(
    ("request_id", "base"),
    [
        ("cmpl-abc-1a2b3c4d", "cmpl-abc"),
        ("cmpl-abc-DEADBEEF", "cmpl-abc"),  # upper case
        ("cmpl-abc-DeAdBeEf", "cmpl-abc"),  # mixed case
        ("cmpl-abc-00000000", "cmpl-abc"),  # digits only
        ("-12345678", ""),  # nothing but the suffix
        ("x--12345678", "x-"),  # only one dash belongs to the suffix
        # exactly ONE suffix is stripped, even when the base looks like it has another
        ("req-11111111-22222222", "req-11111111"),
    ],
)
def test_strips_one_engine_suffix(request_id: str, base: str) -> None:
    assert base_request_id(request_id) == base


@pytest.mark.parametrize(
    "request_id",
    [
        "cmpl-abc",  # no suffix
        "",
        "plain",
        "cmpl-abc-1a2b3c4",  # 7 hex digits
        "cmpl-abc-1a2b3c4d5",  # 9 hex digits
        "cmpl-abc-1a2b3c4g",  # non-hex digit
        "cmpl-abc-zzzzzzzz",
        "cmpl-abc1a2b3c4d",  # no dash before the 8 hex digits
        "cmpl-abc_1a2b3c4d",  # other separator
        "cmpl-abc-1a2b3c4d-x",  # suffix not at the end
        "cmpl-abc-1a2b3c4d\n",  # anchored at the very end: a trailing newline is not the end
        "cmpl-abc-1a2b 3c4d",
        "cmpl-abc-\uff11\uff12\uff13\uff14\uff15\uff16\uff17\uff18",  # full-width digits are not hex
        "12345678",  # 8 hex digits but no dash
    ],
)
def test_ids_without_a_suffix_are_unchanged(request_id: str) -> None:
    assert base_request_id(request_id) == request_id


def test_sub_requests_keep_their_completion_index_apart() -> None:
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-1-1a2b3c4d") == "cmpl-abc-1"
    assert base_request_id("cmpl-abc-0-1a2b3c4d") != base_request_id("cmpl-abc-1-1a2b3c4d")
    # P's and D's ids of one sub-request differ only in the per-engine suffix
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == base_request_id("cmpl-abc-0-ffffeeee")


@settings(max_examples=200, deadline=None)
@given(s=st.text(max_size=40), h=hex8)
def test_appending_a_suffix_then_stripping_it_is_identity(s: str, h: str) -> None:
    assert base_request_id(s + "-" + h) == s


@settings(max_examples=200, deadline=None)
@given(s=st.text(max_size=40), h1=hex8, h2=hex8)
def test_two_engines_suffixes_share_a_base(s: str, h1: str, h2: str) -> None:
    assert base_request_id(f"{s}-{h1}") == base_request_id(f"{s}-{h2}")


@settings(max_examples=200, deadline=None)
@given(s=st.text(max_size=60))
def test_base_is_a_prefix_and_at_most_nine_chars_shorter(s: str) -> None:
    b = base_request_id(s)
    assert s.startswith(b)
    assert len(s) - len(b) in (0, 9)
    if len(b) != len(s):
        tail = s[len(b) :]
        assert tail[0] == "-"
        assert all(c in HEX for c in tail[1:])


@settings(max_examples=200, deadline=None)
@given(s=st.text(max_size=40), n=st.integers(min_value=0, max_value=16).filter(lambda n: n != 8))
def test_other_hex_lengths_are_never_stripped_alone(s: str, n: int) -> None:
    # a suffix of n != 8 hex digits after a non-hex char is never stripped
    rid = s + "-x" + "-" + "a" * n
    assert base_request_id(rid) == rid
