"""Mailbox messages between the actors of one rank, and one union per actor: a message sent
to an actor that does not handle it is a type error (``Peers.to_writer`` and siblings).
"""

from __future__ import annotations

from typing import Any, Literal, Union, get_args

from msgspec import Struct

from .fields import (
    BlockGroups,
)
from .handshake import (
    AgentInfo,
    MemType,
    RegionInfo,
)
from .wire import (
    Abort,
    Registration,
    RegistrationHeader,
)


# ============================================================================================
# Mailbox messages between the actors of one rank
# ============================================================================================
class PeerKey(Struct, frozen=True, array_like=True):
    """One remote rank: engine id plus its (pp_rank, tp_rank), and where to ask for it."""

    engine_id: str
    host: str
    port: int
    pp_rank: int
    tp_rank: int


class MemoryRange(Struct, frozen=True, array_like=True):
    addr: int
    length: int
    device_id: int


# --- writer ---------------------------------------------------------------------------------
class RegisterMemory(Struct, frozen=True, kw_only=True, tag="register_memory"):
    """Worker → writer (ask): register the KV memory; the reply is :class:`MemoryRegistered`."""

    regions: tuple[RegionInfo, ...]
    memory: tuple[MemoryRange, ...]
    mem_type: MemType
    block_size: int
    physical_blocks_per_logical: int = 1
    replicated_kv: bool = False
    kv_heads: int | None = None


class MemoryRegistered(Struct, frozen=True, kw_only=True, tag="memory_registered"):
    agent_name: str = ""
    agent_metadata: bytes = b""
    error: str = ""


class SendRegistration(Struct, frozen=True, kw_only=True, tag="send_registration"):
    registration: Registration

    @property
    def request_id(self) -> str:
        return self.registration.request_id


class PostPush(Struct, frozen=True, kw_only=True, tag="post_push"):
    """Matcher → writer: P's finished blocks paired with one D rank's registration."""

    request_id: str  # P's id: what P reports and frees
    block_ids: BlockGroups
    registration: Registration
    expected_targets: int  # D ranks this P rank writes to
    sender: str = ""  # the agent the registration came from (verified by the writer)
    serial: int = 0  # the incarnation of the P id (a reused id's old tombstone does not apply)
    # When D last showed it waits for this registration (monotonic, this process): a WRITE
    # replayed after a handshake re-checks that it is still fresh.
    fresh_at: float = 0.0
    # The WRITE planned by the matcher on the writer's pairing for that D rank, and that
    # pairing's id: the writer only posts it, and plans anew if the pairing it holds now has
    # another id (the remote was reloaded meanwhile). Its descriptor lists never leave the writer.
    # A core.blocks.WritePlan, a pure value; typed here as what this layer can name (protocol
    # sits below core), and checked by the writer that reads it.
    plan: object = None
    pairing_id: int = 0
    # D's deadline for the registration on this rank's clock (inf: none): never posted past it.
    deadline: float = float("inf")


class CancelPush(Struct, frozen=True, kw_only=True, tag="cancel_push"):
    """Matcher → writer: D aborted; do not post what is not posted yet, confirm to D."""

    request_id: str  # P's id
    d_request_id: str
    decode_tp_rank: int


class RefuseRegistration(Struct, frozen=True, kw_only=True, tag="refuse_registration"):
    registration: Registration
    reason: str

    @property
    def request_id(self) -> str:
        return self.registration.request_id


class AnswerAbort(Struct, frozen=True, kw_only=True, tag="answer_abort"):
    """Matcher → writer: D aborted a request P is already done with; tell D so it can stop
    quarantining its blocks at once."""

    d_request_id: str
    sender: str
    reason: str
    generation: int = 0  # of the registration D aborted

    @property
    def request_id(self) -> str:
        return self.d_request_id


