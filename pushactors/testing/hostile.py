"""A hostile third process for integrity tests: it forges control messages at a real P and D.

:func:`hostile_main` runs in its own OS process (like :mod:`pushactors.testing.node`), with its own real
NIXL agent (``mallory`` by default) and its own registered DRAM. It knows the protocol but holds
no key:

1. it fetches P's and D's handshake payloads over their ZMQ side channels (or, when they are
   keyed and refuse it, uses payloads *captured off the wire*: a sealed reply is signed, not
   encrypted), decodes them with the compatibility hash read from the envelope, and loads both
   agents;
2. it serves two side channels of its own: one claiming D's engine id (for P), one claiming
   P's engine id (for D); each advertises its own agent and its own DRAM laid out like the
   engine it pretends to be, so a WRITE that wrongly trusted it would land in its memory;
3. optionally (``impersonate``) it creates agents named exactly like P's and D's rank agents;
   NIXL does not authenticate agent names, so their notifications arrive under the real
   peers' names (only HMAC tells them apart);
4. it then sends, in a loop bounded by a message count and a duration (it stops by itself,
   or earlier when told), forged messages:

   * to P: ``PUSH_REG`` naming the real P engine with guessed ids (the soak's naming
     ``req-<i>-0-<8 hex>``, ``tx-<i>`` transfer ids, the base id as P's id), naming its own side
     channel (admitted: it *is* the agent that address advertises) or D's real address
     (refused: it is not D's agent); ``HB:`` for live-looking P ids, transfer ids and base
     ids; ``PUSH_ABORT`` for guessed and leaked D ids;
   * to D: completions and ``PUSH_FAIL`` (final and not) for guessed and leaked D ids, and
     ``PUSH_REG`` naming its own P-like side channel or P's real address.

   Ids the parent leaks (``leak``: exact D and P request ids, never transfer ids) model ids
   seen in logs or on the wire; they make forgeries name live requests exactly.

At the end it reports over its pipe: messages sent per kind and per sending agent, send errors,
what it received, how its fetches went, and how many bytes of its own memory anything wrote
(a non-zero count means KV was pushed to it). Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import random
import secrets
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from ..protocol import (
    Abort,
    AgentInfo,
    ClockSample,
    HandshakeEnvelope,
    HandshakeRequest,
    PeerKey,
    PushFailure,
    RegionInfo,
    Registration,
    decode_handshake,
    encode_abort,
    encode_completion,
    encode_heartbeat,
    encode_push_failure,
    encode_registration,
    notification_kind,
)
from ..transport.auth import MAGIC, Keyring
from .node import exit_status

HOST = "127.0.0.1"
MAX_OWN_BYTES = 64 << 20  # the hostile's own registered DRAM, at most
NOTIF = b"notif"  # the MAC context of notifications (a hostile knows the protocol)


@dataclass(frozen=True)
class EngineAddr:
    """Where an engine's side channel is (what the parent learnt from its node)."""

    engine_id: str
    port: int
    tp_size: int = 1
    host: str = HOST


@dataclass(frozen=True)
class HostileSpec:
    p: EngineAddr
    d: EngineAddr
    name: str = "mallory"
    # Bounds: the loop stops after this many messages or this many seconds, whichever first.
    max_messages: int = 3000
    duration: float = 30.0
    # Messages per round, and the pause between rounds (paced so a 2-core box still runs P and D).
    batch: int = 4
    interval: float = 0.004
    # The soak's size: ids are guessed as req-<i>-0-<8 hex> for i below it.
    guess_range: int = 400
    seed: int = 0
    # Also send through agents named exactly like P's and D's rank agents (and seal some
    # messages with keys of its own, one named like the engines' key id).
    impersonate: bool = False
    guess_key_id: str = "k1"
    # Handshake payloads captured off the wire ("p"/"d" -> rank -> payload), used when a keyed
    # side channel refuses the hostile's own fetch.
    captured: dict[str, dict[int, bytes]] = field(default_factory=dict)
    # Messages sent before reporting "ready" (so some land before the soak starts).
    opening_burst: int = 40
    # Registrations also name leaked D ids exactly (a forged registration that reaches P before
    # D's own would hold that D slot). Off: registrations name guessed ids only.
    squat: bool = False
    # Its side channels serve the *real* D's and P's payloads (their agent names and memory)
    # instead of its own, and it makes P and D handshake with them before the soak starts.
    replay_metadata: bool = False


