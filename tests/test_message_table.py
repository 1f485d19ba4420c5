"""The per-actor message unions are exactly what each actor handles, and docs/architecture.md's
message table says the same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pushactors.actors.base import Peers
from pushactors.actors.handshake import Handshake
from pushactors.actors.matcher import Matcher
from pushactors.actors.reaper import Reaper
from pushactors.actors.stager import Stager
from pushactors.actors.writer.actor import Writer
from pushactors.protocol import (
    HANDSHAKE_MESSAGES,
    MATCHER_MESSAGES,
    REAPER_MESSAGES,
    STAGER_MESSAGES,
    WRITER_MESSAGES,
    BlocksFinished,
    ExpireLease,
)

ACTORS = {
    "writer": (Writer, WRITER_MESSAGES),
    "matcher": (Matcher, MATCHER_MESSAGES),
    "reaper": (Reaper, REAPER_MESSAGES),
    "handshake": (Handshake, HANDSHAKE_MESSAGES),
    "stager": (Stager, STAGER_MESSAGES),
}


@pytest.mark.parametrize("name", sorted(ACTORS))
def test_each_union_is_exactly_its_actors_handlers(name: str) -> None:
    cls, union = ACTORS[name]
    assert cls.message_types() == set(union)


def test_a_message_sent_to_the_wrong_actor_is_refused() -> None:
    peers = Peers()
    with pytest.raises(TypeError, match="matcher actor does not handle ExpireLease"):
        peers.to_matcher(ExpireLease(request_id="r"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="writer actor does not handle BlocksFinished"):
        peers.to_writer(BlocksFinished(request_id="r", block_ids=((1,),)))  # type: ignore[arg-type]


def test_the_architecture_doc_lists_every_message_of_every_actor() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    section = doc.split("## Messages by actor", 1)[1].split("\n## ", 1)[0]
    for name, (_, union) in ACTORS.items():
        row = next((line for line in section.splitlines() if line.startswith(f"| {name} ")), "")
        listed = set(re.findall(r"`(\w+)`", row))
        assert listed == {t.__name__ for t in union}, f"docs/architecture.md row for {name} is out of step"
