"""Coverage-guided fuzzing of the wire decoders with atheris (not part of CI).

Targets, picked by the first input byte: ``decode_notification``, ``decode_handshake`` (with the
right and a wrong expected hash) and ``decode_handshake_request``. A decoder must return a valid
message or raise its own error (:class:`MalformedMessage` / :class:`HandshakeError`); anything
else is a crash. A decoded message must also re-encode to itself.

    .venv/bin/pip install atheris
    .venv/bin/python bench/fuzz_atheris.py --runs 200000          # fixed number of runs
    .venv/bin/python bench/fuzz_atheris.py --runs 200000 --strict # + ids echoed in completions

``--strict`` also checks that every request id a registration accepts comes back intact through
the completion P echoes (a stricter cross-format property). The run count, executions per second
and whether anything crashed are printed at the end (libFuzzer's own lines go to stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import atheris

with atheris.instrument_imports(enable_loader_override=False):
    import msgspec

    from pushactors import protocol as p

COMPAT = p.CompatSpec(model="sim", dtype="uint8", kv_shape=(512,))
HASH = p.compatibility_hash(COMPAT)
STRICT = False
COUNTS = {"runs": 0, "valid": 0, "refused": 0}
TARGET = [0]
STARTED = [0.0]


def _seeds() -> list[bytes]:
    reg = p.Registration(
        request_id="cmpl-1-0-1a2b3c4d",
        decode_engine_id="decode",
        decode_host="127.0.0.1",
        decode_port=5600,
        decode_tp_size=2,
        decode_tp_rank=1,
        local_block_ids=((1, 2, 3), (7,)),
        remote_engine_id="prefill",
        remote_host="127.0.0.1",
        remote_port=5500,
        remote_tp_size=2,
        transfer_id="tx-1",
        remote_request_id="cmpl-1-0",
    )
    info = p.AgentInfo(
        engine_id="prefill",
        agent_name="prefill-pp0-tp0",
        agent_metadata=b"\x00meta",
        mem_type="DRAM",
        tp_size=1,
        tp_rank=0,
        block_size=16,
        regions=(p.RegionInfo(base_addr=4096, block_len=512, stride=512, num_blocks=64, members=("l0",)),),
        clock=p.ClockSample(monotonic=1.0, wall=2.0),
    )
    notifs = [
        p.encode_registration(reg),
        p.encode_completion("cmpl-1-0-1a2b3c4d", 2),
        p.encode_heartbeat(["tx-1", "cmpl-2-0"]),
        p.encode_push_failure(p.PushFailure(request_id="cmpl-1-0-1a2b3c4d", reason="lease expired")),
        p.encode_abort(p.Abort(request_id="cmpl-1-0-1a2b3c4d", transfer_id="tx-1")),
    ]
    request = p.encode_handshake_request(p.HandshakeRequest(pp_rank=0, tp_rank=1, requester_engine_id="decode"))
    return (
        [b"\x00" + n for n in notifs]
        + [b"\x01" + p.encode_handshake(info, HASH), b"\x02" + p.encode_handshake(info, HASH)]
        + [b"\x03" + request]
    )


def _check_notification(raw: bytes) -> None:
    try:
        msg = p.decode_notification(raw)
    except p.MalformedMessage:
        COUNTS["refused"] += 1
        return
    COUNTS["valid"] += 1
    if isinstance(msg, p.Registration):
        assert p.decode_notification(p.encode_registration(msg)) == msg
        for group in msg.block_groups:
            assert all(0 <= b < 2**31 for b in group)
        if STRICT:
            echoed = p.decode_notification(p.encode_completion(msg.request_id, msg.remote_tp_size))
            assert isinstance(echoed, p.Completion) and echoed.request_id == msg.request_id, repr(msg.request_id)
    elif isinstance(msg, p.Completion):
        assert p.decode_notification(p.encode_completion(msg.request_id, msg.tp_size)) == msg
    elif isinstance(msg, p.Heartbeat):
        assert p.decode_notification(p.encode_heartbeat(msg.ids)) == msg
    elif isinstance(msg, p.PushFailure):
        assert p.decode_notification(p.encode_push_failure(msg)) == msg
    else:
        assert isinstance(msg, p.Abort)
        assert p.decode_notification(p.encode_abort(msg)) == msg


def _check_handshake(raw: bytes, expected_hash: str) -> None:
    try:
        info = p.decode_handshake(raw, expected_hash=expected_hash, expected_engine="prefill")
    except p.HandshakeError:
        COUNTS["refused"] += 1
        return
    COUNTS["valid"] += 1
    # Accepted only when the payload carries exactly the hash asked for (the fuzzer may well
    # write the "wrong" hash of target 2 itself: it is a plain string).
    assert msgspec.msgpack.decode(raw)[1] == expected_hash, "accepted a payload under another hash"
    assert info.engine_id == "prefill" and 0 <= info.tp_rank < info.tp_size
    assert all(r.stride >= r.block_len for r in info.regions)


def _check_request(raw: bytes) -> None:
    try:
        req = p.decode_handshake_request(raw)
    except p.MalformedMessage:
        COUNTS["refused"] += 1
        return
    COUNTS["valid"] += 1
    assert req.pp_rank >= 0 and req.tp_rank >= 0


def _report() -> None:
    wall = time.monotonic() - STARTED[0]
    print(
        f"atheris summary: executed={COUNTS['runs']} valid={COUNTS['valid']} refused={COUNTS['refused']} "
        f"crashes=0 wall={wall:.1f}s ({COUNTS['runs'] / max(wall, 1e-9):.0f}/s)",
        flush=True,
    )


def test_one_input(data: bytes) -> None:
    COUNTS["runs"] += 1
    # libFuzzer exits from C when the run count is reached: report on the way there.
    if COUNTS["runs"] % 50_000 == 0 or COUNTS["runs"] == TARGET[0]:
        _report()
    if not data:
        return
    target, raw = data[0] % 4, data[1:]
    if target == 0:
        _check_notification(raw)
    elif target == 1:
        _check_handshake(raw, HASH)
    elif target == 2:
        _check_handshake(raw, "0" * 32)
    else:
        _check_request(raw)


def main() -> None:
    global STRICT
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--strict", action="store_true")
    args, rest = parser.parse_known_args()
    STRICT = args.strict
    corpus = tempfile.mkdtemp(prefix="pushactors-atheris-")
    for i, seed in enumerate(_seeds()):
        with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
            f.write(seed)
    TARGET[0] = args.runs
    STARTED[0] = time.monotonic()
    print(f"atheris: runs={args.runs} seed={args.seed} strict={STRICT} corpus={corpus}", flush=True)
    argv = [sys.argv[0], *rest, f"-runs={args.runs}", f"-seed={args.seed}", f"-max_len={args.max_len}", corpus]
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()  # never returns: libFuzzer exits (non-zero with a crash report on a failure)


if __name__ == "__main__":
    main()
