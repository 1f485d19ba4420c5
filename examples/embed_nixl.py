"""The same engine calls as embed_worker.py, over real NIXL: one call builds each engine.

``open_engine(config)`` wires what a deployment needs from the ``PushConfig`` alone: NIXL
agents for its NIXL settings, the HMAC keyring (``auth_keys``) on both ends of the side
channel, the ZMQ side channel that serves the engine's handshakes, and the worker's publisher.
P and D run in this one process here (DRAM, UCX); in a deployment each is its own engine, and
the only difference is the host in ``side_channel_host`` and the KV tensors (VRAM).

    pip install 'pushactors[nixl]'    # nixl-cu12 (UCX)
    python examples/embed_nixl.py

It pushes one request, then shows an abort: D gives up on a request whose registration P
holds, and P answers it with a failure instead of writing into blocks D may reuse.
"""

from __future__ import annotations

import torch

from pushactors import PushConfig, capture_events, open_engine
from pushactors.testing import wait_until

BLOCK_SIZE, NUM_BLOCKS, LAYERS, KV_HEADS, HEAD_DIM = 16, 64, 2, 4, 16
# Both engines sign every side-channel message with this key (at least 16 bytes; rotate by
# adding the new key on every engine, then switching auth_key_id).
KEYS = {"k1": "hex:" + "5a" * 32}


def engine(name: str):
    config = PushConfig(engine_id=name, auth_keys=KEYS, auth_key_id="k1")
    built = open_engine(config)  # scheduler + side channel + one worker rank over NIXL
    kv = {
        f"model.layers.{i}.attn": torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        for i in range(LAYERS)
    }
    built.worker.register_kv_caches(kv, block_size=BLOCK_SIZE, dims="KBNHD", kv_heads=KV_HEADS)
    return built, kv


def step(built) -> set[str]:
    """One engine step: the scheduler's meta to the worker, the worker's report back."""
    built.worker.start_load_kv(built.scheduler.build_connector_meta())
    report = built.worker.get_finished()
    built.scheduler.update_connector_output(report.finished_sending, report.finished_recving, report.failed_recving)
    return set(report.finished_sending) | set(report.finished_recving) | set(report.failed_recving)


def main() -> None:
    p, p_kv = engine("prefill")
    d, d_kv = engine("decode")
    try:
        for layer in p_kv.values():
            layer[:, [3, 4, 5]] = torch.randn(2, 3, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        _, decode_params = p.scheduler.request_finished("req-1-0-1a2b3c4d", [3, 4, 5], {"do_remote_decode": True})
        d.scheduler.stage_registration("req-1-0-99887766", [10, 11, 12], decode_params)
        done: set[str] = set()
        wait_until(lambda: {"req-1-0-1a2b3c4d", "req-1-0-99887766"} <= (done.update(step(p) | step(d)) or done),
                   timeout=30, what="the push over NIXL")
        for name in p_kv:
            assert torch.equal(p_kv[name][:, [3, 4, 5]], d_kv[name][:, [10, 11, 12]])
        print("pushed 3 blocks x 2 layers over NIXL, signed side channel; every byte matches")

        # An abort. With concurrent legs D registers before P's prefill ends (the router gives
        # it P's address; decode_params is what P's request_finished would return). P holds the
        # registration; then D's client goes away. abort_recv tells P, which answers it; D may
        # reuse blocks 20, 21 only once every worker rank reported the request (here one,
        # failed), so no late WRITE can land in them.
        params = p.scheduler.decode_params("req-2-0-1a2b3c4d")
        with capture_events() as events:
            d.scheduler.stage_registration("req-2-0-99887766", [20, 21], params)
            wait_until(lambda: step(d) is not None and step(p) is not None and bool(events.named("reg.stored")),
                       timeout=30, what="P holding D's registration")
        assert d.scheduler.abort_recv("req-2-0-99887766")
        failed: dict[str, str] = {}

        def d_reports_failure() -> bool:
            step(p)
            d.worker.start_load_kv(d.scheduler.build_connector_meta())
            report = d.worker.get_finished()
            d.scheduler.update_connector_output(report.finished_sending, report.finished_recving, report.failed_recving)
            failed.update(report.failed_recving)
            return "req-2-0-99887766" in failed

        wait_until(d_reports_failure, timeout=30, what="D's report of the aborted request")
        print(f"aborted req-2 on D: reported failed ({failed['req-2-0-99887766']}); blocks 20, 21 free")
        # P's prefill of it ends later: nothing is pushed (the registration was withdrawn), and
        # its blocks are freed once the push fails or the lease ends.
        p.scheduler.request_finished("req-2-0-1a2b3c4d", [6, 7], {"do_remote_decode": True})
        sent: set[str] = set()
        wait_until(lambda: "req-2-0-1a2b3c4d" in (sent.update(step(p)) or sent), timeout=60, what="P freeing req-2")
        assert not any(torch.count_nonzero(layer[:, [20, 21]]) for layer in d_kv.values())
        print("P's late prefill of req-2 freed its blocks; D's blocks 20, 21 were never written")
    finally:
        p.close()
        d.close()


if __name__ == "__main__":
    main()
