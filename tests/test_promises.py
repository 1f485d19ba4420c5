"""D's promises on P (core/promises.py): the matcher renews and forgets, the writer reads, and a
reader on another thread never sees a promise taken back by a renewal."""

from __future__ import annotations

import threading

from pushactors.core.promises import Promises


def test_a_renewal_keeps_the_latest_deadline_and_a_read_sees_it() -> None:
    promises = Promises()
    key = ("p-1", 0, 7)
    assert promises.deadline(key) == 0.0  # nothing heard
    promises.renew(key, 10.0)
    promises.renew(key, 5.0)  # an older heartbeat resolved late: no step back
    assert promises.deadline(key) == 10.0
    promises.renew(key, 12.5)
    assert promises.deadline(key) == 12.5
    assert promises.deadline(("p-1", 1, 7)) == 0.0  # another D rank's registration: its own
    assert promises.deadline(("p-1", 0, 8)) == 0.0  # another generation: its own
    assert len(promises) == 1


def test_forgetting_a_request_drops_only_its_registrations() -> None:
    promises = Promises()
    promises.renew(("p-1", 0, 1), 10.0)
    promises.renew(("p-1", 1, 1), 11.0)
    promises.renew(("p-2", 0, 1), 12.0)
    promises.forget([("p-1", 0, 1), ("p-1", 1, 1), ("p-1", 2, 1)])  # one never renewed: harmless
    assert promises.deadline(("p-1", 0, 1)) == 0.0 and promises.deadline(("p-1", 1, 1)) == 0.0
    assert promises.deadline(("p-2", 0, 1)) == 12.0
    assert len(promises) == 1


def test_a_reader_on_another_thread_sees_deadlines_only_grow() -> None:
    """The writer reads while the matcher renews: every read is a deadline some renewal set,
    never smaller than one read before."""
    promises = Promises()
    key = ("p-1", 0, 1)
    renewals = 20_000
    done = threading.Event()
    seen: list[float] = []
    errors: list[str] = []

    def read() -> None:
        last = 0.0
        while not done.is_set():
            now = promises.deadline(key)
            if now < last:
                errors.append(f"{now} after {last}")
            last = now
            seen.append(now)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(1, renewals + 1):
            promises.renew(key, float(i))
            promises.renew(key, float(i) - 0.5)  # a late, older one in between
    finally:
        done.set()
        reader.join(timeout=10)
    assert not reader.is_alive()
    assert errors == []
    assert all(v == int(v) for v in seen)  # never a value no renewal kept
    assert promises.deadline(key) == float(renewals)
