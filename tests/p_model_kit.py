"""What the stateful model of P's side of a push (``test_model_p.py``) drives and watches.

* :class:`PRank`: one P rank's writer parts wired as ``test_writer_parts``' ``Desk`` wires them,
  with the writer's handlers for the messages the model sends (the matcher's, the reaper's,
  the worker's, the stager's) as plain calls. Every call into the writer's parts runs on a
  :class:`VirtualClock`: the parts read ``time.monotonic`` directly, and D's deadline, the
  stuck timer and the pin limit must all be read off the model's clock.
* :class:`Tap`: stands between the writer and its NIXL agent. Every WRITE is held in the fake
  fabric until the model opens its gate (it then ends DONE, or ERR when the model drew that
  when it was posted); posts, releases and P's notifications to D are reported to the model
  as they happen, so a rule can be checked at the moment the writer acts.
* Stamps: the bytes a request's prefill computes into P's blocks, so that what lands in D's
  memory says which request, layer and block it came from.
* Staging: both sides get a staging buffer (D's in ``SLOTS`` slots of ``SLOT`` bytes, offered in
  registrations), and :meth:`PRank.gather` does the stager's copy of a ``Gather`` on P.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
from test_writer_parts import BLOCK, D_PEER, LAYERS, NBLOCKS, Desk

from pushactors.actors.base import Note
from pushactors.core.blocks import KVLayout
from pushactors.core.staging import SLOT_ALIGN, StagingArea, image_of
from pushactors.protocol import (
    CancelPush,
    ExpireLease,
    Gather,
    Gathered,
    LayersReady,
    PostPush,
    RefuseRegistration,
    Released,
    StagingInfo,
    decode_notification,
)
from pushactors.testing import FaultContext, Gate
from pushactors.transport.copies import ByteViews, copy_grids, copy_rows

__all__ = [
    "BLOCK",
    "D_PEER",
    "GARBAGE",
    "LAYERS",
    "NBLOCKS",
    "SLOT",
    "SLOTS",
    "STAGING",
    "PRank",
    "Tap",
    "TappedWrite",
    "VirtualClock",
    "stamp",
]

GARBAGE = 255  # what P's blocks hold before the forward computed them: never in a stamp
SLOT, SLOTS = 512, 3  # D's staging slots: each holds the image of up to 2 blocks of every layer
STAGING = -1  # the "layer" of a staging buffer's granules in a BlockMap


def stamp(uid: int, layer: int, pos: int) -> torch.Tensor:
    """The bytes request ``uid``'s forward computes for ``layer`` into its ``pos``-th block (1-250)."""
    return torch.from_numpy(((uid * 37 + layer * 11 + pos * 5 + np.arange(BLOCK)) % 250 + 1).astype(np.uint8))


