"""Embedding pushactors in an engine: the calls an engine makes, in the order it makes them.

Runs as is: a P engine and a D engine in this process over the fake NIXL fabric; it pushes one
request and aborts another. To move real bytes, build each engine with
``pushactors.open_engine(config)`` instead (examples/embed_nixl.py): it wires NIXL agents, the
signed ZMQ side channel and the publisher from the config.

    python examples/embed_worker.py
"""

from __future__ import annotations

import torch

from pushactors import InProcessDirectory, PushConfig, PushScheduler, PushWorker, configure_logging
from pushactors.testing import FakeFabric, wait_until

BLOCK_SIZE = 16  # tokens per block
NUM_BLOCKS = 64
LAYERS = 2
KV_HEADS, HEAD_DIM = 4, 16


def make_engine(name: str, fabric: FakeFabric, directory: InProcessDirectory):
    """One engine: a scheduler (engine-core process) and one worker rank (TP=1)."""
    config = PushConfig(engine_id=name, lease_duration=30.0)
    endpoint = directory.endpoint(f"{name}-host")  # where this engine serves handshakes
    scheduler = PushScheduler(config, side_channel_host=endpoint.host, side_channel_port=endpoint.port)
    worker = PushWorker(config, agent_factory=fabric, source=directory, publisher=endpoint)
    # Once at start-up: the worker registers its KV tensors, K and V apart per layer:
    # [2, blocks, tokens, heads, dim] ("KBNHD"). Naming the dims lets pushactors cut head
    # slices correctly when P and D run different TP sizes or layouts.
    kv = {
        f"model.layers.{i}.attn": torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        for i in range(LAYERS)
    }
    worker.register_kv_caches(kv, block_size=BLOCK_SIZE, dims="KBNHD", kv_heads=KV_HEADS)
    return scheduler, worker, kv


def engine_step(scheduler: PushScheduler, worker: PushWorker):
    """What an engine does around each forward pass."""
    meta = scheduler.build_connector_meta()  # scheduler process
    worker.start_load_kv(meta)  # worker process: never blocks on an actor
    report = worker.get_finished()  # finished sending / receiving / failed receiving
    scheduler.update_connector_output(report.finished_sending, report.finished_recving, report.failed_recving)
    return report


def main() -> None:
    configure_logging(json_path="runs/example/mailbox.jsonl")  # opt in to the mailbox log
    fabric, directory = FakeFabric(), InProcessDirectory()
    p_sched, p_worker, p_kv = make_engine("prefill", fabric, directory)
    d_sched, d_worker, d_kv = make_engine("decode", fabric, directory)

    # P ran a prefill into blocks 3, 4, 5 and finished it: keep them leased for the push.
    for layer in p_kv.values():
        layer[:, [3, 4, 5]] = torch.randn(2, 3, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    delay_free, decode_params = p_sched.request_finished("req-1-0-1a2b3c4d", [3, 4, 5], {"do_remote_decode": True})
    assert delay_free

    # D allocated blocks 10, 11, 12 for the same router request and stages their registration.
    d_sched.stage_registration("req-1-0-99887766", [10, 11, 12], decode_params)

    received: set[str] = set()
    sent: set[str] = set()

    def both_engines_step() -> bool:
        sent.update(engine_step(p_sched, p_worker).finished_sending)
        received.update(engine_step(d_sched, d_worker).finished_recving)
        return "req-1-0-99887766" in received and "req-1-0-1a2b3c4d" in sent

    wait_until(both_engines_step, timeout=10, what="the push")
    for name in p_kv:
        assert torch.equal(p_kv[name][:, [3, 4, 5]], d_kv[name][:, [10, 11, 12]])
    print("pushed 3 blocks × 2 layers from P to D; every byte matches")
    # An abort. With concurrent legs D registers before P's prefill ends; then its client goes
    # away. abort_recv tells P to stand down; D may reuse blocks 20, 21 only once every worker
    # rank reported the request (failed), so no late WRITE can land in them.
    d_sched.stage_registration("req-2-0-99887766", [20, 21], p_sched.decode_params("req-2-0-1a2b3c4d"))
    engine_step(d_sched, d_worker)  # the registration leaves for P
    assert d_sched.abort_recv("req-2-0-99887766")
    failed: dict[str, str] = {}

    def aborted_reported() -> bool:
        engine_step(p_sched, p_worker)
        failed.update(engine_step(d_sched, d_worker).failed_recving)
        return "req-2-0-99887766" in failed

    wait_until(aborted_reported, timeout=10, what="D's report of the aborted request")
    # P's prefill of it ends later: its push fails (D withdrew), P frees its blocks.
    p_sched.request_finished("req-2-0-1a2b3c4d", [6, 7], {"do_remote_decode": True})
    wait_until(lambda: "req-2-0-1a2b3c4d" in engine_step(p_sched, p_worker).finished_sending, timeout=10, what="P")
    assert not any(torch.count_nonzero(t[:, [20, 21]]) for t in d_kv.values())
    print(f"aborted req-2 on D ({failed['req-2-0-99887766']}); P freed its blocks; D's blocks were never written")
    print("P stats:", {k: v for k, v in p_worker.stats().items() if k.startswith(("write", "push", "bytes"))})
    p_worker.shutdown()
    d_worker.shutdown()


if __name__ == "__main__":
    main()