class HandshakeCompleted(Struct, frozen=True, kw_only=True, tag="handshake_completed"):
    peer: PeerKey
    info: AgentInfo
    full: bool
    # The peer's monotonic clock minus ours, estimated from the payload's clock sample and the
    # midpoint of the exchange (as NTP does); used to rebase deadlines across processes.
    clock_offset: float = 0.0
    # How far off that estimate can be (half the exchange's round trip); None: no sample.
    clock_error: Union[float, None] = None


class HandshakeFailed(Struct, frozen=True, kw_only=True, tag="handshake_failed"):
    peer: PeerKey
    kind: str
    reason: str


class ExpireLease(Struct, frozen=True, kw_only=True, tag="expire_lease"):
    request_id: str
    reason: str = "lease_expired"
    serial: int = 0  # the incarnation whose lease this is (0: whichever is live)
    failed: bool = False  # a failure (ambiguity, an actor error), not a plain expiry


class SendHeartbeats(Struct, frozen=True, kw_only=True, tag="send_heartbeats"):
    engine_id: str
    host: str
    port: int
    peers: tuple[PeerKey, ...]
    ids: tuple[str, ...]


class SendAbort(Struct, frozen=True, kw_only=True, tag="send_abort"):
    abort: Abort
    peers: tuple[PeerKey, ...]

    @property
    def request_id(self) -> str:
        return self.abort.request_id


class EvictIdleEngines(Struct, frozen=True, kw_only=True, tag="evict_idle_engines"):
    idle_for: float


class Drain(Struct, frozen=True, kw_only=True, tag="drain"):
    """Shutdown: fail what waits, settle what is in flight, release NIXL resources."""

    deadline: float


# --- matcher --------------------------------------------------------------------------------
class RegistrationArrived(Struct, frozen=True, kw_only=True, tag="registration_arrived"):
    """Writer → matcher: a registration from a verified sender. The writer decodes only its
    header; the block ids (``payload``, the msgpack body) are decoded here, off the writer."""

    registration: Union[Registration, None] = None
    sender: str
    payload: bytes = b""
    header: Union[RegistrationHeader, None] = None
    # Logical blocks per KV group that D advertised (checked before any WRITE is planned).
    capacity: tuple[int, ...] = ()
    # The writer's pairing of this rank's KV with that D rank's (read-only once built) and its
    # id (0: none): the matcher plans the WRITE on it, off the writer, and names the id back.
    # Only the layout travels; its prepared NIXL lists stay on the writer's thread. A
    # core.blocks.PairedLayout (typed as what this layer can name; the matcher checks it).
    pairing: object = None
    pairing_id: int = 0
    # D's clock minus ours and the estimate's error bound, from P's handshake with that D rank
    # (None: no clock sample): the registration's deadline on this rank's clock.
    clock: Union[tuple[float, float], None] = None

    @property
    def request_id(self) -> str:
        if self.registration is not None:
            return self.registration.request_id
        return self.header.request_id if self.header is not None else "?"


class BlocksFinished(Struct, frozen=True, kw_only=True, tag="blocks_finished"):
    """Worker → matcher: P's finished blocks, ready to pair (sent right after ``ArmLease``)."""

    request_id: str
    block_ids: BlockGroups
    transfer_id: Union[str, None] = None
    serial: int = 0


Outcome = Literal["pushed", "expired", "failed", "aborted", "shutdown"]


class Forget(Struct, frozen=True, kw_only=True, tag="forget"):
    """Writer → matcher: a P request is over; drop it under every key and tombstone it."""

    request_id: str
    outcome: Outcome
    transfer_id: Union[str, None] = None  # for requests the matcher never saw (P aborted early)
    serial: int = 0  # the incarnation that ended (0: whichever is live)
    # D ranks told a WRITE "may still land": they hold their blocks until P's final answer, so
    # the matcher keeps those slots' outcome by time (tombstone_ttl), not among the newest
    pinned: tuple[int, ...] = ()