class VirtualClock:
    """The model's clock, read as ``time.monotonic`` by whatever runs inside :meth:`running`.

    The writer's parts read ``time.monotonic`` themselves (``RankContext.clock`` is not theirs
    yet), and one ``now`` passed to ``expire_stuck`` cannot stand for every push: each push's
    stuck timer and pin limit run from its own first post, and its deadline is compared with the
    time of each post. So the model's calls into the parts run on this clock instead."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    @contextmanager
    def running(self) -> Iterator[None]:
        real = time.monotonic
        time.monotonic = self  # type: ignore[assignment]
        try:
            yield
        finally:
            time.monotonic = real


class BlockMap:
    """Which (layer, block) of a KV dict an address range touches; in the staging buffer,
    (STAGING, granule): its ``BLOCK``-byte pieces."""

    def __init__(self, kv: dict[str, torch.Tensor], staging: torch.Tensor) -> None:
        self.bases = [(li, t.data_ptr(), NBLOCKS * BLOCK) for li, t in enumerate(kv.values())]
        self.bases.append((STAGING, staging.data_ptr(), staging.numel()))

    def blocks(self, rows: Any) -> frozenset[tuple[int, int]]:
        out: set[tuple[int, int]] = set()
        for addr, length, _ in np.asarray(rows, dtype=np.uint64).reshape(-1, 3).tolist():
            for li, base, size in self.bases:
                if base <= addr < base + size:
                    first, last = (addr - base) // BLOCK, (addr + length - 1 - base) // BLOCK
                    out.update((li, b) for b in range(first, last + 1))
        return frozenset(out)


@dataclass
class TappedWrite:
    """One WRITE the writer posted: held in the fabric until the model opens ``gate``."""

    handle: Any
    gate: Gate
    err: bool  # ends in ERR once let go (drawn when it was posted; P cannot know it)
    src: frozenset[tuple[int, int]]  # (layer, block) of P's KV it reads, or (STAGING, granule)
    dst: frozenset[tuple[int, int]]  # (layer, block) of D's KV it writes, or (STAGING, granule)
    owner: Any  # the model's request it belongs to
    at: float  # when it was posted (the model's clock)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        state = "held" if not self.gate.is_open else self.handle.state
        p.text(f"<WRITE {sorted(self.dst)} of {self.owner!r}: {state}{' (ERR when let go)' if self.err else ''}>")

    @property
    def running(self) -> bool:
        """NIXL has not said it ended, and P still holds it."""
        return self.handle.state == "PROC" and not self.handle.released


class Tap:
    """P's NIXL agent, seen by the model: every WRITE is held by its own gate, and the writer's
    posts, in-flight releases and notifications are reported before they take effect."""

    def __init__(self, inner: Any, fabric: Any) -> None:
        self.inner = inner
        self.fabric = fabric
        self.fates: deque[bool] = deque()  # the next WRITEs end in ERR (True) or DONE
        self.on_post: Callable[[Any], Any] = lambda handle: None  # -> the owner
        self.on_posted: Callable[[TappedWrite], None] = lambda write: None
        self.on_release: Callable[[Any], None] = lambda handle: None  # a WRITE still running
        self.on_send: Callable[[Any], None] = lambda message: None
        self._armed: object | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def transfer(self, handle: Any, notif_msg: bytes = b"") -> str:
        owner = self.on_post(handle)
        err = self.fates.popleft() if self.fates else False
        token = object()
        # The rules take this post only: one gate for each WRITE, whatever was posted before.
        mine: Callable[[FaultContext], bool] = lambda ctx: self._armed is token  # noqa: E731
        gate = self.fabric.faults.hold_transfer(match=mine, times=1)
        if err:
            self.fabric.faults.err_transfer(match=mine, times=1)
        self._armed = token
        try:
            status = str(self.inner.transfer(handle, notif_msg))
        finally:
            self._armed = None
        write = TappedWrite(handle, gate, err, self.src(handle), self.dst(handle), owner, time.monotonic())
        self.on_posted(write)
        return status

    def release_xfer_handle(self, handle: Any) -> None:
        running = handle.state == "PROC"
        self.inner.release_xfer_handle(handle)  # may raise: NIXL refused, nothing released
        if running:
            self.on_release(handle)

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        self.on_send(decode_notification(notif_msg))
        self.inner.send_notif(agent_name, notif_msg)

    # set by PRank: where P's and D's blocks lie
    src_map: BlockMap
    dst_map: BlockMap

    def src(self, handle: Any) -> frozenset[tuple[int, int]]:
        return self.src_map.blocks(handle.src)

    def dst(self, handle: Any) -> frozenset[tuple[int, int]]:
        return self.dst_map.blocks(handle.dst)


class PRank:
    """One P rank's writer parts (``Desk``) behind a :class:`Tap`, connected to D, driven on a
    :class:`VirtualClock`. Its methods are the writer actor's handlers for the messages the
    model plays (each the few lines the actor adds around the parts)."""

    def __init__(self, clock: VirtualClock, **config: Any) -> None:
        self.clock = clock
        with clock.running():
            desk = self.desk = Desk(**config)
            # Staging buffers, registered as the worker registers them: P's is the writer's to
            # take slots from, D's is advertised (with its agent's metadata) and offered in slots.
            self.p_staging = torch.zeros(3 * SLOT_ALIGN, dtype=torch.uint8)  # P's slots: 3 at a time
            self.d_staging = torch.zeros(SLOTS * SLOT, dtype=torch.uint8)
            p_agent = desk.poster.agent
            assert p_agent is not None
            for agent, buf in ((p_agent, self.p_staging), (desk.d_agent, self.d_staging)):
                agent.register_memory(np.array([(buf.data_ptr(), buf.numel(), 0)], dtype=np.uint64), "DRAM")
            desk.ctx.staging = StagingArea(self.p_staging.data_ptr(), self.p_staging.numel())
            desk.d_info = msgspec.structs.replace(
                desk.d_info,
                agent_metadata=desk.d_agent.get_agent_metadata(),
                staging=StagingInfo(addr=self.d_staging.data_ptr(), length=self.d_staging.numel()),
            )
            self.tap = Tap(p_agent, desk.fabric)
            self.tap.src_map = BlockMap(desk.p_kv, self.p_staging)
            self.tap.dst_map = BlockMap(desk.d_kv, self.d_staging)
            desk.poster.agent = self.tap  # type: ignore[assignment]  # an agent by delegation
            desk.fabric.clock = clock  # its delays (a released copy running on) on the model's clock too
            desk.connect_d()
        self.views = ByteViews([*desk.p_kv.values(), self.p_staging])
        self.d_regions = KVLayout.from_tensors(desk.d_kv, block_size=16).regions
        self.ctx = self.desk.ctx
        self.book = self.desk.book
        self.pusher = self.desk.pusher
        self.fabric = self.desk.fabric
        self.p_kv, self.d_kv = self.desk.p_kv, self.desk.d_kv
        self.config = self.ctx.config

    # --- the matcher's messages --------------------------------------------------------------
    def post_push(self, msg: PostPush) -> None:
        with self.clock.running():
            state, target, refused = self.book.open(msg, time.monotonic())
            if state is None or target is None:
                self.pusher.tell_d(msg.registration, refused)
                return
            if state.expired:
                self.pusher.fail_target(target, state.expired)
                return
            remote = self.desk.links.get(D_PEER)
            assert remote is not None, "D is connected for the whole model"
            self.pusher.post(target, remote, Note(), msg)

    def cancel(self, msg: CancelPush) -> None:
        with self.clock.running():
            state = self.book.pushes.get(msg.request_id)
            target = state.targets.get(msg.decode_tp_rank) if state else None
            if state is None or target is None or target.registration.request_id != msg.d_request_id:
                return  # nothing to cancel: over, or never here
            self.pusher.cancel(target, Note())

    def refuse(self, msg: RefuseRegistration) -> None:
        with self.clock.running():
            self.pusher.tell_d(msg.registration, msg.reason)

    def released(self, msg: Released) -> None:
        for rid, serial in msg.requests:
            self.book.released(rid, serial, msg.by)

    # --- the reaper's (and the matcher's failures) --------------------------------------------
    def expire(self, msg: ExpireLease) -> None:
        with self.clock.running():
            self.pusher.expire(msg, Note())

    # --- the worker's and the stager's -------------------------------------------------------
    def layers_ready(self, msg: LayersReady) -> None:
        with self.clock.running():
            self.pusher.layers_ready(msg, Note())

    def gather(self, msg: Gather, *, error: str = "") -> Gathered:
        """The stager's work on P: copy a push's pieces from its blocks into P's slot."""
        if not error:
            copy_rows(self.views, msg.src, msg.dst, msg.lengths)
            copy_grids(self.views, msg.grids)
        return Gathered(request_id=msg.request_id, d_rank=msg.d_rank, serial=msg.serial, chunk=msg.chunk, error=error)

    def gathered(self, msg: Gathered) -> None:
        with self.clock.running():
            self.pusher.gathered(msg, Note())

    def image(self, n: int) -> tuple[tuple[int, ...], int]:
        """Where each layer of a request of ``n`` blocks sits in its image on D, and its size."""
        img = image_of(self.d_regions, (tuple(range(n)),))
        return img.bases, img.nbytes

    # --- the writer's own ---------------------------------------------------------------------
    def handler_failed(self, request_id: str, serial: int, *, expiry: bool) -> None:
        """The handler of an ExpireLease (``expiry``) or a CancelPush about ``request_id``
        raised (on_handler_error)."""
        with self.clock.running():
            self.pusher.fail_request(request_id, "writer error: injected", serial=serial, expiry=expiry)

    def tick(self) -> None:
        """One turn of the writer's loop at the clock's time: poll, then housekeeping."""
        with self.clock.running():
            now = time.monotonic()
            self.pusher.check_in_flight()
            self.pusher.expire_stuck(now)
            self.book.prune(now)
            self.pusher.layered.prune(now - 2 * self.config.lease_duration)

    def poll(self) -> None:
        with self.clock.running():
            self.pusher.check_in_flight()

    def d_notifs(self) -> list[Any]:
        """What D's agent received since (its poll lands what the fabric finished first)."""
        with self.clock.running():
            return self.desk.d_notifs()

    def sizes(self) -> dict[str, int]:
        staging = self.ctx.staging
        assert staging is not None
        return {
            **self.book.sizes(),
            **self.pusher.layered.sizes(),
            "gathers": len(self.pusher.staged.gathers),
            "p_staging_slots": staging.sizes()["staging_slots"],
        }
