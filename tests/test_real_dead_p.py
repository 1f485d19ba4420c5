"""REAL: D aborted, and P died before answering (two OS processes, real NIXL over UCX on DRAM,
the real ZMQ side channel).

D's abort reaches a P that is frozen (SIGSTOP: it cannot answer), then P is SIGKILLed. Nothing
else goes between D and that P, so NIXL never reports it gone; D must still free the request's
blocks within 5 s of P's death, with ``abort_quarantine`` at its default 45 s: D's probe of P's
side channel finds it refusing. Run with ``-s`` to see the measured time (``REAL-DEAD-P``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from nodes_kit import SMALL, Cluster, Recorder, freeze, ids, metric, ready, registered_on_p, serve, settled_blocks

from pushactors.core.config import PushConfig

pytestmark = pytest.mark.real_nixl

BOUND = 5.0
# Short leases and handshakes keep the run quick; the quarantine is the library's default.
TIMING: dict[str, Any] = {
    "lease_duration": 2.0,
    "write_timeout": 3.0,
    "registration_timeout": 30.0,  # the watchdog cannot be what frees it
    "handshake_timeout": 1.0,
    "reaper_tick": 0.02,
}
assert PushConfig(engine_id="x").abort_quarantine == 45.0


def test_real_d_frees_an_aborted_request_within_5s_of_its_p_dying_before_answering(
    rec: Recorder, cluster: Cluster
) -> None:
    spec = SMALL
    p = cluster.start("prefill", "prefill-0", spec, TIMING)
    d = cluster.start("decode", "decode-0", spec, TIMING)
    ready(p, d)
    serve(rec, p, d, 0, 4, spec)  # D knows P: its agent is loaded, its incarnation verified

    base, _, d_id = ids("dead-p", 1)
    before = metric(p.stats(), "notif.received")
    d.expect(d_id, 8 * spec.block_size, p.decode_params(base), key=base, wait=True)
    registered_on_p(p, before, 1)  # P holds the registration; its prefill never comes

    freeze(p)  # P can no longer answer anything
    assert d.abort(d_id)
    # A deadline, not a bare sleep: any report in this time is a release under a live P.
    assert not rec.wait(lambda: d_id in rec.received, 1.5), f"released while P lived: {rec.received[d_id].why}"
    t_kill = time.monotonic()
    p.kill()

    assert rec.wait_received([d_id], BOUND + 10), "D never reported the aborted request"
    took = rec.received[d_id].at - t_kill
    print(f"REAL-DEAD-P D reported {d_id} {took:.3f}s after P died: {rec.received[d_id].why}", flush=True)
    assert rec.received[d_id].why is not None
    assert took <= BOUND, f"D held the blocks {took:.2f}s after P died (abort_quarantine 45 s)"

    final = settled_blocks(d, BOUND)
    print(f"REAL-DEAD-P D after: free_blocks={final['free_blocks']}/{spec.num_blocks}", flush=True)
    assert final["free_blocks"] == spec.num_blocks, "D kept blocks of a request whose P is dead"
    assert final["healthy"]
    assert metric(final, "peer.probe_dead") >= 1
    assert metric(final, "recv.peer_dead_released") == 1
