"""open_engine: one call wires an engine's push transport from its PushConfig (the fake fabric
stands in for NIXL here; tests/test_examples.py runs it over real NIXL)."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import torch

from pushactors import HeldMetadata, PushConfig, PushEngine, open_engine, open_worker
from pushactors.core.blocks import LayoutError
from pushactors.testing import FakeFabric, wait_until
from pushactors.transport.directory import decode_held

KEYS = {"k1": "hex:" + "11" * 32}
OTHER_KEYS = {"k1": "hex:" + "22" * 32}
BLOCK, BLOCKS, HEADS, DIM = 4, 16, 2, 8


def _kv() -> dict[str, torch.Tensor]:
    return {f"layers.{i}": torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM) for i in range(2)}


def _step(engine: PushEngine, seen: dict[str, object]) -> None:
    engine.worker.start_load_kv(engine.scheduler.build_connector_meta())
    report = engine.worker.get_finished()
    engine.scheduler.update_connector_output(report.finished_sending, report.finished_recving, report.failed_recving)
    for rid in report.finished_sending | report.finished_recving:
        seen[rid] = "ok"
    seen.update(report.failed_recving)


@pytest.fixture
def fabric() -> Iterator[FakeFabric]:
    yield FakeFabric()


def _pair(fabric: FakeFabric, p_keys: dict[str, str], d_keys: dict[str, str]) -> tuple[PushEngine, PushEngine]:
    p = open_engine(PushConfig(engine_id="p", auth_keys=p_keys, auth_key_id="k1"), agent_factory=fabric)
    d = open_engine(
        PushConfig(engine_id="d", auth_keys=d_keys, auth_key_id="k1", handshake_timeout=2.0), agent_factory=fabric
    )
    return p, d


def _push(p: PushEngine, d: PushEngine) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, object]]:
    p_kv, d_kv = _kv(), _kv()
    for engine, kv in ((p, p_kv), (d, d_kv)):
        engine.worker.register_kv_caches(kv, block_size=BLOCK, dims="KBNHD", kv_heads=HEADS)
    for t in p_kv.values():
        t[:, [1, 2]] = torch.randn(2, 2, BLOCK, HEADS, DIM)
    _, params = p.scheduler.request_finished("req-a-0-00000001", [1, 2], {"do_remote_decode": True})
    assert params is not None
    d.scheduler.stage_registration("req-a-0-00000002", [5, 6], params)
    seen: dict[str, object] = {}

    def both() -> bool:
        _step(p, seen)
        _step(d, seen)
        return "req-a-0-00000002" in seen

    wait_until(both, timeout=30, what="D's outcome")
    return p_kv, d_kv, seen


def test_signed_engines_push_through_their_own_side_channels(fabric: FakeFabric) -> None:
    p, d = _pair(fabric, KEYS, KEYS)
    try:
        assert p.scheduler.port == p.side_channel.port != 0  # the scheduler advertises the real port
        p_kv, d_kv, seen = _push(p, d)
        assert seen["req-a-0-00000002"] == "ok"
        for name in p_kv:
            assert torch.equal(p_kv[name][:, [1, 2]], d_kv[name][:, [5, 6]])
    finally:
        p.close()
        d.close()


def test_engines_with_different_keys_fail_the_request_and_write_nothing(fabric: FakeFabric) -> None:
    p, d = _pair(fabric, KEYS, OTHER_KEYS)
    try:
        _, d_kv, seen = _push(p, d)
        assert seen["req-a-0-00000002"] != "ok"  # a visible failure, not a hang
        assert all(torch.count_nonzero(t) == 0 for t in d_kv.values())
        assert p.side_channel.unauthorized > 0  # D's unsigned-for-P request was refused by P
    finally:
        p.close()
        d.close()


def test_a_rank_in_another_process_publishes_through_held_metadata(fabric: FakeFabric) -> None:
    config = PushConfig(engine_id="p")
    engine = open_engine(config, ranks=(), agent_factory=fabric)
    try:
        with pytest.raises(LookupError):
            engine.worker  # noqa: B018 (no rank was built here)
        held = HeldMetadata(engine.side_channel.host, engine.side_channel.port)
        with pytest.raises(LookupError):
            held.payload()
        worker = open_worker(config, publisher=held, agent_factory=fabric)
        try:
            worker.register_kv_caches(_kv(), block_size=BLOCK, dims="KBNHD", kv_heads=HEADS)
            info, compat = decode_held(held.payload())
            assert (info.tp_rank, info.pp_rank, compat) == (0, 0, worker.compat_hash)
            engine.publish_held(held.payload())
            with pytest.raises(msgspec.DecodeError):
                engine.publish_held(b"not a payload")
        finally:
            worker.shutdown()
    finally:
        engine.close()


def test_a_rank_whose_nixl_fails_says_so_at_start_up_and_close_stops_every_rank(fabric: FakeFabric) -> None:
    calls = []

    def factory(name: str):  # type: ignore[no-untyped-def]
        calls.append(name)
        if "tp1" in name:
            raise RuntimeError("no NIXL for the second rank")
        return fabric(name)

    engine = open_engine(PushConfig(engine_id="p"), tp_size=2, agent_factory=factory)
    try:
        assert [w.ctx.tp_rank for w in engine.workers] == [0, 1]
        # The rank says why when the engine registers its KV caches (start-up), not later.
        with pytest.raises(LayoutError, match="no NIXL for the second rank"):
            engine.workers[1].register_kv_caches(_kv(), block_size=BLOCK, dims="KBNHD", kv_heads=2 * HEADS)
        engine.workers[0].register_kv_caches(_kv(), block_size=BLOCK, dims="KBNHD", kv_heads=2 * HEADS)
    finally:
        engine.close(timeout=5)
    assert not any(w.runtime.healthy for w in engine.workers)  # every rank stopped
