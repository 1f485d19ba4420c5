"""Settings of one engine's push transport. Every duration is in seconds."""

from __future__ import annotations

import functools
import ipaddress
import math
import typing
import warnings
from typing import Annotated, Any, Literal, Union, get_args

import msgspec
from msgspec import Meta, Struct

Seconds = Annotated[float, Meta(gt=0)]
Role = Literal["producer", "consumer", "both"]
PushMode = Literal["whole", "layerwise"]
# KV cache layouts the vLLM connector may ask vLLM for (vLLM's KVCacheLayout names; NHD and HND
# are vLLM's aliases of LBNHC and LBHNC).
KVCacheLayoutName = Literal["NHD", "HND", "LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC"]
KV_CACHE_LAYOUTS: tuple[str, ...] = get_args(KVCacheLayoutName)


class ConfigError(ValueError):
    """Settings that cannot work; raised before anything starts."""


class PushConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    engine_id: Annotated[str, Meta(min_length=1, max_length=256)]
    role: Role = "both"
    # P: blocks of a finished prefill stay leased this long waiting for their push.
    lease_duration: Seconds = 30.0
    # D: send HB: for awaited requests this often (default lease_duration / 6).
    heartbeat_interval: Union[Seconds, None] = None
    # D: a registration that never saw its push fails after this long.
    registration_timeout: Seconds = 480.0
    # D: blocks of an aborted or timed-out request stay unused this long at most when P does
    # not answer. P posts no WRITE past D's promise for the registration (2/3 lease past its
    # last heartbeat; D stops heartbeating on abort), and that holds for every WRITE of a push:
    # each layer group of a layer-wise push, each chunk of a staged one. A WRITE still in flight
    # write_timeout after its push's first WRITE is reported to D as "may still land" (D then
    # holds the blocks until P's final word). So with P's settings this is safe when >= 2/3
    # lease + write_timeout (+ 2 reaper ticks; enforced with the other timing rules, see
    # ``timing_violations``), however long a layer-wise push's forward runs.
    abort_quarantine: Seconds = 45.0
    # D: a request that repeats the transfer id of a live one (a decode leg sent again after its
    # client cancelled the first, before vLLM's abort of the first got through) waits this long,
    # unregistered, for the first to end; still live by then, both fail (never both registered).
    transfer_id_reuse_wait: Seconds = 5.0
    # P: a push still in flight this long after its first WRITE is stuck (its peer is likely
    # gone or frozen; a layer-wise push counts from its first layer, not its latest): no
    # further layer or chunk of it is posted, D hears that it may still land, and P polls it
    # on until NIXL reports it ended; only then is the final word sent. It is never released
    # to cancel it: NIXL's release returns while a copy already started (cma, cuda_ipc, RDMA)
    # runs on, and nothing says when that copy stopped (docs/security.md).
    write_timeout: Seconds = 20.0
    # Deprecated, ignored (accepted with a warning): P no longer believes a cancel after a
    # settle time, it waits for NIXL to report the WRITE ended (write_timeout, pinned_write_limit).
    cancel_settle: Union[Seconds, None] = None
    # The longest any WRITE is assumed to run: the explicit bound NIXL leaves open. D: it keeps
    # an aborted request's blocks (or staging slot) for a WRITE that P said may still land at
    # most this long after P said so, when P neither gives its final word nor is known dead (a
    # link down, a WRITE that never ends). P: a WRITE still running this long after its push's
    # first WRITE is released, counted (write.released_at_pin_limit), logged at error level,
    # and fails (its blocks go back to the engine). None: until P's final word or death (P:
    # until the WRITE ends or P goes down), however long.
    pinned_write_limit: Union[Seconds, None] = 300.0
    # Remote engines idle this long are forgotten (never while a transfer is in flight). At
    # least abort_quarantine + 2 ticks: D re-asks an unanswered abort through the loaded agent.
    engine_ttl: Seconds = 3600.0
    # How long P remembers requests it finished, expired or failed (late registrations, aborts
    # asked again). At least abort_quarantine + 2 ticks (and auth_window + 2 handshake_timeout
    # with auth_keys).
    tombstone_ttl: Seconds = 600.0
    # P: at most this many of those memories per rank, the oldest forgotten first. They only
    # answer late messages at once (a reused id, an abort asked again); a copy of a registration
    # P took is told by its generation, so forgetting one never lets a byte land (docs/security.md).
    tombstone_keep: Annotated[int, Meta(ge=0, le=1 << 20)] = 64
    # P: registrations that never meet their finished blocks are dropped after this long.
    orphan_registration_ttl: Seconds = 480.0
    handshake_timeout: Seconds = 10.0
    handshake_workers: Annotated[int, Meta(ge=1, le=64)] = 4
    # Writer polling of NIXL: tight while transfers are in flight, backing off when idle.
    poll_interval_busy: Seconds = 0.0002
    # Idle: 20 ms keeps an idle P+D pair near 1-2% of one core (2 ms: ~5%). A message (a push
    # to post, a registration to send) wakes the writer at once whatever this is; only inbound
    # traffic with nothing awaited or in flight waits up to one interval.
    poll_interval_idle: Seconds = 0.02
    # After traffic (a registration sent, a notification received) the writer keeps the busy
    # interval this long before backing off: an answer is usually on its way (0: back off at once).
    poll_busy_linger: float = 0.05
    # D: after sending a registration the writer polls at the busy interval until its answer
    # (completion or push failure) arrives, for this long at most: a prefill can outlast any
    # linger, and a push must be picked up the moment it lands. With nothing awaited it backs
    # off to poll_interval_idle (0: linger only).
    poll_await: Annotated[float, Meta(ge=0)] = 30.0
    # D: the polling interval while an answer is awaited (at most poll_interval_busy). Picking a
    # landed push up is on its critical path: H200, 1 MiB VRAM push, WRITE posted → D routes
    # the completion 480 µs p50 at 0.2 ms, 190 µs at 0.05 ms. Cost on the 2-core CI machine
    # while a request waits with nothing else to do: 0.17 → 0.28 cores (real NIXL, P and D in
    # one process), 0.15 → 0.23 (fake fabric). Raise it where D's CPU matters more.
    poll_interval_await: Seconds = 0.00005
    # The writer thread's timer slack (Linux): how late past its deadline a timed wait may
    # end. The kernel's default, 50 µs, stretches the await interval: a 50 µs wait slept
    # 108 µs p50 on the 2-core CI machine, 59 µs at 1e-6. The cost is the polls it adds: with
    # a request awaited and nothing else running, P and D in one process used 0.13-0.19 cores
    # unset and 0.29-0.31 at 1e-6. Per thread: no other thread changes. None (default) leaves
    # the thread's own; set it where D's pick-up latency matters more than a core's share.
    poll_timer_slack: Union[Annotated[float, Meta(gt=0, le=0.001)], None] = None
    # ... and its timer slack only while it polls at poll_interval_await: D awaits an answer,
    # or P the end of a layer-wise push's last layer. That wait is on the critical path of
    # every push, and it lasts one prefill at most. H100, 8B, layer-wise, from the last layer
    # to D knowing, p50 of 45 requests: 4k tokens 0.601 ms (0.620 unset), 256 tokens 0.34-0.42
    # (0.43-0.48). Its cost is D's polling CPU while a request is awaited: 0.22 cores instead of
    # 0.13 (2-core CI machine, P and D in one process). None: the thread's own slack throughout
    # (or poll_timer_slack's).
    await_timer_slack: Union[Annotated[float, Meta(gt=0, le=0.001)], None] = 1e-6
    # After posting a WRITE that is not DONE at once, the writer checks it in a tight loop for
    # up to this long before it falls back to the busy interval: a small WRITE settles (and its
    # notification leaves) within tens of µs, well before the next tick (0: no spin).
    poll_spin: Annotated[float, Meta(ge=0, le=0.01)] = 0.0001
    # ... and then, while that WRITE is in flight, polls on every turn of its loop (messages
    # still handled in between) for up to this long after posting it: a large WRITE's end is
    # seen when it happens, not up to a busy interval later (0: back to the busy interval).
    poll_spin_in_flight: Annotated[float, Meta(ge=0, le=0.05)] = 0.002
    reaper_tick: Seconds = 0.05
    # Stamp each push's critical steps in memory (core/timeline.py): P's post of the WRITE the
    # completion rides on and the check that saw it DONE, D's poll that read the completion and
    # its report. For breakdowns that logs would distort (pushactors bench layerwise --timeline);
    # one uncontended lock per stamp.
    timeline: bool = False
    # The interpreter's switch interval (sys.setswitchinterval), set when a worker starts; None
    # leaves the process's own (CPython: 5 ms). Process-wide: it is the engine's interpreter.
    # Every mailbox hop, and on the H200 every NIXL call, gives up the GIL; while an engine
    # thread runs Python, taking it back can wait a whole interval. 1 MiB push, an engine
    # thread in each node busy in Python half the time, p50: H200 6.6 ms at 5 ms, 1.1 ms at
    # 0.2 ms (1.0 ms with the engine idle); 2-core CI machine 6.1-6.4 ms and 2.3-3.0 ms. With
    # no thread busy it gains nothing (docs/performance.md, "2026-12-03").
    switch_interval: Union[Annotated[float, Meta(gt=0, le=0.1)], None] = None
    # The connector's hooks run on the engine thread each step. When the step gave the actors
    # work (blocks to push, a registration to send) or a WRITE or an answer is outstanding, a
    # hook lends them the interpreter: it blocks, lock released, until they are done with it
    # and the writer has polled once, for at most this long (core/handoff.py). Otherwise a
    # busy engine thread keeps the interpreter and each hop waits up to a switch interval.
    # 0: never lend (the actors run whenever the interpreter comes to them).
    hook_lend_max: Annotated[float, Meta(ge=0, le=1.0)] = 0.002
    # Every rank logs one ``rank.stats`` event this often (mailbox depths, table sizes, counters:
    # what ``pushactors top`` shows); 0 turns it off.
    stats_interval: Annotated[float, Meta(ge=0)] = 2.0
    # Registrations without a matching transfer_id are refused when this is set.
    require_transfer_id: bool = False
    # Side channel (ZMQ) for handshakes.
    side_channel_host: str = "127.0.0.1"
    side_channel_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    backends: tuple[str, ...] = ("UCX",)
    # --- NIXL backend tuning (docs/nixl.md, "Tuning") -----------------------------------------
    # Defaults measured (docs/nixl.md): the pool and SGL help only thousands of small
    # descriptors, which staging serves better; on small CPU machines extra threads compete
    # with the engine for cores.
    # UCX backend threads (nixl_agent_config(num_threads=...); vLLM's NIXL connector uses 4).
    # 0: one UCX worker, progressed by the writer's polling. N > 0: NIXL's thread-pool engine,
    # N more UCX workers on their own threads that split large transfers between them (they
    # sleep when idle). H200, nixl 1.5.1, with nixl_sgl: 16,384 x 32 KiB at 16.4 GB/s instead
    # of 4 GB/s, 256 x 2 MiB at 388 GB/s. DRAM, 2-core machine, 16 KiB scattered blocks:
    # 1.75 GB/s with 0, 2.9 with 2, 2.8 with 4 (WRITEs overlap; each one is slower).
    nixl_num_threads: Annotated[int, Meta(ge=0, le=64)] = 0
    # Batched (scatter-gather) copies for WRITEs in NIXL's UCX backend: sets
    # NIXL_UCX_SGL_ENABLE=1 in the process before each agent is created; a value already in the
    # environment wins. Measured together with nixl_num_threads=4 (numbers above). Caution
    # (nixl 1.5.1): a WRITE cancelled in flight (write_timeout) over UCX's TCP transport crashes
    # P or D soon after (SIGSEGV); not seen over shared memory.
    nixl_sgl: bool = False
    # NIXL's own progress thread, in C++: it moves a WRITE and its notification while the
    # writer waits for the interpreter (beside a busy engine, P's WRITE ended 2.2 ms after its
    # post without it, 40 µs with it: H100, docs/nixl.md). It sleeps on UCX's events, not on a
    # spinning core (nixl_progress_delay).
    nixl_progress_thread: bool = True
    # ... and how long it sleeps on UCX's events before looking anyway (NIXL rounds it up to
    # whole milliseconds); 0: NIXL's own busy loop, a core spinning (0.45-1 s of CPU per idle
    # second on the 2-core CI machine).
    nixl_progress_delay: Annotated[float, Meta(ge=0, le=1.0)] = 0.01
    # A direct WRITE whose pieces join into runs contiguous on both sides (blocks in order) is
    # posted as those runs, in two descriptor lists prepared for it, when they are at most half
    # its pieces; False: always one prepared descriptor per piece (docs/performance.md).
    post_runs: bool = True
    # ... but only for a WRITE of at least this many pieces: a small one posts faster by index
    # into the lists prepared once per pairing than as runs with two lists of its own (2-core
    # CI machine, real NIXL on DRAM, 64 KiB blocks in order, post p50: 1 / 4 / 16 blocks by
    # index 11 / 26 / 89 µs, as one run 20 / 34 / 113 µs). Not for a layer-wise push's last
    # WRITE: its lists are prepared when the push opens, so it goes as runs at any size.
    post_runs_min_pieces: Annotated[int, Meta(ge=0)] = 64
    # Where the JSON-lines mailbox log goes (None: not written).
    log_json: Union[str, None] = None
    # Test-only negative control (vLLM connector): a request whose id contains
    # "pushactors-debug-noise" pushes noise instead of its KV.
    debug_allow_noise: bool = False
    # vLLM connector: the KV cache layout asked of vLLM (get_required_kvcache_layout); None keeps
    # vLLM's default. Any layout is described as it is, so P and D may differ; the CPU backend
    # takes only its default (LBHNC, alias HND).
    kv_cache_layout: Union[KVCacheLayoutName, None] = None
    # --- staged pushes (docs/performance.md) ---------------------------------------------------
    # Bytes of this rank's staging buffer (on the KV device, registered with NIXL); 0: off.
    # D offers a slot of it to a request whose blocks are scattered; P gathers into its own
    # slot and WRITEs a few large spans instead of one descriptor per block piece.
    staging_bytes: Annotated[int, Meta(ge=0, lt=1 << 44)] = 0
    # D stages a request only when its registered blocks form more runs of consecutive ids
    # than this, and its image is at least staging_min_bytes (small pushes go direct).
    staging_min_runs: Annotated[int, Meta(ge=0, le=1 << 30)] = 8
    staging_min_bytes: Annotated[int, Meta(ge=0, lt=1 << 44)] = 1 << 20
    # P gathers a staged push into its own slot only when its pieces, joined where they are
    # contiguous on both sides, form more runs than this; fewer are written straight from its
    # blocks into D's slot, one descriptor per run. Blocks in order on P (8B, 4k tokens,
    # per-layer pages: 32 runs) then cost D's scatter alone, not a gather and a second copy
    # through the same memory. A gather costs ~1 ms of host and device work on the H200 and a
    # descriptor ~6-10 µs, hence the default; 0: always gather (when P has room).
    staging_gather_runs: Annotated[int, Meta(ge=0, le=1 << 30)] = 128
    # A staged push is gathered and WRITEn in chunks of about this many bytes, so chunk i+1 is
    # gathered while chunk i is in flight (0: one chunk). Each chunk costs a fixed host round
    # (gather message, kernel launch and sync, two descriptor lists, a post: ~0.3 ms on the
    # H200 host) against ~0.7 ms of device work per GiB, so small chunks lose: H200, 512 MiB
    # scattered, 16 chunks of 32 MiB moved 28.5 GB/s on P, one chunk 161 GB/s.
    staging_chunk_bytes: Annotated[int, Meta(ge=0, lt=1 << 44)] = 1 << 30
    # --- layer-wise pushes (docs/performance.md) -----------------------------------------------
    # "whole": P WRITEs a request's KV once its prefill has ended. "layerwise": the engine
    # announces a request whose prefill ends in the step about to run, and reports each layer
    # as its forward saves it (vLLM's save_kv_layer); P WRITEs each group of layers into D's
    # blocks as soon as it is computed and D's registration is matched, so the push ends
    # right after the last layer instead of starting then. One completion when every layer
    # landed; the same generations, deadlines and cancel rules as a whole push.
    push_mode: PushMode = "whole"
    # Whole pushes through vLLM: "forward_end" announces a request whose prefill ends in the
    # step about to run (one token to generate, for a remote decode) and hands its blocks to
    # the transport when that step's forward ends (wait_for_save, after the forward's kernels),
    # in the engine's own step. "next_step": once vLLM's scheduler has processed the step's
    # output (request_finished), at the next step's start: one engine step later.
    whole_push_start: Literal["forward_end", "next_step"] = "forward_end"
    # Layers per WRITE in layer-wise pushes (1: one WRITE per layer; fewer, larger WRITEs
    # cost less host time per request, land later).
    layers_per_write: Annotated[int, Meta(ge=1, le=1 << 16)] = 1
    # Layer-wise: the engine's wait_for_save (the end of a step's forward) waits up to this
    # long for the step's pushes to end on P's side, as vLLM's contract for it says ("block
    # until all saves are done"): it waits for the forward's last kernels (a CUDA event, the
    # interpreter lock released), hands the last layers over, and waits while the writer posts
    # them and sees them land with the completion sent. Otherwise the engine thread runs on
    # into sampling and its next step, holding the interpreter the writer needs for the WRITE
    # that ends the push (H100, 8B at 4k tokens, a wait that ended at the post: 0.81 ms instead
    # of 1.08 ms from the last layer to D knowing; docs/performance.md, "Layer-wise pushes").
    # 0: return at once; the writer then polls the last layer's event on its own.
    layerwise_save_wait: Annotated[float, Meta(ge=0, le=1.0)] = 0.005
    # --- who may talk to us (docs/security.md) ----------------------------------------------
    # P starts a handshake from an unverified registration only with peers allowed here:
    # engine ids and/or host networks ("decode-0", "10.1.0.0/16", "127.0.0.1"). Empty: any
    # address, but the registration's sender must be the agent that address advertises.
    trusted_peers: tuple[str, ...] = ()
    # Opt-in HMAC-SHA256 on side-channel exchanges and control notifications: key id -> secret
    # (at least 16 bytes; "hex:..." for hex). Messages are signed with ``auth_key_id``; every
    # listed key verifies (rotation: add the new key everywhere, then switch auth_key_id).
    auth_keys: dict[str, str] = {}
    auth_key_id: Union[str, None] = None
    # A signed message older or newer than this (wall clock) is refused (replay bound).
    auth_window: Seconds = 60.0
    # --- bounds -------------------------------------------------------------------------------
    # Remote agents loaded at once; idle ones are evicted first, never one with work in flight.
    max_remote_agents: Annotated[int, Meta(ge=1, le=1 << 16)] = 1024
    # Handshakes in flight at once (each on its own thread); one address is fetched once.
    max_handshakes_in_flight: Annotated[int, Meta(ge=1, le=1024)] = 64
    # Work parked behind one peer's handshake; past it, new work for that peer fails at once.
    max_parked_per_peer: Annotated[int, Meta(ge=1, le=1 << 20)] = 65536
    # An actor whose timer (tick) raises this many times in a row is declared dead: its rank
    # turns unhealthy and fails what it holds, instead of looking healthy while nothing moves.
    max_tick_failures: Annotated[int, Meta(ge=1, le=1 << 20)] = 50
    # The timing rules (``timing_violations``; docs/reliability.md, "Timing rules") are
    # enforced: settings under which a late WRITE could land in reused blocks, a stale message
    # could be acted on, or a lost final answer could leave D holding blocks forever are refused.
    # Only tests of the timing itself (short quarantines, a tiny engine_ttl) turn this on.
    allow_unsafe_timing: bool = False
    # The former name of ``allow_unsafe_timing`` (it covered the quarantine rule only), still
    # accepted: either one turns every timing rule off.
    allow_unsafe_quarantine: bool = False

    def __post_init__(self) -> None:
        # msgspec checks Meta constraints when decoding, not on direct construction: check
        # here so PushConfig(...) and PushConfig.from_dict(...) refuse the same things.
        if not self.engine_id or len(self.engine_id) > 256 or any(ord(c) < 0x20 for c in self.engine_id):
            raise ConfigError(f"engine_id {self.engine_id!r} must be 1-256 printable characters")
        if self.role not in ("producer", "consumer", "both"):
            raise ConfigError(f"role {self.role!r} is not one of producer, consumer, both")
        for name in _SECONDS_FIELDS:
            value = getattr(self, name)
            if value is None and name in ("heartbeat_interval", "cancel_settle", "pinned_write_limit"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a finite number of seconds > 0, not {value!r}")
        if self.poll_interval_busy > self.poll_interval_idle:
            raise ConfigError("poll_interval_busy must not exceed poll_interval_idle")
        linger = self.poll_busy_linger
        if isinstance(linger, bool) or not isinstance(linger, (int, float)) or not 0 <= linger <= 60:
            raise ConfigError(f"poll_busy_linger must be 0-60 seconds, not {linger!r}")
        for name in (
            "staging_bytes",
            "staging_min_runs",
            "staging_min_bytes",
            "staging_gather_runs",
            "staging_chunk_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, not {value!r}")
        if self.heartbeat_interval is not None and self.heartbeat_interval >= self.lease_duration * 2 / 3:
            raise ConfigError("heartbeat_interval must be below 2/3 lease_duration, or leases lapse between beats")
        for warning in self.deprecations():
            warnings.warn(warning, FutureWarning, stacklevel=2)
        if self.push_mode not in ("whole", "layerwise"):
            raise ConfigError(f"push_mode {self.push_mode!r} is not one of whole, layerwise")
        if self.whole_push_start not in ("forward_end", "next_step"):
            raise ConfigError(f"whole_push_start {self.whole_push_start!r} is not one of forward_end, next_step")
        lpw = self.layers_per_write
        if isinstance(lpw, bool) or not isinstance(lpw, int) or not 1 <= lpw <= 1 << 16:
            raise ConfigError(f"layers_per_write must be an integer 1-65536, not {lpw!r}")
        for name in ("allow_unsafe_timing", "allow_unsafe_quarantine"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, not {getattr(self, name)!r}")
        if not self.unsafe_timing_allowed:
            problems = self.timing_violations()
            if problems:
                raise ConfigError(
                    "; ".join(problems) + " (allow_unsafe_timing=True waives the timing rules, for tests only)"
                )
        if self.kv_cache_layout is not None and self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ConfigError(
                f"kv_cache_layout {self.kv_cache_layout!r} is not one of {', '.join(KV_CACHE_LAYOUTS)} (or unset)"
            )
        sw = self.switch_interval
        if sw is not None and (isinstance(sw, bool) or not isinstance(sw, (int, float)) or not 0 < sw <= 0.1):
            raise ConfigError(f"switch_interval must be above 0 and at most 0.1 seconds, or unset; not {sw!r}")
        for name in ("poll_timer_slack", "await_timer_slack"):
            slack = getattr(self, name)
            if slack is not None and (
                isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 < slack <= 0.001
            ):
                raise ConfigError(f"{name} must be above 0 and at most 0.001 seconds, or unset; not {slack!r}")
        n = self.nixl_num_threads
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 64:
            raise ConfigError(f"nixl_num_threads must be an integer from 0 to 64, not {n!r}")
        for name in ("nixl_sgl", "nixl_progress_thread", "timeline"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, not {getattr(self, name)!r}")
        for entry in self.trusted_peers:
            if not isinstance(entry, str) or not entry:
                raise ConfigError(f"trusted_peers entry {entry!r} must be an engine id or a network")
            if "/" in entry:  # meant as a network: a typo must not quietly become an engine id
                try:
                    ipaddress.ip_network(entry, strict=False)
                except ValueError as exc:
                    raise ConfigError(f"trusted_peers entry {entry!r} is not a network: {exc}") from None
        _check_bounds(self)
        if self.auth_keys or self.auth_key_id is not None:
            from ..transport.auth import AuthError, Keyring  # local: auth imports config types

            try:
                Keyring.from_config(self)
            except AuthError as exc:
                raise ConfigError(str(exc)) from None

    @property
    def min_safe_quarantine(self) -> float:
        """The shortest safe ``abort_quarantine`` for these settings (same on P and D).

        After D aborts (and stops heartbeating) P may still post a WRITE for up to 2/3 of a
        lease: it posts none past D's promise for the registration, and that holds for each
        WRITE of a push (every layer of a layer-wise push, every chunk of a staged one), not only
        the first. A push still in flight ``write_timeout`` after its first WRITE is reported to
        D as "may still land" (and stops posting); D then keeps the blocks until P's final word,
        sent once NIXL reports the WRITE ended, or ``pinned_write_limit``. Housekeeping runs
        every ``reaper_tick`` on both sides."""
        return self.lease_duration * 2 / 3 + self.write_timeout + 2 * self.reaper_tick

    @property
    def layers_per_group(self) -> int:
        """Layers in each WRITE of an announced push (the worker's marks and the writer's plans
        both cut the forward so): ``layers_per_write`` layer-wise; every layer in one for a
        whole push started at the forward's end (matched and made ahead while it runs)."""
        return self.layers_per_write if self.push_mode == "layerwise" else 1 << 16

    def deprecations(self) -> list[str]:
        """Settings still accepted but ignored, each with what replaced it (warned at
        construction, FutureWarning)."""
        out: list[str] = []
        if self.cancel_settle is not None:
            out.append(
                f"cancel_settle ({self.cancel_settle}s) is deprecated and ignored: P no longer releases a stuck "
                "WRITE and waits cancel_settle; it polls the WRITE until NIXL reports it ended (D told it may "
                "still land meanwhile), or releases it at pinned_write_limit"
            )
        return out

    @property
    def unsafe_timing_allowed(self) -> bool:
        """Whether the timing rules are waived (``allow_unsafe_timing`` or its old name)."""
        return bool(self.allow_unsafe_timing or self.allow_unsafe_quarantine)

    def timing_violations(self) -> list[str]:
        """The timing rules these settings break, each naming both settings and the rule;
        empty when they are safe. P and D are assumed to run the same settings (a rule may pair
        P's setting with D's). Why each rule holds: docs/reliability.md, "Timing rules"."""
        out: list[str] = []
        ticks = 2 * self.reaper_tick
        quarantine = self.abort_quarantine
        if self.write_timeout >= quarantine:
            out.append(
                f"write_timeout {self.write_timeout}s >= abort_quarantine {quarantine}s (rule: write_timeout < "
                "abort_quarantine): a WRITE that P has not cancelled yet could land after D reused the blocks"
            )
        elif quarantine < self.min_safe_quarantine:
            out.append(
                f"abort_quarantine {quarantine}s < {self.min_safe_quarantine:.2f}s (rule: abort_quarantine >= 2/3 "
                "lease_duration + write_timeout + 2 reaper_tick): a WRITE from a P that missed D's abort could "
                "land after D reused the blocks"
            )
        if self.tombstone_ttl < quarantine + ticks:
            out.append(
                f"tombstone_ttl {self.tombstone_ttl}s < abort_quarantine + 2 reaper_tick = {quarantine + ticks:.2f}s "
                "(rule: tombstone_ttl >= abort_quarantine + 2 reaper_tick): D asks again about an abort P has not "
                "answered for good every abort_quarantine, and P answers for a request it has ended only from its "
                "tombstone; forgotten sooner, a lost final answer leaves D holding the blocks forever"
            )
        if self.engine_ttl < quarantine + ticks:
            out.append(
                f"engine_ttl {self.engine_ttl}s < abort_quarantine + 2 reaper_tick = {quarantine + ticks:.2f}s "
                "(rule: engine_ttl >= abort_quarantine + 2 reaper_tick): D asks again about an unanswered abort "
                "only through a loaded P agent; idle for engine_ttl between two asks, the agent is forgotten, "
                "the asks stop, and a lost final answer leaves D holding the blocks forever"
            )
        replay = self.auth_window + 2 * self.handshake_timeout
        if self.auth_keys and self.tombstone_ttl < replay:
            out.append(
                f"tombstone_ttl {self.tombstone_ttl}s < auth_window + 2 handshake_timeout = {replay:.2f}s (rule, "
                "with auth_keys: tombstone_ttl >= auth_window + 2 handshake_timeout): a signed registration "
                "replayed inside auth_window (and admitted after up to 2 handshake_timeout) would outlive P's "
                "memory of its D slot and be stored as new, so blocks D already gave up could be written"
            )
        limit = self.pinned_write_limit
        if limit is not None and limit < self.write_timeout + ticks:
            out.append(
                f"pinned_write_limit {limit}s < write_timeout + 2 reaper_tick = {self.write_timeout + ticks:.2f}s "
                "(rule: pinned_write_limit >= write_timeout + 2 reaper_tick): P would give up on a WRITE (release "
                "it at pinned_write_limit) before judging it stuck at write_timeout and telling D it may still land"
            )
        if self.poll_interval_busy > self.reaper_tick:
            out.append(
                f"poll_interval_busy {self.poll_interval_busy}s > reaper_tick {self.reaper_tick}s (rule: "
                "poll_interval_busy <= reaper_tick): the writer tells D that a WRITE stuck past write_timeout may "
                "still land on its poll tick; polled less often than every reaper_tick, that word comes after the "
                "2-tick margin abort_quarantine counts on"
            )
        return out

    def safety_warnings(self) -> list[str]:
        """The timing rules these settings break (same settings on P and D assumed): empty
        unless ``allow_unsafe_timing`` let them through. The worker logs them at start."""
        return self.timing_violations()

    def trusts(self, engine_id: str, host: str) -> bool:
        """Whether P may start a handshake with ``engine_id`` at ``host`` on a registration's
        word alone (``trusted_peers``; empty trusts any, the sender check still applies)."""
        if not self.trusted_peers:
            return True
        try:
            addr = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            addr = None
        for entry in self.trusted_peers:
            if entry == engine_id:
                return True
            if addr is not None:
                try:
                    if addr in ipaddress.ip_network(entry, strict=False):
                        return True
                except ValueError:
                    continue
            elif entry == host:
                return True
        return False

    @property
    def registration_keep(self) -> float:
        """D: how long past a registration's sending (or its last heartbeat) D promises to keep
        its blocks for P. P posts each WRITE of a push (every layer, every chunk) only before
        that deadline, so the quarantine after an abort (>= 2/3 lease + write_timeout) outlasts
        every WRITE P may still post, and P's "may still land" for every one still running."""
        return self.lease_duration * 2 / 3

    @property
    def heartbeat_every(self) -> float:
        return self.heartbeat_interval if self.heartbeat_interval is not None else self.lease_duration / 6

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PushConfig:
        """Build from a plain mapping (e.g. ``kv_connector_extra_config``) with clear errors."""
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid pushactors settings: {exc}") from None
        except ConfigError as exc:
            raise ConfigError(f"invalid pushactors settings: {exc}") from None

    def replace(self, **changes: Any) -> PushConfig:
        return msgspec.structs.replace(self, **changes)


_SECONDS_FIELDS = tuple(name for name, hint in PushConfig.__annotations__.items() if "Seconds" in str(hint))


@functools.cache
def _bounded_fields() -> tuple[tuple[str, type, msgspec.Meta], ...]:
    """(name, base type, Meta) of every numeric field declared with bounds."""
    hints = typing.get_type_hints(PushConfig, include_extras=True)
    out = []
    for name, hint in hints.items():
        if typing.get_origin(hint) is not typing.Annotated:
            continue
        base, *extras = typing.get_args(hint)
        for meta in extras:
            if (
                isinstance(meta, msgspec.Meta)
                and base in (int, float)
                and any(getattr(meta, b) is not None for b in ("ge", "gt", "le", "lt"))
            ):
                out.append((name, base, meta))
    return tuple(out)


def _check_bounds(config: PushConfig) -> None:
    """The bounds msgspec checks when decoding, for a PushConfig built directly, and
    finiteness (``ge=0`` lets infinity through)."""
    for name, base, meta in _bounded_fields():
        value = getattr(config, name)
        ok_type = isinstance(value, int) if base is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type or not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite {base.__name__}, not {value!r}")
        if (
            (meta.ge is not None and value < meta.ge)
            or (meta.gt is not None and value <= meta.gt)
            or (meta.le is not None and value > meta.le)
            or (meta.lt is not None and value >= meta.lt)
        ):
            named = [(b, getattr(meta, b)) for b in ("ge", "gt", "le", "lt")]
            bounds = ", ".join(f"{b} {v}" for b, v in named if v is not None)
            raise ConfigError(f"{name} {value!r} is out of bounds ({bounds})")