class Released(Struct, frozen=True, kw_only=True, tag="released"):
    """Matcher or reaper → writer: these P requests (id, serial) are gone from its tables, and
    everything it sent the writer about them is already in the writer's mailbox (one FIFO).
    Once both have said so, nothing can still ask the writer to post for that incarnation, and
    its tombstone goes: the writer's memory of ended requests is bounded by the requests whose
    release is on its way, not by rate × ``tombstone_ttl``."""

    requests: tuple[tuple[str, int], ...]
    by: Literal["matcher", "reaper"]


class HeartbeatArrived(Struct, frozen=True, kw_only=True, tag="heartbeat_arrived"):
    """Writer → matcher: D's ``HB:`` ids, from a verified sender. The matcher resolves a bounded
    slice per message and tells itself the rest (same ids, a later ``offset``), so whatever
    waits in its mailbox runs in between: a heartbeat naming many ids never blocks the others."""

    ids: tuple[str, ...]
    sender: str
    offset: int = 0  # ids before it were resolved by an earlier message
    # When the heartbeat arrived (matcher's monotonic clock), set on the rest: every slice
    # refreshes registrations as of then, never later.
    at: Union[float, None] = None
    # D's promise for the registrations it names, on this rank's clock (already moved back by
    # the clock estimate's error); None: none given or D's clock unknown.
    deadline: Union[float, None] = None


class AbortArrived(Struct, frozen=True, kw_only=True, tag="abort_arrived"):
    abort: Abort
    sender: str

    @property
    def request_id(self) -> str:
        return self.abort.request_id


# --- lease-reaper ---------------------------------------------------------------------------
class ArmLease(Struct, frozen=True, kw_only=True, tag="arm_lease"):
    """Worker → reaper: lease P's finished blocks. The worker puts it in the reaper's mailbox
    before it hands the blocks to the matcher (:class:`BlocksFinished`), so every message that
    follows from the push (``ClearLease``) queues behind it: FIFO order, not a forwarding hop,
    keeps the lease armed first."""

    request_id: str
    deadline: float  # this worker's clock
    # Which incarnation of the P id this is (the worker numbers them): a late message about an
    # earlier request under a reused id never touches the live one.
    serial: int = 0


class ClearLease(Struct, frozen=True, kw_only=True, tag="clear_lease"):
    request_id: str
    serial: int = 0


class ExtendLeases(Struct, frozen=True, kw_only=True, tag="extend_leases"):
    """Matcher → reaper: heartbeats named these live P requests. The reaper extends a bounded
    slice per message and tells itself the rest (a later ``offset``, the same ``target``)."""

    request_ids: tuple[str, ...]
    offset: int = 0  # ids before it were extended by an earlier message
    target: Union[float, None] = None  # the deadline to extend to (rank clock), set on the rest


class WatchRecv(Struct, frozen=True, kw_only=True, tag="watch_recv"):
    """D side: arm the registration watchdog and the completion ledger for one request."""

    request_id: str
    expected: int
    deadline: float  # this worker's clock
    registration: Registration
    peers: tuple[PeerKey, ...]  # the P ranks this D rank registers with
    heartbeat_id: str
    nbytes: int = 0  # bytes this rank receives when the push completes (for metrics)


class RecvNotified(Struct, frozen=True, kw_only=True, tag="recv_notified"):
    """A completion (ok) or push failure (not ok) arrived for a D request."""

    request_id: str
    ok: bool
    sender: str
    reason: str = ""
    # The P rank the sending agent was verified as (a handshake bound its name); None when the
    # sender is no agent this rank handshook with. Only the ranks a request expects count.
    peer: Union[PeerKey, None] = None
    final: bool = True
    generation: int = 0  # of the registration the answer names: only the live one counts
    # The writer took this completion and reported the request itself (core/claims.py).
    taken: bool = False


