"""The shared rig of the pair-level fault scenarios (``tests/test_faults_*.py``,
``tests/test_integrity.py``): short timings, both legs of a request at once, and the checks every
scenario ends with (bytes landed, nothing hangs, every table empty, pools full)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import torch

from pushactors.core.config import PushConfig
from pushactors.protocol import (
    AgentInfo,
    ClockSample,
    HandshakeEnvelope,
)
from pushactors.testing import FaultContext, PushPair, SimEngine, SimSpec, pattern_row, wait_until
from pushactors.transport.directory import DirectoryEndpoint

# Short durations: every scenario runs in well under a few seconds.
FAST: dict[str, Any] = {
    "reaper_tick": 0.01,
    "lease_duration": 1.0,
    "registration_timeout": 2.0,
    "abort_quarantine": 0.4,
    "handshake_timeout": 2.0,
    # Scenarios time the quarantine itself; the soak runs with the enforced safe timing.
    "allow_unsafe_quarantine": True,
}
TOKENS = 40  # 3 blocks of 16 tokens


def make_pair(**overrides: Any) -> PushPair:
    return PushPair(**{**FAST, **overrides})


def agent(engine: str, tp: int = 0) -> str:
    return f"{engine}-pp0-tp{tp}"


P_AGENT = agent("prefill")
D_AGENT = agent("decode")


def addr(endpoint: DirectoryEndpoint) -> tuple[str, int]:
    return (endpoint.host, endpoint.port)


def stat(engine: SimEngine, name: str, rank: int | None = None) -> int:
    workers = engine.workers if rank is None else [engine.workers[rank]]
    return sum(w.stats().get(name, 0) for w in workers)


def posted(pair: PushPair) -> int:
    return pair.fabric.stats.transfers_posted


def actor(engine: SimEngine, name: str, rank: int = 0) -> Any:
    return engine.workers[rank].runtime.view(name)  # reads its tables through its mailbox


def pump_all(
    engines: Iterable[SimEngine], until: Callable[[], bool], *, timeout: float = 10.0, what: str = "condition"
) -> None:
    """Step every engine until ``until()`` holds (PushPair.pump for more than two engines)."""
    engines = list(engines)

    def stepped() -> bool:
        for e in engines:
            e.step()
        return until()

    wait_until(stepped, timeout=timeout, interval=0.001, what=what)


def timed_pump(pair: PushPair, until: Callable[[], bool], *, timeout: float = 10.0, what: str = "condition") -> float:
    start = time.monotonic()
    pair.pump(until, timeout=timeout, what=what)
    return time.monotonic() - start


def legs(pair: PushPair, n: str, *, tokens: int = TOKENS, transfer_id: str | None = None) -> tuple[str, str]:
    """Both legs of request ``n`` at once (as a push router sends them): (P id, D id)."""
    p_id, d_id = f"{n}-aaaaaaaa", f"{n}-bbbbbbbb"
    params = pair.prefill.prefill(p_id, tokens, key=n, transfer_id=transfer_id)
    pair.decode.expect(d_id, tokens, params, key=n)
    return p_id, d_id


def rank_bytes(engine: SimEngine, d_id: str, rank: int, lo: int = 0, hi: int | None = None) -> tuple[int, int, int]:
    """(checked, wrong, non-zero) bytes in [lo, hi) of every block row of ``d_id`` on D rank ``rank``."""
    rec = engine.recvs[d_id]
    per_rank = engine.spec.block_bytes // engine.tp_size
    hi = per_rank if hi is None else hi
    checked = wrong = nonzero = 0
    for layer, t in enumerate(engine.kv[rank].values()):
        for half in range(2):
            view = t[half] if engine.spec.layout == "split" else t[:, half]
            for i, block in enumerate(rec.blocks):
                want = pattern_row(rec.key, layer, half, rec.first_position + i, per_rank, rank * per_rank)[lo:hi]
                got = view[block][lo:hi]
                checked += hi - lo
                wrong += int((got != want).sum())
                nonzero += int(torch.count_nonzero(got))
    return checked, wrong, nonzero


def untouched(engine: SimEngine, d_id: str) -> bool:
    """No byte of ``d_id``'s blocks was written on any D rank (pools start zeroed)."""
    return all(rank_bytes(engine, d_id, r)[2] == 0 for r in range(engine.tp_size))


