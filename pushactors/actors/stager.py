"""The stager: the copy kernels of staged pushes, off the writer's thread.

P: gathers a push's pieces from its blocks into its staging slot (:class:`Gather`), then tells
the writer (:class:`Gathered`), which WRITEs the slot's spans into D's slot. D: once every
source completed, copies the image from its slot into the request's blocks (:class:`Scatter`),
frees the slot, and only then reports the request received. The writer keeps polling NIXL
meanwhile, so one request's copy never delays another's completion. On a GPU the copies run on
a side CUDA stream; on DRAM they are torch CPU copies.

The stager alone frees D's staging slots: after a scatter, or when the reaper says the request
ended without one (:class:`ForgetScatter`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import torch

from ..core.blocks import KVLayout
from ..core.staging import scatter_grids
from ..protocol import ForgetScatter, Gather, Gathered, PrepareScatter, Scatter, UseMemory
from ..transport.copies import ByteViews, GridCopy, copy_grids, copy_rows, prepare_grids
from .base import Note, PushActor, RankContext, handles

# Scatters made ready ahead at most, by count and by the bytes they hold. On a GPU each holds a
# row table of 5 × (layers + blocks) numbers (~12 KB for an 8B 4k-token request); on the host
# path every row (24 bytes each: ~8 MB for a 70B 32k-token request), so the bytes bound it there.
PREPARED_SCATTERS = 256
PREPARED_SCATTER_BYTES = 64 << 20


class Stager(PushActor):
    actor_name = "stager"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self._views: ByteViews | None = None
        self._layout: KVLayout | None = None
        self._stream: Any = None
        self._copied = 0
        # The message whose slot was freed while it was handled: a handler error after the free
        # must not free it again (the worker may have handed that offset to a new request).
        self._freed_for: Scatter | ForgetScatter | None = None
        # Scatters made ready while their pushes were on the way, by request id, with the
        # registration each was made for: a Scatter uses one only for an equal registration
        # (a re-used id or re-staged request gets its own rows). A request that ends without a
        # scatter drops its entry (ForgetScatter); the oldest go beyond PREPARED_SCATTERS
        # entries or PREPARED_SCATTER_BYTES held, and their Scatters build their own rows.
        self._prepared: OrderedDict[str, tuple[Any, ByteViews | None, GridCopy, int]] = OrderedDict()
        self._prepared_bytes = 0

    def sizes(self) -> dict[str, int]:
        staging = self.ctx.staging
        return {
            "bytes_copied": self._copied,
            "prepared_scatters": len(self._prepared),
            "prepared_scatter_bytes": self._prepared_bytes,
            **(staging.sizes() if staging is not None else {}),
        }

    @handles(UseMemory)
    def _use(self, msg: UseMemory, note: Note) -> bool:
        tensors = [*msg.tensors, msg.staging]
        self._views = ByteViews(tensors)
        self._layout = msg.layout
        if self._views.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self._views.device)  # type: ignore[no-untyped-call]
        note("stage.memory", level="info", device=str(self._views.device), spans=len(self._views.spans))
        return True

    @handles(Gather)
    def _gather(self, msg: Gather, note: Note) -> None:
        started = time.monotonic()
        error = ""
        try:
            if self._views is None:
                raise RuntimeError("no staging memory on this rank")
            copied = copy_rows(self._views, msg.src, msg.dst, msg.lengths, self._stream)
            host_s = self._views.last_host_s
            copied += copy_grids(self._views, msg.grids, self._stream)
            host_s += self._views.last_host_s
            self._copied += copied
        except Exception as exc:
            error = f"gather failed: {exc!r}"
            copied, host_s = 0, 0.0
        ms = (time.monotonic() - started) * 1e3
        host_ms = host_s * 1e3
        rows = len(msg.src) + sum(len(g) for g in msg.grids)
        self.ctx.peers.to_writer(
            Gathered(
                request_id=msg.request_id,
                d_rank=msg.d_rank,
                serial=msg.serial,
                chunk=msg.chunk,
                error=error,
                gather_ms=ms,
            )
        )
        if error:
            note("stage.gather_failed", level="warning", d_rank=msg.d_rank, error=error)
        else:
            note(
                "stage.gathered",
                d_rank=msg.d_rank,
                bytes=copied,
                rows=rows,
                ms=round(ms, 3),
                host_ms=round(host_ms, 3),  # of ms: the rest waited for the device
            )

    def _scatter_copy(self, reg: Any, *, ahead: bool) -> tuple[GridCopy, int]:
        """The copy of ``reg``'s image from its slot into its blocks, ready to run, and its rows
        (``ahead``: to run later, its table already on the device)."""
        staging, slot = self.ctx.staging, reg.staging_slot
        if self._views is None or self._layout is None or staging is None or slot is None:
            raise RuntimeError("no staging memory on this rank")
        grids = scatter_grids(
            self._layout.regions, reg.block_groups, self._layout.physical_blocks_per_logical, staging.addr + slot[0]
        )
        return prepare_grids(self._views, grids, self._stream, settle=ahead), sum(len(g) for g in grids)

    @handles(PrepareScatter)
    def _prepare(self, msg: PrepareScatter, note: Note) -> None:
        started = time.monotonic()
        try:
            copy, rows = self._scatter_copy(msg.registration, ahead=True)
        except Exception as exc:
            # The Scatter will build its rows itself and fail the request visibly then.
            note("stage.prepare_failed", level="warning", error=repr(exc))
            return
        held = copy.footprint
        kept = held <= PREPARED_SCATTER_BYTES
        self._unprepare(msg.request_id)  # an older registration of the id: replaced
        if kept:
            self._prepared[msg.request_id] = (msg.registration, self._views, copy, rows)
            self._prepared_bytes += held
            while len(self._prepared) > PREPARED_SCATTERS or self._prepared_bytes > PREPARED_SCATTER_BYTES:
                _, (_, _, old, _) = self._prepared.popitem(last=False)
                self._prepared_bytes -= old.footprint
                self.ctx.metrics.incr("stage.prepared_evicted")
        note("stage.prepared", rows=rows, bytes_held=held, kept=kept, ms=round((time.monotonic() - started) * 1e3, 3))

    @handles(ForgetScatter)
    def _forget(self, msg: ForgetScatter, note: Note) -> None:
        self._freed_for = None
        self._free_slot(msg.registration, msg)
        ready = self._prepared.get(msg.request_id)
        # Only the entry made for this registration: a newer one of the id may be waiting.
        dropped = ready is not None and (ready[0] is msg.registration or ready[0] == msg.registration)
        if dropped:
            self._unprepare(msg.request_id)
        note("stage.forgotten", dropped=dropped)

    def _free_slot(self, reg: Any, message: Scatter | ForgetScatter) -> None:
        """Give ``reg``'s staging slot back, once per ``message`` (the only place D's slots
        are freed: nothing can land in the slot or be copied out of it any more)."""
        staging, slot = self.ctx.staging, reg.staging_slot
        if staging is not None and slot is not None and self._freed_for is not message:
            staging.free(slot[0])
            self._freed_for = message

    def _unprepare(self, request_id: str) -> tuple[Any, ByteViews | None, GridCopy, int] | None:
        ready = self._prepared.pop(request_id, None)
        if ready is not None:
            self._prepared_bytes -= ready[2].footprint
        return ready

    @handles(Scatter)
    def _scatter(self, msg: Scatter, note: Note) -> None:
        reg = msg.registration
        staging = self.ctx.staging
        slot = reg.staging_slot
        started = time.monotonic()
        self._freed_for = None
        ready = self._unprepare(msg.request_id)
        try:
            if ready is not None and (ready[0] is reg or ready[0] == reg) and ready[1] is self._views:
                copy, rows, prepared = ready[2], ready[3], True
            else:
                copy, rows = self._scatter_copy(reg, ahead=False)
                prepared = False
            copied = time.monotonic()
            assert staging is not None and slot is not None and self._views is not None  # _scatter_copy checked
            nbytes = copy.run(self._stream)
            self._copied += nbytes
        except Exception as exc:
            # The KV never reached the blocks: the request fails like any lost push.
            reason = f"scatter from staging failed: {exc!r}"
            self._free_slot(reg, msg)
            self.ctx.outbox.recv_failed(msg.request_id, reason)
            self.ctx.metrics.incr("recv.failed")
            note("stage.scatter_failed", level="warning", reason=reason)
            return
        self._free_slot(reg, msg)
        self.ctx.received(msg.request_id)
        self.ctx.metrics.incr("recv.finished")
        self.ctx.metrics.incr("recv.staged")
        self.ctx.metrics.incr("bytes.received", msg.nbytes)
        note(
            "stage.scattered",
            rows=rows,
            bytes=nbytes,
            prepared=prepared,  # made ready while the push was on the way (stage.prepared)
            ms=round((time.monotonic() - started) * 1e3, 3),
            host_ms=round((copied - started + self._views.last_host_s) * 1e3, 3),  # rows + copy's host part
        )

    def on_handler_error(self, message: Any, exc: Exception) -> None:
        """A handler that raised still ends its request: a gather as failed, a scatter as a
        failed receive (its slot freed); a forgotten scatter's slot is freed all the same."""
        if isinstance(message, Gather):
            self.ctx.peers.to_writer(
                Gathered(
                    request_id=message.request_id,
                    d_rank=message.d_rank,
                    serial=message.serial,
                    chunk=message.chunk,  # the writer counts replies per chunk
                    error=repr(exc),
                )
            )
        elif isinstance(message, Scatter):
            self._free_slot(message.registration, message)
            self.ctx.outbox.recv_failed(message.request_id, f"D stager error: {exc!r}")
        elif isinstance(message, ForgetScatter):
            self._free_slot(message.registration, message)
