"""Settings of one engine's push transport. Every duration is in seconds."""

from __future__ import annotations

import functools
import hashlib
import inspect
import ipaddress
import math
import typing
import warnings
from typing import Annotated, Any, Literal, Union, get_args

import msgspec
from msgspec import Meta, Struct

from .settings_doc import SettingsMeta, settings_text

Seconds = Annotated[float, Meta(gt=0)]
Role = Literal["producer", "consumer", "both"]
PushMode = Literal["whole", "layerwise"]
# KV cache layouts the vLLM connector may ask vLLM for (vLLM's KVCacheLayout names; NHD and HND
# are vLLM's aliases of LBNHC and LBHNC).
KVCacheLayoutName = Literal["NHD", "HND", "LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC"]
KV_CACHE_LAYOUTS: tuple[str, ...] = get_args(KVCacheLayoutName)


# The groups of PushConfig's settings, in the order help() and docs/settings.md show them.
SETTING_GROUPS: dict[str, str] = {
    "essential": "Essential: who this engine is and how peers reach it",
    "pushes": "Pushes: how KV is written",
    "timing": "Timing: leases, timeouts and the timing rules",
    "polling": "Polling and the interpreter",
    "nixl": "NIXL",
    "staging": "Staged pushes",
    "security": "Security and integrity",
    "limits": "Limits",
    "diagnostics": "Diagnostics",
}


def _about(group: str, description: str, *, vllm_only: bool = False) -> Meta:
    """A setting's description and group (``SETTING_GROUPS``) as field metadata: help() and
    docs/settings.md are built from it. ``vllm_only``: read by the vLLM connector alone."""
    extra: dict[str, object] = {"group": group}
    if vllm_only:
        extra["vllm_only"] = True
    return Meta(description=description, extra=extra)


class ConfigError(ValueError):
    """Settings that cannot work; raised before anything starts."""


class PushConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=SettingsMeta):
    """Settings of one engine's push transport; every duration is in seconds.

    Build it as ``PushConfig(engine_id="prefill-0", lease_duration=30.0)`` or
    ``PushConfig.from_dict(mapping)`` (vLLM: ``kv_connector_extra_config``); an unknown key or
    a value out of range is a ``ConfigError`` before anything starts. The settings below are
    grouped; [vLLM only] marks those only the vLLM connector reads (elsewhere they are accepted
    and do nothing). docs/settings.md is the same reference (``pushactors settings``)."""

    # --- essential ----------------------------------------------------------------------------
    engine_id: Annotated[
        str,
        Meta(min_length=1, max_length=256),
        _about(
            "essential",
            "This engine's name: unique in the deployment and the same across restarts (a pod's "
            "name). Peers find its agents and its side channel by it. With vLLM it comes from "
            "kv_transfer_config's engine_id.",
        ),
    ]
    role: Annotated[
        Role,
        _about(
            "essential",
            '"producer" (P: prefills and pushes), "consumer" (D: decodes, receives pushes) or '
            '"both". With vLLM it comes from kv_role (kv_producer, kv_consumer; anything else is both).',
        ),
    ] = "both"
    side_channel_host: Annotated[
        str,
        _about(
            "essential",
            "The address this engine's side channel (the ZMQ server its peers fetch handshakes "
            "from) binds and advertises. Across hosts, an address the peers can reach (the pod's "
            "IP), not 127.0.0.1.",
        ),
    ] = "127.0.0.1"
    side_channel_port: Annotated[
        int,
        Meta(ge=0, le=65535),
        _about(
            "essential",
            "The side channel's TCP port; 0 picks a free one (the scheduler advertises the real "
            "one). Fix it, and open it to the other engines, when a router or another host must "
            "reach this engine.",
        ),
    ] = 0
    backends: Annotated[
        tuple[str, ...],
        _about("essential", "The NIXL backends each rank's agent creates."),
    ] = ("UCX",)
    # --- pushes -------------------------------------------------------------------------------
    push_mode: Annotated[
        PushMode,
        _about(
            "pushes",
            '"whole": P WRITEs a request\'s KV once its prefill has ended. "layerwise": the engine '
            "announces a request whose prefill ends in the step about to run and reports each "
            "layer as its forward saves it (vLLM's save_kv_layer); P WRITEs each group of layers "
            "into D's blocks as soon as it is computed and D's registration matched, so the push "
            "ends right after the last layer instead of starting then. One completion when every "
            "layer landed; the same generations, deadlines and cancel rules as a whole push "
            '(docs/performance.md, "Layer-wise pushes").',
        ),
    ] = "whole"
    whole_push_start: Annotated[
        Literal["forward_end", "next_step"],
        _about(
            "pushes",
            'Whole pushes: "forward_end" (the default, the armed path) announces a request whose '
            "prefill ends in the step about to run (one token to generate, for a remote decode), "
            "matches and prepares its push while the forward runs, and hands its blocks to the "
            'transport when that step\'s forward ends (wait_for_save). "next_step": once the '
            "scheduler has processed the step's output (request_finished), at the next step's "
            "start: one engine step later; requests the engine does not announce always go so. "
            "Stays as an opt-out of the armed path and the baseline it is measured against "
            "(docs/nixl.md).",
        ),
    ] = "forward_end"
    layers_per_write: Annotated[
        int,
        Meta(ge=1, le=1 << 16),
        _about(
            "pushes",
            "Layer-wise: layers per WRITE (1: one WRITE per layer). Fewer, larger WRITEs cost "
            "less host time per request and land later.",
        ),
    ] = 1
    layerwise_save_wait: Annotated[
        float,
        Meta(ge=0, le=1.0),
        _about(
            "pushes",
            "Layer-wise, seconds: the engine's wait_for_save (the end of a step's forward) waits "
            "up to this long for the step's pushes to end on P's side, as vLLM's contract for it "
            'says ("block until all saves are done"): it waits for the forward\'s last kernels, '
            "hands the last layers over and waits while the writer posts them and sees them land "
            "with the completion sent. Otherwise the engine thread runs on into its next step, "
            "holding the interpreter the writer needs for the WRITE that ends the push (H100, 8B "
            "at 4k tokens: 0.81 ms instead of 1.08 ms from the last layer to D knowing). 0: "
            "return at once; the writer then polls the last layer's event on its own.",
        ),
    ] = 0.005
    kv_cache_layout: Annotated[
        Union[KVCacheLayoutName, None],
        _about(
            "pushes",
            "The KV cache layout the connector asks of vLLM (get_required_kvcache_layout); null "
            "keeps vLLM's default. Any layout is described as it is, so P and D may differ; vLLM's "
            "CPU backend takes only its default (LBHNC, alias HND).",
            vllm_only=True,
        ),
    ] = None
    # --- timing -------------------------------------------------------------------------------
    lease_duration: Annotated[
        Seconds,
        _about(
            "timing",
            "P: a finished prefill's blocks stay leased this long waiting for their push; D's "
            "heartbeats extend the lease. Past it P frees them and the push fails. Raise it when "
            "decode legs reach D late (a queue in front of D); abort_quarantine, engine_ttl and "
            "tombstone_ttl must grow with it (the timing rules).",
        ),
    ] = 30.0
    heartbeat_interval: Annotated[
        Union[Seconds, None],
        _about(
            "timing",
            "D: how often it heartbeats the requests it awaits; null: lease_duration / 6. Must be "
            "below 2/3 lease_duration, or leases lapse between beats.",
        ),
    ] = None
    registration_timeout: Annotated[
        Seconds,
        _about(
            "timing",
            "D: a registration whose push never arrived fails after this long (the request fails "
            "and its blocks are freed). Cover P's longest queue plus prefill.",
        ),
    ] = 480.0
    abort_quarantine: Annotated[
        Seconds,
        _about(
            "timing",
            "D: the blocks of an aborted or timed-out request stay unused this long at most when P "
            "does not answer. P posts no WRITE past D's promise for the registration (2/3 lease "
            "past its last heartbeat) and reports a WRITE still in flight write_timeout after its "
            "push's first WRITE as \"may still land\" (D then holds the blocks until P's final "
            "word), for every WRITE of a push. So it is safe when at least 2/3 lease_duration + "
            "write_timeout + 2 reaper_tick (enforced with the other timing rules; "
            'docs/reliability.md, "Timing rules").',
        ),
    ] = 45.0
    transfer_id_reuse_wait: Annotated[
        Seconds,
        _about(
            "timing",
            "D: a request that repeats the transfer id of a live one (a decode leg sent again "
            "after its client cancelled the first, before the engine's abort of the first got "
            "through) waits this long, unregistered, for the first to end; if the first is still "
            "live by then, both fail (never both registered).",
        ),
    ] = 5.0
    write_timeout: Annotated[
        Seconds,
        _about(
            "timing",
            "P: a push still in flight this long after its first WRITE is stuck (its peer likely "
            "gone or frozen; a layer-wise push counts from its first layer): no further layer or "
            "chunk of it is posted, D hears that it may still land, and P polls it until NIXL "
            "reports it ended before sending its final word. It is never released to cancel it: "
            "NIXL's release returns while a copy already started runs on (docs/security.md). Must "
            "stay below abort_quarantine.",
        ),
    ] = 20.0
    pinned_write_limit: Annotated[
        Union[Seconds, None],
        _about(
            "timing",
            "The longest any WRITE is assumed to run, the bound NIXL leaves open. D keeps an "
            "aborted request's blocks (or staging slot) for a WRITE that P said may still land at "
            "most this long after P said so, when P neither gives its final word nor is known "
            "dead. P releases a WRITE still running this long after its push's first WRITE, "
            "counts it (write.released_at_pin_limit), logs it at error level and fails the push. "
            "null: until P's final word or death, however long. At least write_timeout + 2 "
            "reaper_tick.",
        ),
    ] = 300.0
    cancel_settle: Annotated[
        Union[Seconds, None],
        _about(
            "timing",
            "Deprecated and ignored (accepted with a FutureWarning so old configs keep loading): P "
            "no longer trusts a cancel after a settle time; it waits for NIXL to report the WRITE "
            "ended (write_timeout, pinned_write_limit).",
        ),
    ] = None
    engine_ttl: Annotated[
        Seconds,
        _about(
            "timing",
            "Remote engines idle this long are forgotten (never while a transfer is in flight). "
            "At least abort_quarantine + 2 reaper_tick: D asks again about an unanswered abort "
            "only through a loaded agent.",
        ),
    ] = 3600.0
    tombstone_ttl: Annotated[
        Seconds,
        _about(
            "timing",
            "P: how long it remembers requests it finished, expired or failed, to answer late "
            "registrations and aborts asked again. At least abort_quarantine + 2 reaper_tick "
            "(and auth_window + 2 handshake_timeout with auth_keys).",
        ),
    ] = 600.0
    orphan_registration_ttl: Annotated[
        Seconds,
        _about("timing", "P: a registration that never meets its finished blocks is dropped after this long."),
    ] = 480.0
    handshake_timeout: Annotated[
        Seconds,
        _about(
            "timing",
            "One side-channel fetch, connect and reply together. On a lossy network raise this "
            "before the lease settings.",
        ),
    ] = 10.0
    reaper_tick: Annotated[
        Seconds,
        _about(
            "timing",
            "How often each rank's housekeeping runs (leases, watchdogs, quarantines); the "
            "timing rules count 2 ticks of margin.",
        ),
    ] = 0.05
    allow_unsafe_timing: Annotated[
        bool,
        _about(
            "timing",
            'Waive the timing rules (PushConfig.timing_violations; docs/reliability.md, "Timing '
            'rules"). They refuse settings under which a late WRITE could land in reused blocks, a '
            "stale message could be acted on, or a lost final answer could leave D holding blocks "
            "forever. Only tests of the timing itself (short quarantines, a tiny engine_ttl) set it.",
        ),
    ] = False
    allow_unsafe_quarantine: Annotated[
        bool,
        _about(
            "timing",
            "The former name of allow_unsafe_timing (it covered the quarantine rule only), still "
            "accepted so existing configs and tests keep loading: either one waives every timing rule.",
        ),
    ] = False
    # --- polling ------------------------------------------------------------------------------
    poll_interval_busy: Annotated[
        Seconds,
        _about(
            "polling",
            "The writer's NIXL polling interval while transfers are in flight. At most "
            "poll_interval_idle and reaper_tick.",
        ),
    ] = 0.0002
    poll_interval_idle: Annotated[
        Seconds,
        _about(
            "polling",
            "The writer's polling interval with nothing in flight or awaited. Quiet for a second "
            "and holding nothing on a timer, the writer polls every 5 intervals instead: an idle "
            "P+D pair then costs under 2% of one core, most of it NIXL's own threads. A message "
            "(a push to post, a registration to send) or an engine step with work brings the "
            "writer back at once whatever this is; only inbound traffic to a rank whose engine "
            "is not stepping waits up to one (deep) interval.",
        ),
    ] = 0.02
    poll_busy_linger: Annotated[
        float,
        Meta(ge=0, le=60),
        _about(
            "polling",
            "Seconds: after traffic (a registration sent, a notification received) the "
            "writer keeps the busy interval this long before backing off, since an answer is "
            "usually on its way (0: back off at once).",
        ),
    ] = 0.05
    poll_await: Annotated[
        float,
        Meta(ge=0),
        _about(
            "polling",
            "D, seconds: after sending a registration the writer polls at poll_interval_await "
            "until its answer (completion or failure) arrives, for this long at most: a prefill "
            "can outlast any linger, and a landed push must be picked up at once. Stays with "
            "NIXL's progress thread: that thread queues the completion, but only the writer's "
            "poll hands it to D. With nothing awaited it backs off to poll_interval_idle (0: "
            "linger only).",
        ),
    ] = 30.0
    poll_interval_await: Annotated[
        Seconds,
        _about(
            "polling",
            "D: the polling interval while an answer is awaited (at most poll_interval_busy); P "
            "uses it for a layer-wise push's last layer. Picking a landed push up is on its "
            "critical path: H200, 1 MiB push, WRITE posted to D routing the completion, 480 µs "
            "p50 at 0.2 ms, 190 µs at 0.05 ms. Cost while a request waits with nothing else to do "
            "(2-core CI machine): 0.17 to 0.28 cores (real NIXL, P and D in one process). Raise "
            "it where D's CPU matters more.",
        ),
    ] = 0.00005
    poll_timer_slack: Annotated[
        Union[Annotated[float, Meta(gt=0, le=0.001)], None],
        _about(
            "polling",
            "Linux, seconds: the writer thread's timer slack, how late past its deadline a timed "
            "wait may end. The kernel's default, 50 µs, stretches the await interval: a 50 µs "
            "wait slept 108 µs p50 on the 2-core CI machine, 59 µs at 1e-6, at the cost of the "
            "polls it adds (0.13-0.19 cores unset, 0.29-0.31 at 1e-6, a request awaited, P and D "
            "in one process). Only the writer's thread changes. null: the thread's own.",
        ),
    ] = None
    await_timer_slack: Annotated[
        Union[Annotated[float, Meta(gt=0, le=0.001)], None],
        _about(
            "polling",
            "Linux, seconds: the writer thread's timer slack only while it polls at "
            "poll_interval_await (D awaiting an answer, P a layer-wise push's last layer), a wait "
            "on every push's critical path that lasts one prefill at most. H100, 8B, layer-wise, "
            "last layer to D knowing, p50: 4k tokens 0.601 ms (0.620 unset), 256 tokens "
            "0.34-0.42 ms (0.43-0.48). Cost: D's polling CPU while a request is awaited, 0.22 "
            "cores instead of 0.13 (2-core CI machine). null: the thread's own slack throughout "
            "(or poll_timer_slack's).",
        ),
    ] = 1e-6
    poll_spin: Annotated[
        float,
        Meta(ge=0, le=0.01),
        _about(
            "polling",
            "Seconds: after posting a WRITE that is not done at once, the writer checks it in a "
            "tight loop for up to this long before falling back to the busy interval, since a "
            "small WRITE settles within tens of microseconds (0: no spin). Stays with NIXL's "
            "progress thread: that thread moves the WRITE, but P learns it ended (and clears its "
            "lease, and the engine hook lending it the interpreter returns) only when the writer "
            "checks.",
        ),
    ] = 0.0001
    poll_spin_in_flight: Annotated[
        float,
        Meta(ge=0, le=0.05),
        _about(
            "polling",
            "Seconds: after that spin, while the WRITE is in flight the writer checks it on every "
            "turn of its loop (messages still handled in between) for up to this long after "
            "posting it, so a large WRITE's end is seen when it happens, not up to a busy interval "
            "later (0: back to the busy interval). Stays for the reason poll_spin does.",
        ),
    ] = 0.002
    switch_interval: Annotated[
        Union[Annotated[float, Meta(gt=0, le=0.1)], None],
        _about(
            "polling",
            "Seconds: the interpreter's switch interval (sys.setswitchinterval), set when a worker "
            "starts; null leaves the process's own (CPython: 5 ms). Process-wide. Every mailbox "
            "hop gives up the interpreter lock; while an engine thread runs Python, taking it "
            "back can wait a whole interval. Measured before NIXL's progress thread was on and "
            'pushes were armed (docs/performance-history.md, "2026-12-03"): 1 MiB push beside an engine '
            "thread busy in Python half the time, H200 p50 6.6 ms at 5 ms, 1.1 ms at 0.2 ms. "
            "Stays opt-in for engines whose own threads hold the interpreter outside the hooks "
            "that lend it (hook_lend_max); re-measure before setting it.",
        ),
    ] = None
    hook_lend_max: Annotated[
        float,
        Meta(ge=0, le=1.0),
        _about(
            "polling",
            "Seconds: when an engine step gave the actors work (blocks to push, a registration "
            "to send) or a WRITE or an answer is outstanding, the connector's hook lends them the "
            "interpreter: it blocks, lock released, until they are done with it and the writer "
            "has polled once, for at most this long (core/handoff.py). 0: never lend. Stays with "
            "NIXL's progress thread: that thread moves a posted WRITE in C++, but the hops before "
            "the post and the post itself run in Python.",
        ),
    ] = 0.002
    # --- NIXL ---------------------------------------------------------------------------------
    nixl_num_threads: Annotated[
        int,
        Meta(ge=0, le=64),
        _about(
            "nixl",
            "UCX backend threads (nixl_agent_config(num_threads=N)). 0: one UCX worker, "
            "progressed by the writer's polls and NIXL's progress thread. N > 0: NIXL's "
            "thread-pool engine, N more UCX workers on their own threads that split large "
            "transfers. They help only pushes posted as thousands of small descriptors, which "
            "staging serves better (H200, with nixl_sgl: 16,384 x 32 KiB at 16.4 GB/s instead of "
            "4 GB/s); on small CPU machines they take cores from the engine (docs/nixl.md, "
            '"Tuning"). vLLM\'s own num_threads key is ignored; use this one.',
        ),
    ] = 0
    nixl_sgl: Annotated[
        bool,
        _about(
            "nixl",
            "Batched (scatter-gather) copies for WRITEs in NIXL's UCX backend: sets "
            "NIXL_UCX_SGL_ENABLE=1 in the process before each agent is created (a value already "
            "in the environment wins). Caution (nixl 1.5.1): a WRITE cancelled in flight over "
            "UCX's TCP transport crashes P or D soon after (SIGSEGV); not seen over shared memory.",
        ),
    ] = False
    nixl_progress_thread: Annotated[
        bool,
        _about(
            "nixl",
            "NIXL's own progress thread, in C++: it moves a WRITE and its notification while the "
            "writer waits for the interpreter (beside a busy engine, P's WRITE ended 2.2 ms after "
            "its post without it, 42 µs with it: H100, docs/nixl.md). It sleeps on UCX's events "
            "(nixl_progress_delay), not on a spinning core. false: progress only in the writer's "
            "polls.",
        ),
    ] = True
    nixl_progress_delay: Annotated[
        float,
        Meta(ge=0, le=1.0),
        _about(
            "nixl",
            "Seconds the progress thread sleeps on UCX's events before looking anyway (NIXL rounds "
            "it up to whole milliseconds); 0: NIXL's own busy loop, a core spinning (0.45-1 s of "
            "CPU per idle second on the 2-core CI machine).",
        ),
    ] = 0.01
    post_runs: Annotated[
        bool,
        _about(
            "nixl",
            "A direct WRITE whose pieces join into runs contiguous on both sides (blocks in "
            "order) is posted as those runs, in two descriptor lists prepared for it, when they "
            "are at most half its pieces; false: always one prepared descriptor per piece "
            "(docs/performance.md).",
        ),
    ] = True
    post_runs_min_pieces: Annotated[
        int,
        Meta(ge=0),
        _about(
            "nixl",
            "post_runs only for a WRITE of at least this many pieces: a small one posts faster by "
            "index into the lists prepared once per pairing (2-core CI machine, DRAM, 64 KiB "
            "blocks in order, post p50: 1 / 4 / 16 blocks by index 11 / 26 / 89 µs, as one run "
            "20 / 34 / 113 µs). A layer-wise push's last WRITE goes as runs at any size (its "
            "lists are prepared when the push opens).",
        ),
    ] = 64
    # --- staging ------------------------------------------------------------------------------
    staging_bytes: Annotated[
        int,
        Meta(ge=0, lt=1 << 44),
        _about(
            "staging",
            "Bytes of this rank's staging buffer (on the KV device, registered with NIXL); 0: "
            "off. D offers a slot of it to a request whose blocks are scattered; P gathers into "
            "its own slot and WRITEs a few large spans instead of one descriptor per block piece "
            '(docs/performance.md, "Staged pushes").',
        ),
    ] = 0
    staging_min_runs: Annotated[
        int,
        Meta(ge=0, le=1 << 30),
        _about(
            "staging",
            "D stages a request only when its registered blocks form more runs of consecutive ids "
            "than this, and its image is at least staging_min_bytes (small pushes go direct).",
        ),
    ] = 8
    staging_min_bytes: Annotated[
        int,
        Meta(ge=0, lt=1 << 44),
        _about("staging", "D stages only requests whose KV image is at least this many bytes."),
    ] = 1 << 20
    staging_gather_runs: Annotated[
        int,
        Meta(ge=0, le=1 << 30),
        _about(
            "staging",
            "P gathers a staged push into its own slot only when its pieces, joined where "
            "contiguous on both sides, form more runs than this; fewer are written straight from "
            "its blocks into D's slot, one descriptor per run (a gather costs ~1 ms of host and "
            "device work on the H200, a descriptor ~6-10 µs). 0: always gather (when P has room).",
        ),
    ] = 128
    staging_chunk_bytes: Annotated[
        int,
        Meta(ge=0, lt=1 << 44),
        _about(
            "staging",
            "A staged push is gathered and written in chunks of about this many bytes, so chunk "
            "i+1 is gathered while chunk i is in flight (0: one chunk). Each chunk costs a fixed "
            "host round (~0.3 ms on the H200 host), so small chunks lose: H200, 512 MiB "
            "scattered, 16 chunks of 32 MiB moved 28.5 GB/s on P, one chunk 161 GB/s.",
        ),
    ] = 1 << 30
    # --- security -----------------------------------------------------------------------------
    trusted_peers: Annotated[
        tuple[str, ...],
        _about(
            "security",
            "P starts a handshake from an unverified registration only with these peers: engine "
            'ids and/or host networks ("decode-0", "10.1.0.0/16", "127.0.0.1"). Empty: any '
            "address, but the registration's sender must be the agent that address advertises "
            "(docs/security.md).",
        ),
    ] = ()
    auth_keys: Annotated[
        dict[str, str],
        _about(
            "security",
            "Opt-in HMAC-SHA256 on side-channel exchanges and control notifications: key id to "
            'secret (at least 16 bytes; "hex:..." for hex). Messages are signed with auth_key_id; '
            "every listed key verifies (rotation: add the new key everywhere, then switch "
            "auth_key_id).",
        ),
    ] = {}
    auth_key_id: Annotated[
        Union[str, None],
        _about("security", "The key of auth_keys this engine signs with (required with auth_keys)."),
    ] = None
    auth_window: Annotated[
        Seconds,
        _about(
            "security",
            "A signed message older or newer than this by the receiver's wall clock is refused "
            "(the replay bound): keep clocks within it (NTP).",
        ),
    ] = 60.0
    require_transfer_id: Annotated[
        bool,
        _about("security", "P refuses registrations without a matching transfer_id."),
    ] = False
    verify: Annotated[
        str,
        _about(
            "security",
            "D checks the bytes it will read against P's digest of the bytes P pushed, after they "
            'landed; a mismatch fails the request ("KV digest mismatch"). "off", "all", or '
            '"sample:N": one request in N, picked from D\'s request id. D decides and asks in its '
            "registration, so P's own setting never has to match; P computes a digest whenever "
            'one is asked for (docs/protocol.md, "Verified push").',
        ),
    ] = "off"
    # --- limits -------------------------------------------------------------------------------
    tombstone_keep: Annotated[
        int,
        Meta(ge=0, le=1 << 20),
        _about(
            "limits",
            "P: at most this many tombstones (tombstone_ttl) per rank, the oldest forgotten "
            "first. They only answer late messages at once (a reused id, an abort asked again); a "
            "copy of a registration P took is told by its generation, so forgetting one never "
            "lets a byte land (docs/security.md).",
        ),
    ] = 64
    handshake_workers: Annotated[
        int,
        Meta(ge=1, le=64),
        _about("limits", "Parallel side-channel fetches per rank (a slow peer never delays the others)."),
    ] = 4
    max_remote_agents: Annotated[
        int,
        Meta(ge=1, le=1 << 16),
        _about(
            "limits",
            "Remote agents loaded at once; idle ones are evicted first, never one with work in flight.",
        ),
    ] = 1024
    max_handshakes_in_flight: Annotated[
        int,
        Meta(ge=1, le=1024),
        _about("limits", "Handshakes in flight at once (each on its own thread); one address is fetched once."),
    ] = 64
    max_parked_per_peer: Annotated[
        int,
        Meta(ge=1, le=1 << 20),
        _about(
            "limits",
            "Work parked behind one peer's handshake; past it, new work for that peer fails at once.",
        ),
    ] = 65536
    max_tick_failures: Annotated[
        int,
        Meta(ge=1, le=1 << 20),
        _about(
            "limits",
            "An actor whose timer (tick) raises this many times in a row is declared dead: its "
            "rank turns unhealthy and fails what it holds, instead of looking healthy while "
            "nothing moves.",
        ),
    ] = 50
    # --- diagnostics --------------------------------------------------------------------------
    log_json: Annotated[
        Union[str, None],
        _about(
            "diagnostics",
            "Where the JSON-lines mailbox log goes, one file per process "
            "(<stem>.scheduler.<pid>.jsonl, <stem>.worker.<pid>.jsonl); null: not written. "
            "Elsewhere call pushactors.configure_logging(json_path=...) (docs/operations.md).",
            vllm_only=True,
        ),
    ] = None
    log_max_bytes: Annotated[
        int,
        Meta(ge=0),
        _about(
            "diagnostics",
            "A ``log_json`` file is rotated before it grows past this many bytes (0: never): it "
            "becomes FILE.1, FILE.1 becomes FILE.2, and so on.",
            vllm_only=True,
        ),
    ] = 256 << 20
    log_backups: Annotated[
        int,
        Meta(ge=1),
        _about(
            "diagnostics", "Rotated ``log_json`` files kept (FILE.1 .. FILE.N); the oldest is deleted.", vllm_only=True
        ),
    ] = 4
    stats_interval: Annotated[
        float,
        Meta(ge=0),
        _about(
            "diagnostics",
            "Seconds: every rank logs one rank.stats event this often (mailbox depths, table "
            "sizes, counters: what pushactors top shows); 0 turns it off.",
        ),
    ] = 2.0
    timeline: Annotated[
        bool,
        _about(
            "diagnostics",
            "Stamp each push's critical steps in memory (core/timeline.py): P's post of the WRITE "
            "the completion rides on and the check that saw it done, D's poll that read the "
            "completion and its report. For breakdowns that logs would distort (pushactors bench "
            "layerwise --timeline); one uncontended lock per stamp.",
        ),
    ] = False
    debug_allow_noise: Annotated[
        bool,
        _about(
            "diagnostics",
            'Test-only negative control: a request whose id contains "pushactors-debug-noise" '
            "pushes noise instead of its KV.",
            vllm_only=True,
        ),
    ] = False

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
        verify_share(self.verify)  # raises ConfigError for anything but off, all, sample:N
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

    def verifies(self, request_id: str) -> bool:
        """Whether D verifies the push of ``request_id`` (``verify``): every one, none, or one
        in N picked by a hash of the id (the same id, the same answer, on every rank)."""
        every = verify_share(self.verify)
        if every <= 1:
            return every == 1
        digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % every == 0

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
        """Seconds between D's lease heartbeats: ``heartbeat_interval``, else a sixth of
        ``lease_duration``."""
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
        """A copy with ``changes`` applied (the settings are frozen)."""
        return msgspec.structs.replace(self, **changes)


_SECONDS_META = get_args(Seconds)[1]


def _in_seconds(hint: object) -> bool:
    """Whether a field's type is, or has among its options, ``Seconds``."""
    return any(arg == _SECONDS_META or _in_seconds(arg) for arg in get_args(hint))


_SECONDS_FIELDS = tuple(
    name for name, hint in typing.get_type_hints(PushConfig, include_extras=True).items() if _in_seconds(hint)
)
# help(PushConfig) and pydoc print every setting with its type, default and description.
PushConfig.__doc__ = f"{inspect.cleandoc(PushConfig.__doc__ or '')}\n{settings_text(PushConfig, SETTING_GROUPS)}"


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


def verify_share(setting: object) -> int:
    """``verify`` as one request in how many: 0 (off), 1 (all) or N (``sample:N``)."""
    if setting == "off":
        return 0
    if setting == "all":
        return 1
    if isinstance(setting, str) and setting.startswith("sample:"):
        n = setting[len("sample:") :]
        if n.isdigit() and 1 <= int(n) <= 1 << 20:
            return int(n)
    raise ConfigError(f"verify {setting!r} is not one of off, all, sample:N (N an integer 1-1048576)")