def assert_landed(engine: SimEngine, d_id: str) -> None:
    checked, wrong = engine.verify(d_id)
    assert checked == len(engine.recvs[d_id].blocks) * engine.spec.block_bytes * 2 * engine.spec.num_layers
    assert wrong == 0, f"{d_id}: {wrong} wrong bytes"


def assert_clean(pair: PushPair, *more: SimEngine, timeout: float = 10.0) -> None:
    """Nothing hangs: every lease and watchdog cleared, P's blocks back, D's requests reported."""
    engines = [pair.prefill, pair.decode, *more]
    pump_all(
        engines,
        lambda: not any(e.has_pending_push_work() for e in engines),
        timeout=timeout,
        what="every lease and watchdog to clear",
    )
    assert not pair.prefill.held, f"P still holds {sorted(pair.prefill.held)}"
    assert pair.prefill.free_blocks == pair.prefill.spec.num_blocks
    for e in engines:
        for w in e.workers:
            assert w.pending() == (0, 0), f"{e.config.engine_id} rank {w.ctx.tp_rank} holds {w.pending()}"
    for d in (pair.decode, *more):
        for rid, rec in list(d.recvs.items()):
            assert rec.done or rec.failed is not None, f"{rid} was never reported"
            d.finish_recv(rid)
        assert d.free_blocks == d.spec.num_blocks


def extra_decode(pair: PushPair, engine_id: str = "decode2", **overrides: Any) -> SimEngine:
    """A second decode engine on the pair's fabric and directory."""
    endpoint = pair.directory.endpoint(f"{engine_id}-host")
    return SimEngine(
        PushConfig(engine_id=engine_id, role="consumer", **{**FAST, **overrides}),
        agent_factory=pair.fabric,
        source=pair.directory,
        publisher_for_rank=lambda _r: endpoint,
        spec=SimSpec(),
        seed=11,
    )


def with_hash(compat_hash: str) -> Callable[[bytes], bytes]:
    """A directory tamper that re-signs a handshake payload with another compatibility hash."""

    def tamper(raw: bytes) -> bytes:
        env = msgspec.msgpack.decode(raw, type=HandshakeEnvelope)
        return msgspec.msgpack.encode(HandshakeEnvelope(env.version, compat_hash, env.body))

    return tamper


def shifted_clock(seconds: float) -> Callable[[bytes], bytes]:
    """A directory tamper that serves the peer's clock sample shifted by ``seconds``."""

    def tamper(raw: bytes) -> bytes:
        env = msgspec.msgpack.decode(raw, type=HandshakeEnvelope)
        info = msgspec.msgpack.decode(env.body, type=AgentInfo)
        clock = ClockSample(monotonic=info.clock.monotonic + seconds, wall=info.clock.wall + seconds)
        body = msgspec.msgpack.encode(msgspec.structs.replace(info, clock=clock))
        return msgspec.msgpack.encode(HandshakeEnvelope(env.version, env.compat_hash, body))

    return tamper


def is_write_to(dst: str) -> Callable[[FaultContext], bool]:
    return lambda c: c.op == "WRITE" and c.dst == dst


def is_write_from(src: str) -> Callable[[FaultContext], bool]:
    return lambda c: c.op == "WRITE" and c.src == src


def evict_d_from_p(pair: PushPair, *engines: SimEngine) -> None:
    """Wait until P's writer forgot D's agent (idle past a tiny engine_ttl)."""
    p_agent = pair.fabric.get(P_AGENT)
    pump_all(
        [pair.prefill, pair.decode, *engines],
        lambda: D_AGENT not in p_agent.remote_agents,
        what="P to evict idle D",
    )
