"""Layer-wise pushes (``push_mode = "layerwise"``): which of P's regions each group of layers
completes, how far one step's forward has come, and how far each request's KV is computed.

Plain classes, no threads: the worker feeds :class:`StepLayers` as the engine saves each
layer; the writer asks :class:`LayerReadiness` how many layer groups of a request it may WRITE.
A region holding several layers (a block-outermost allocation) belongs to the group of its
last layer: nothing of it is written before every layer in it is computed.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .blocks import KVLayout

_SPLIT = re.compile(r"(\d+)")
_HALF = re.compile(r"\[[01]\]$")


def layer_name(member: str) -> str:
    """A region member's layer: K and V halves of a split layer ("name[0]", "name[1]") are one."""
    return _HALF.sub("", member)


def _natural(name: str) -> tuple[tuple[int, Any], ...]:
    # "layers.10" after "layers.9": layer names carry their index.
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in _SPLIT.split(name) if p)


@dataclass(frozen=True)
class LayerGroups:
    """This rank's layers in forward order, cut into groups of ``per_group``; the group each
    local region is complete after."""

    names: tuple[str, ...]
    per_group: int
    group_of_region: tuple[int, ...]

    @property
    def count(self) -> int:
        return max(1, -(-len(self.names) // self.per_group))

    def group_of(self, name: str) -> int | None:
        i = self._index.get(layer_name(name))
        return None if i is None else i // self.per_group

    def size(self, g: int) -> int:
        """Layers in group ``g``."""
        return max(0, min(self.per_group, len(self.names) - g * self.per_group))

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    @classmethod
    def of(cls, layout: KVLayout, per_group: int, order: Sequence[str] | None = None) -> LayerGroups:
        """Groups of ``layout``'s layers; ``order``: the forward's order of layer names (default:
        by the numbers in the names, which is the forward order of vLLM's and our models)."""
        if per_group < 1:
            raise ValueError(f"layers per group must be >= 1, not {per_group}")
        seen: dict[str, None] = {}
        for region in layout.regions:
            for names in region.layer_names:
                for member in names:
                    seen.setdefault(layer_name(member), None)
        names = tuple(order) if order is not None else tuple(sorted(seen, key=_natural))
        missing = set(seen) - set(names)
        if missing:
            raise ValueError(f"layer order misses {sorted(missing)[:3]}")
        index = {n: i for i, n in enumerate(names)}
        last = max(0, -(-len(names) // per_group) - 1)
        groups: list[int] = []
        for region in layout.regions:
            members = [layer_name(m) for ns in region.layer_names for m in ns]
            # Unnamed memory is complete only when the whole forward is.
            groups.append(max((index[m] // per_group for m in members), default=last))
        return cls(names, per_group, tuple(groups))


class StepLayers:
    """One engine step's forward, layer by layer: how many leading groups are complete."""

    def __init__(self, groups: LayerGroups) -> None:
        self.groups = groups
        self._seen = [0] * groups.count
        self._names: set[str] = set()
        self.ready = 0

    def saved(self, name: str) -> int | None:
        """Layer ``name`` was saved; the new count of complete leading groups if it grew."""
        g = self.groups.group_of(name)
        base = layer_name(name)
        if g is None or base in self._names:
            return None
        self._names.add(base)
        self._seen[g] += 1
        before = self.ready
        while self.ready < self.groups.count and self._seen[self.ready] >= self.groups.size(self.ready):
            self.ready += 1
        return self.ready if self.ready > before else None


class DeviceEvent(Protocol):
    """What a CUDA event offers (torch.cuda.Event): whether the work before it has run."""

    def query(self) -> bool: ...


class LayerReadiness:
    """P, on the writer: how many layer groups of each (request, serial) are computed. A mark
    made on a GPU carries the CUDA event recorded after its layers' kernels were queued; it
    counts once the event has completed (events of one stream complete in order)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self._ready: dict[tuple[str, int], int] = {}
        self._waiting: dict[tuple[str, int], list[tuple[int, DeviceEvent]]] = {}
        self._since: dict[tuple[str, int], float] = {}

    def mark(self, request_id: str, serial: int, ready: int, event: DeviceEvent | None = None) -> None:
        key = (request_id, serial)
        self._since.setdefault(key, self.clock())
        if event is None:
            if ready > self._ready.get(key, 0):
                self._ready[key] = ready
            return
        self._waiting.setdefault(key, []).append((ready, event))

    def ready(self, request_id: str, serial: int) -> int:
        key = (request_id, serial)
        waiting = self._waiting.get(key)
        if waiting:
            done = 0
            for ready, event in waiting:
                if not event.query():
                    break
                self._ready[key] = max(self._ready.get(key, 0), ready)
                done += 1
            del waiting[:done]
            if not waiting:
                del self._waiting[key]
        return self._ready.get(key, 0)

    def since(self, request_id: str, serial: int) -> float:
        """When the request was first marked (inf: never)."""
        return self._since.get((request_id, serial), float("inf"))

    def pending_events(self) -> bool:
        """Some mark waits on its device: the writer must poll again soon."""
        return bool(self._waiting)

    def forget(self, request_id: str, serial: int) -> None:
        key = (request_id, serial)
        self._ready.pop(key, None)
        self._waiting.pop(key, None)
        self._since.pop(key, None)

    def prune(self, older_than: float) -> int:
        """Drop marks of requests no push ever claimed (their prefill never reached a WRITE)."""
        old = [k for k, at in self._since.items() if at < older_than]
        for key in old:
            self.forget(*key)
        return len(old)

    def __len__(self) -> int:
        return len(self._since)
