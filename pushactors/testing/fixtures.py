"""Pytest fixtures for pushactors. Enable with ``pytest_plugins = ["pushactors.testing.fixtures"]``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..logs import EventCapture, capture_events
from ..transport.directory import InProcessDirectory
from .fabric import FakeFabric
from .pair import PushPair
from .probe import ProbeSet


@pytest.fixture
def fake_fabric() -> Iterator[FakeFabric]:
    """A fresh fake NIXL fabric (what is due at teardown is still delivered)."""
    fabric = FakeFabric()
    yield fabric
    fabric.progress()


@pytest.fixture
def directory() -> InProcessDirectory:
    return InProcessDirectory()


@pytest.fixture
def events() -> Iterator[EventCapture]:
    """Every pushactors event emitted during the test."""
    with capture_events() as captured:
        yield captured


@pytest.fixture
def probes() -> Iterator[ProbeSet]:
    """Recording stand-ins for a rank's four actors, plus a context wired to them."""
    ps = ProbeSet()
    yield ps
    ps.stop()


@pytest.fixture
def push_pair(fake_fabric: FakeFabric) -> Iterator[PushPair]:
    """A P engine and a D engine (TP=1) in this process over ``fake_fabric``."""
    pair = PushPair(fabric=fake_fabric, lease_duration=30.0)
    yield pair
    pair.close()