class RecvUndelivered(Struct, frozen=True, kw_only=True, tag="recv_undelivered"):
    """D's registration never reached ``count`` P ranks: they will never write or answer."""

    request_id: str
    count: int
    reason: str


class PeerGone(Struct, frozen=True, kw_only=True, tag="peer_gone"):
    """Writer → reaper: NIXL reports this remote rank disconnected (its process died or
    restarted). D requests waiting on it stop waiting for the watchdog: they quarantine."""

    peer: PeerKey
    agent: str
    reason: str
    # D requests whose registration did reach that agent and had no final answer from it: only
    # these can have been written or answered by it, so only these fail. None: every request
    # waiting on that rank (a sender that does not know). The others keep waiting: their
    # registrations (one whose send found the agent gone among them) are parked for the
    # rank's next incarnation, found by a new handshake.
    delivered: Union[tuple[str, ...], None] = None


class PeerDead(Struct, frozen=True, kw_only=True, tag="peer_dead"):
    """Writer or handshake actor → reaper: a P rank NIXL reported disconnected, or one probed
    for owing an aborted request its answer, is certainly dead (its side channel refuses, or a
    new incarnation answers there): no WRITE of the old one can land any more."""

    peer: PeerKey
    agent: str
    reason: str


class AbortRecv(Struct, frozen=True, kw_only=True, tag="abort_recv"):
    request_id: str


# --- handshake ------------------------------------------------------------------------------
class FetchPeer(Struct, frozen=True, kw_only=True, tag="fetch_peer"):
    peer: PeerKey
    full: bool  # full (P→D: memory layout needed) or notif-only (D→P)


class FetchSettled(Struct, frozen=True, kw_only=True, tag="fetch_settled"):
    """Internal to the handshake actor: a background fetch returned bytes or an error."""

    peer: PeerKey
    full: bool
    payload: Union[bytes, None] = None
    error_kind: str = ""
    error: str = ""
    sent_at: float = 0.0  # this process's monotonic clock around the exchange
    received_at: float = 0.0


class ExpectTraffic(Struct, frozen=True, kw_only=True, tag="expect_traffic"):
    """Matcher → writer: finished blocks wait for their registration, which is on its way, so
    poll at the busy interval for a while (``poll_busy_linger``) instead of backing off."""


class ProbePeer(Struct, frozen=True, kw_only=True, tag="probe_peer"):
    """Reaper → handshake (D): this P rank owes an aborted request its final answer and nothing
    else goes to it: ask its side channel whether the process D registered with still lives.
    A refusal, or another incarnation answering there, is told to the reaper as
    :class:`PeerDead`; anything else (it answers as itself, a timeout, a dropped connection)
    proves nothing and the quarantine stands."""

    peer: PeerKey


class ProbeSettled(Struct, frozen=True, kw_only=True, tag="probe_settled"):
    """Internal to the handshake actor: a liveness probe's fetch returned bytes or an error."""

    peer: PeerKey
    payload: Union[bytes, None] = None
    error_kind: str = ""
    error: str = ""


# --- stager ---------------------------------------------------------------------------------
class UseMemory(Struct, frozen=True, kw_only=True, tag="use_memory"):
    """Worker → stager (ask): the KV tensors and staging buffer it copies between (torch
    tensors; the reply is True). Registered once, with the KV memory."""

    tensors: Any
    staging: Any
    layout: Any  # the rank's KVLayout (D: where each region's image goes)


class Gather(Struct, frozen=True, kw_only=True, tag="gather"):
    """Writer → stager: copy a staged push's rows from P's blocks into P's staging slot
    (rows as numpy arrays of addresses and lengths, or as :class:`~pushactors.core.staging.RowGrid`);
    the stager answers :class:`Gathered`."""

    request_id: str
    d_rank: int
    serial: int
    chunk: int = 0
    src: Any
    dst: Any
    lengths: Any
    grids: tuple[Any, ...] = ()


