from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from nodes_kit import Cluster, Recorder

pytest_plugins = ["pushactors.testing.fixtures"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long soak/fuzz runs (marked ``slow``) run only with PUSHACTORS_LONG=1; CI runs the short
    variants. They are deselected, not skipped: nothing that runs is hidden."""
    if os.environ.get("PUSHACTORS_LONG") == "1":
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@functools.cache
def nixl_missing() -> str | None:
    from pushactors.transport.nixl import NixlUnavailable, import_nixl_api

    try:
        import_nixl_api()
    except NixlUnavailable as exc:
        return str(exc)
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The one NIXL guard: a test marked ``real_nixl`` is skipped where NIXL cannot be imported,
    and fails instead where PUSHACTORS_REQUIRE_NIXL is set (CI that must run them)."""
    if item.get_closest_marker("real_nixl") is None:
        return
    missing = nixl_missing()
    if missing is None:
        return
    if os.environ.get("PUSHACTORS_REQUIRE_NIXL"):
        pytest.fail(f"PUSHACTORS_REQUIRE_NIXL is set but NIXL cannot be imported: {missing}", pytrace=False)
    pytest.skip("NIXL is not installed")


@pytest.fixture
def rec() -> Recorder:
    """Every report of the test's node processes (tests/nodes_kit.py)."""
    from nodes_kit import Recorder

    return Recorder()


@pytest.fixture
def cluster(rec: Recorder) -> Iterator[Cluster]:
    """Starts the test's node processes; none outlives the test."""
    from nodes_kit import Cluster

    c = Cluster(rec)
    try:
        yield c
    finally:
        c.close()