# ============================================================================================
# Process entry point
# ============================================================================================
def hostile_main(spec: HostileSpec, conn: Connection) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    hostile: _Hostile | None = None
    try:
        hostile = _Hostile(spec, conn)
        hostile.setup()
        hostile.run()
        conn.send(("report", hostile.report()))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        if hostile is not None:
            hostile.close()


def unseal_unverified(raw: bytes) -> bytes:
    """The payload of a sealed message, read without a key (a seal signs, it does not hide)."""
    if not raw.startswith(MAGIC):
        return raw
    parts = raw.split(b":", 4)  # magic, key id, ts, tag, payload
    if len(parts) != 5:
        raise ValueError("not a sealed message")
    return parts[4]


def _read_handshake(raw: bytes) -> AgentInfo:
    """Decode a handshake payload as any peer would, with the hash its envelope carries."""
    env = msgspec.msgpack.decode(raw, type=HandshakeEnvelope)
    return decode_handshake(raw, expected_hash=env.compat_hash, expected_engine=None)


def _compat_hash(raw: bytes) -> str:
    return msgspec.msgpack.decode(raw, type=HandshakeEnvelope).compat_hash


class _Hostile:
    def __init__(self, spec: HostileSpec, conn: Connection) -> None:
        self.spec = spec
        self.conn = conn
        self.rng = random.Random(spec.seed)
        self.sent: Counter[str] = Counter()
        self.sent_by_agent: Counter[str] = Counter()
        self.send_errors: Counter[str] = Counter()
        self.received: Counter[str] = Counter()
        self.received_from: Counter[str] = Counter()
        self.fetch: dict[str, str] = {}
        self.findings: list[str] = []
        self.leaked_d: list[str] = []
        self.leaked_p: list[str] = []
        self.stop_asked = False
        self._servers: list[Any] = []
        self._agents: dict[str, Any] = {}  # local name -> NixlAgent (one per impersonated name)
        self._buf = np.zeros(0, dtype=np.uint8)
        self._routes: list[tuple[str, str, str]] = []  # (sending agent, target agent, "p"/"d")
        self.p_infos: list[AgentInfo] = []
        self.d_infos: list[AgentInfo] = []
        self.hash = ""
        self.as_d: Any = None  # SideChannelServer claiming D's engine id
        self.as_p: Any = None  # SideChannelServer claiming P's engine id
        self._keys: dict[str, Keyring] = {}

    # --- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        from ..transport.nixl import NixlAgent
        from ..transport.sidechannel import SideChannelClient, SideChannelServer

        spec = self.spec
        client = SideChannelClient()
        raw_p = [self._fetch(client, "p", spec.p, r) for r in range(spec.p.tp_size)]
        raw_d = [self._fetch(client, "d", spec.d, r) for r in range(spec.d.tp_size)]
        self.p_infos = [_read_handshake(r) for r in raw_p]
        self.d_infos = [_read_handshake(r) for r in raw_d]
        self.hash = _compat_hash(raw_p[0])

        me = NixlAgent(spec.name)
        self._agents[spec.name] = me
        # Its own DRAM, laid out like both engines' regions (mirrors point into it).
        need = max(_span(self.p_infos[0].regions), _span(self.d_infos[0].regions), 4096)
        self._buf = np.zeros(min(need, MAX_OWN_BYTES), dtype=np.uint8)
        me.register_memory(np.array([(self._buf.ctypes.data, self._buf.nbytes, 0)], dtype=np.uint64), "DRAM")
        own_metadata = me.get_agent_metadata()
        for side, infos in (("p", self.p_infos), ("d", self.d_infos)):
            for info in infos:
                me.add_remote_agent(info.agent_metadata)
                self._routes.append((spec.name, info.agent_name, side))

        # Side channels of its own: one claims D's engine (P handshakes with it on a forged
        # registration), one claims P's engine (for D). Both advertise mallory's agent.
        self.as_d = SideChannelServer(HOST, 0, engine_id=spec.d.engine_id)
        self.as_p = SideChannelServer(HOST, 0, engine_id=spec.p.engine_id)
        self._servers += [self.as_d, self.as_p]
        for server, infos in ((self.as_d, self.d_infos), (self.as_p, self.p_infos)):
            for info in infos:
                server.publish(info if spec.replay_metadata else self._mirror(info, own_metadata), self.hash)

        if spec.impersonate:
            # Agents named like the real ranks: like P's when talking to D, like D's to P.
            for victim, targets, side in ((self.p_infos, self.d_infos, "d"), (self.d_infos, self.p_infos, "p")):
                for info in victim:
                    try:
                        agent = NixlAgent(info.agent_name)
                        for target in targets:
                            agent.add_remote_agent(target.agent_metadata)
                            self._routes.append((info.agent_name, target.agent_name, side))
                        self._agents[info.agent_name] = agent
                    except Exception as exc:  # a finding, not a crash: record what NIXL refused
                        self.findings.append(f"impersonating {info.agent_name!r} failed: {exc!r}")
        self._keys = {
            "wrong_key": Keyring({spec.guess_key_id: secrets.token_bytes(32)}, spec.guess_key_id),
            "unknown_key": Keyring({"mallory-key": secrets.token_bytes(32)}, "mallory-key"),
        }
        # Open with a registration naming its own side channel at every rank, so P and D
        # handshake with it before anything else; then a burst of everything.
        for route in list(self._routes):
            if route[0] == spec.name:
                self._send_one(route, "reg_own_addr")
        for _ in range(spec.opening_burst):
            self._send_one()
            self._pump()
        if spec.replay_metadata:
            deadline = time.monotonic() + 10.0
            while (self.as_d.requests == 0 or self.as_p.requests == 0) and time.monotonic() < deadline:
                self._pump()
                time.sleep(0.01)
        self.conn.send(
            (
                "ready",
                {
                    "pid": os.getpid(),
                    "as_d_port": self.as_d.port,
                    "as_p_port": self.as_p.port,
                    "agents": sorted(self._agents),
                    "fetch": dict(self.fetch),
                    "findings": list(self.findings),
                },
            )
        )

    def _fetch(self, client: Any, side: str, addr: EngineAddr, rank: int) -> bytes:
        from ..transport.directory import SideChannelError

        peer = PeerKey(addr.engine_id, addr.host, addr.port, 0, rank)
        request = HandshakeRequest(pp_rank=0, tp_rank=rank, requester_engine_id="mallory", requester_agent="mallory")
        try:
            raw: bytes = client.fetch(peer, request, timeout=5.0)
            self.fetch[f"{side}{rank}"] = "fetched"
            return raw
        except SideChannelError as exc:
            captured = self.spec.captured.get(side, {}).get(rank)
            if captured is None:
                raise
            self.fetch[f"{side}{rank}"] = f"refused ({exc.kind}); used a captured payload"
            return unseal_unverified(captured)

    def _mirror(self, info: AgentInfo, own_metadata: bytes) -> AgentInfo:
        """``info`` with the hostile's own agent; every region aliases the hostile's buffer."""
        base = int(self._buf.ctypes.data)
        regions = tuple(
            RegionInfo(
                base_addr=base,
                block_len=r.block_len,
                stride=r.block_len,
                num_blocks=max(1, min(r.num_blocks, self._buf.nbytes // r.block_len)),
                members=r.members,
                group=r.group,
            )
            for r in info.regions
        )
        return msgspec.structs.replace(
            info,
            agent_name=self.spec.name,
            agent_metadata=own_metadata,
            regions=regions,
            clock=ClockSample(monotonic=time.monotonic(), wall=time.time()),
        )

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        spec = self.spec
        deadline = time.monotonic() + spec.duration
        while not self.stop_asked and sum(self.sent.values()) < spec.max_messages and time.monotonic() < deadline:
            self._commands()
            for _ in range(spec.batch):
                self._send_one()
            self._pump()
            if self.conn.poll(spec.interval):
                self._commands()
        # Let queued sends go out and answers come back before reporting.
        settle = time.monotonic() + 0.5
        while time.monotonic() < settle:
            self._pump()
            time.sleep(0.01)

    def _commands(self) -> None:
        while self.conn.poll(0):
            cmd = self.conn.recv()
            if cmd[0] == "stop":
                self.stop_asked = True
            elif cmd[0] == "leak":
                self.leaked_d.append(cmd[1])
                self.leaked_p.append(cmd[2])
                del self.leaked_d[:-64], self.leaked_p[:-64]

    def _pump(self) -> None:
        # No progress thread: sends go out and notifications come in while the agents are polled.
        for agent in self._agents.values():
            try:
                notifs = agent.get_new_notifs()
            except Exception as exc:
                self.send_errors[f"poll:{type(exc).__name__}"] += 1
                continue
            for sender, msgs in notifs.items():
                for raw in msgs:
                    self.received[notification_kind(unseal_unverified(bytes(raw)))] += 1
                    self.received_from[sender] += 1

    # --- forgeries ----------------------------------------------------------------------------
    def _guess_d_id(self, *, leaked: bool = True) -> str:
        if leaked and self.leaked_d and self.rng.random() < 0.5:
            return self.rng.choice(self.leaked_d)
        return f"req-{self.rng.randrange(self.spec.guess_range)}-0-{self.rng.getrandbits(32):08x}"

    def _guess_p_id(self) -> str:
        if self.leaked_p and self.rng.random() < 0.5:
            return self.rng.choice(self.leaked_p)
        return f"req-{self.rng.randrange(self.spec.guess_range)}-0-{self.rng.getrandbits(32):08x}"

    def _guess_tid(self) -> str | None:
        roll = self.rng.random()
        if roll < 0.4:
            return f"tx-{self.rng.randrange(self.spec.guess_range)}"
        if roll < 0.7:
            return secrets.token_hex(8)
        return None

    def _registration(self, to: AgentInfo, decode: AgentInfo, port: int, d_tp_rank: int) -> Registration:
        """A PUSH_REG to engine ``to`` naming ``decode``'s engine id at ``port`` as the D rank."""
        d_id = self._guess_d_id(leaked=self.spec.squat)
        base = d_id.rsplit("-", 1)[0]
        cap = max(1, min(r.num_blocks for r in decode.regions) // max(1, decode.physical_blocks_per_logical))
        blocks = self.rng.sample(range(cap), k=min(cap, self.rng.randint(1, 8)))
        return Registration(
            request_id=d_id,
            decode_engine_id=decode.engine_id,
            decode_host=HOST,
            decode_port=port,
            decode_tp_size=decode.tp_size,
            decode_tp_rank=d_tp_rank,
            local_block_ids=tuple(blocks),
            remote_engine_id=to.engine_id,
            remote_host=HOST,
            remote_port=self.spec.p.port if to.engine_id == self.spec.p.engine_id else self.spec.d.port,
            remote_tp_size=to.tp_size,
            remote_pp_size=to.pp_size,
            transfer_id=self._guess_tid(),
            remote_request_id=self.rng.choice([base, None, self._guess_p_id()]),
        )

    def _forge(self, side: str, target: AgentInfo, kind: str = "") -> tuple[str, bytes]:
        """One forged message for ``target`` (a P rank when side == "p", else a D rank)."""
        rng = self.rng
        if side == "p":
            kind = kind or rng.choice(["reg_own_addr", "reg_d_addr", "heartbeat", "heartbeat", "abort", "abort"])
            if kind == "reg_own_addr":
                d = rng.choice(self.d_infos)
                return kind, encode_registration(self._registration(target, d, self.as_d.port, d.tp_rank))
            if kind == "reg_d_addr":
                d = rng.choice(self.d_infos)
                return kind, encode_registration(self._registration(target, d, self.spec.d.port, d.tp_rank))
            if kind == "heartbeat":
                ids = []
                for _ in range(rng.randint(1, 6)):
                    pid = self._guess_p_id()
                    ids.append(rng.choice([pid, pid.rsplit("-", 1)[0], f"tx-{rng.randrange(self.spec.guess_range)}"]))
                return kind, encode_heartbeat(ids)
            d_id = self._guess_d_id()
            return kind, encode_abort(
                Abort(
                    request_id=d_id,
                    transfer_id=self._guess_tid(),
                    remote_request_id=rng.choice([d_id.rsplit("-", 1)[0], None]),
                    decode_tp_rank=rng.randrange(self.spec.d.tp_size),
                    reason="forged",
                )
            )
        kind = kind or rng.choice(
            ["completion", "completion", "push_fail", "push_fail_pin", "reg_own_addr", "reg_p_addr"]
        )
        if kind == "completion":
            return kind, encode_completion(self._guess_d_id(), self.spec.p.tp_size)
        if kind in ("push_fail", "push_fail_pin"):
            return kind, encode_push_failure(
                PushFailure(
                    request_id=self._guess_d_id(),
                    reason="forged push failure",
                    tp_rank=rng.randrange(self.spec.p.tp_size),
                    final=kind == "push_fail",
                )
            )
        p = rng.choice(self.p_infos)
        port = self.as_p.port if kind == "reg_own_addr" else self.spec.p.port
        # D is no P, but a registration to it names a "decode" side it may handshake with.
        return kind, encode_registration(self._registration(target, p, port, p.tp_rank))

    def _send_one(self, route: tuple[str, str, str] | None = None, kind: str = "") -> None:
        sender, target_name, side = route or self.rng.choice(self._routes)
        infos = self.p_infos if side == "p" else self.d_infos
        target = next(i for i in infos if i.agent_name == target_name)
        kind, payload = self._forge(side, target, kind)
        seal = "none"
        if sender != self.spec.name and self.rng.random() < 0.3:
            seal = self.rng.choice(["wrong_key", "unknown_key"])
            payload = self._keys[seal].seal(NOTIF, payload)
        label = f"{side}.{kind}"
        try:
            self._agents[sender].send_notif(target_name, payload)
        except Exception as exc:
            self.send_errors[f"{label}:{type(exc).__name__}"] += 1
            return
        self.sent[label] += 1
        self.sent_by_agent[f"{sender}->{target_name}" + ("" if seal == "none" else f" ({seal})")] += 1

    # --- the end ------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        return {
            "sent": dict(self.sent),
            "total": sum(self.sent.values()),
            "by_agent": dict(self.sent_by_agent),
            "send_errors": dict(self.send_errors),
            "received": dict(self.received),
            "received_from": dict(self.received_from),
            "fetch": dict(self.fetch),
            "findings": list(self.findings),
            "agents": sorted(self._agents),
            # Bytes of its own memory something wrote into: KV pushed to the hostile.
            "own_bytes_written": int(np.count_nonzero(self._buf)),
            "handshakes_served": {f"as_{s.engine_id}": s.requests for s in self._servers},
            "introductions": sorted({f"{i.engine_id}:{i.agent}" for s in self._servers for i in list(s.introductions)}),
        }

    def close(self) -> None:
        for server in self._servers:
            with contextlib.suppress(Exception):
                server.close()


def _span(regions: tuple[RegionInfo, ...]) -> int:
    return max((r.block_len * r.num_blocks for r in regions), default=0)


# ============================================================================================
# The parent's handle
# ============================================================================================
class Hostile:
    """Starts :func:`hostile_main` in a spawned process and collects its report."""

    def __init__(self, spec: HostileSpec) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=hostile_main, args=(spec, child), name="pushactors-hostile", daemon=True)
        self.process.start()
        child.close()
        self.info: dict[str, Any] = {}
        self.error: str | None = None
        self._events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="hostile-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                event = self._conn.recv()
            except (EOFError, OSError):
                self._events.put(("exited", None))  # reaped by the caller's thread, never here
                return
            if event[0] == "error":
                self.error = event[1]
            self._events.put(event)

    def _wait(self, kinds: tuple[str, ...], timeout: float) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"hostile process sent none of {kinds} within {timeout}s") from None
            if event[0] in kinds:
                return event
            if event[0] == "error":
                raise RuntimeError(f"hostile process failed: {event[1]}")
            if event[0] == "exited":
                self.process.join(5.0)
                raise RuntimeError(f"hostile process failed: {exit_status(self.process.exitcode)}")

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        self.info = self._wait(("ready",), timeout)[1]
        return self.info

    def _send(self, *msg: Any) -> None:
        with self._send_lock, contextlib.suppress(OSError, BrokenPipeError):
            self._conn.send(msg)

    def leak(self, d_request_id: str, p_request_id: str) -> None:
        """Tell the hostile a live request's ids (never its transfer id)."""
        self._send("leak", d_request_id, p_request_id)

    def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        """Ask it to stop (it also stops by itself at its bounds) and return its report."""
        self._send("stop")
        try:
            report: dict[str, Any] = self._wait(("report",), timeout)[1]
        finally:
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=5)
        return report

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
