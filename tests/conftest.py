import os

import pytest

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