class LayersReady(Struct, frozen=True, kw_only=True, tag="layers_ready"):
    """Worker → writer: the forward has computed the first ``ready`` layer groups of these P
    requests ((id, serial) each). ``total`` > 0 announces layer-wise requests (sent before
    their blocks reach the matcher, so the writer knows them before any push of theirs);
    ``event``: on a GPU, the CUDA event recorded after those layers' kernels were queued;
    ``saved``: a ``threading.Event`` the writer sets once these requests' pushes have ended on
    P's side (landed with the completion sent, failed or released), or none is in flight (the
    engine's wait_for_save waits on it, at most layerwise_save_wait)."""

    requests: tuple[tuple[str, int], ...]
    ready: int
    total: int = 0
    event: Any = None
    saved: Any = None


class Gathered(Struct, frozen=True, kw_only=True, tag="gathered"):
    """Stager → writer: the gather of one staged push is done (or failed)."""

    request_id: str
    d_rank: int
    serial: int
    chunk: int = 0
    error: str = ""
    gather_ms: float = 0.0


class PrepareScatter(Struct, frozen=True, kw_only=True, tag="prepare_scatter"):
    """Reaper → stager: D watches a staged registration; make its scatter ready now, while P
    still prefills (rows checked, the device's row table in place), so the :class:`Scatter`
    after the push lands only launches it. Used only for a Scatter of an equal registration."""

    request_id: str
    registration: Registration


class ForgetScatter(Struct, frozen=True, kw_only=True, tag="forget_scatter"):
    """Reaper → stager: a staged request ended without a scatter (failed, aborted, timed out):
    no WRITE can land in its slot any more. The stager gives the slot back (it alone frees D's
    slots) and drops the scatter made ready for this registration. One made for another
    registration of the id (a newer one) stays."""

    request_id: str
    registration: Registration


class Scatter(Struct, frozen=True, kw_only=True, tag="scatter"):
    """Reaper → stager: every P source completed a staged push: copy the image in the slot
    into D's blocks, free the slot, then report the request received."""

    request_id: str
    registration: Registration
    nbytes: int = 0


WriterMessage = Union[
    RegisterMemory,
    SendRegistration,
    PostPush,
    CancelPush,
    AnswerAbort,
    RefuseRegistration,
    HandshakeCompleted,
    HandshakeFailed,
    ExpireLease,
    SendHeartbeats,
    SendAbort,
    EvictIdleEngines,
    Drain,
    Gathered,
    LayersReady,
    ExpectTraffic,
    Released,
]
MatcherMessage = Union[RegistrationArrived, BlocksFinished, Forget, HeartbeatArrived, AbortArrived]
ReaperMessage = Union[
    ArmLease,
    ClearLease,
    ExtendLeases,
    WatchRecv,
    RecvNotified,
    RecvUndelivered,
    PeerGone,
    PeerDead,
    AbortRecv,
]
HandshakeMessage = Union[FetchPeer, FetchSettled, ProbePeer, ProbeSettled]
StagerMessage = Union[UseMemory, Gather, PrepareScatter, ForgetScatter, Scatter]


class Batch(Struct, frozen=True, tag="batch"):
    """Several messages for one actor as one mailbox message: what one engine hook, or one
    handler, sent it (``Peers.batched``). Handled in order, each with its own handler and
    event, as if sent one by one; only the mailbox hop is shared."""

    messages: tuple[Any, ...]


# The same sets at run time (the send helpers check them; a test keeps them equal to each
# actor's handler table).
WRITER_MESSAGES: tuple[type, ...] = get_args(WriterMessage)
MATCHER_MESSAGES: tuple[type, ...] = get_args(MatcherMessage)
REAPER_MESSAGES: tuple[type, ...] = get_args(ReaperMessage)
HANDSHAKE_MESSAGES: tuple[type, ...] = get_args(HandshakeMessage)
STAGER_MESSAGES: tuple[type, ...] = get_args(StagerMessage)
