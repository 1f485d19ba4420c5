"""Ports for test servers in other processes: outside the ephemeral range, never twice."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

from pushactors.testing import ports


def test_ports_lie_outside_the_ephemeral_range_and_are_never_given_twice() -> None:
    low, high = ports.ephemeral_range()
    given = [ports.free_port() for _ in range(200)]
    assert len(set(given)) == len(given)
    assert all(not (low <= p <= high) for p in given)
    for p in given[:20]:  # free when handed out: a listener can take it
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
            s.listen()


def test_a_port_in_use_is_passed_over() -> None:
    with socket.socket() as busy, socket.socket() as probe:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        probe.bind(("127.0.0.1", 0))
        other = probe.getsockname()[1]
        probe.close()  # free again
        script = [taken, other]

        class Scripted:
            def choice(self, seq: Sequence[int], /) -> int:
                return script.pop(0)

        picker = ports.PortPicker(rng=Scripted())
        assert picker.free_port() == other
        assert script == []  # the busy port was tried first, and refused
        assert picker.given == {other}


def test_a_port_is_never_given_twice_even_when_chosen_again() -> None:
    script = [30001, 30001, 30002]

    class Scripted:
        def choice(self, seq: Sequence[int], /) -> int:
            return script.pop(0)

    picker = ports.PortPicker(rng=Scripted(), bindable=lambda p: True)
    assert [picker.free_port(), picker.free_port()] == [30001, 30002]
    assert script == []


def test_no_port_found_is_a_clear_error() -> None:
    picker = ports.PortPicker(bindable=lambda p: False)
    with pytest.raises(RuntimeError, match="no free TCP port"):
        picker.free_port(attempts=5)


def test_an_unreadable_range_file_falls_back_to_linux_defaults(tmp_path: Path) -> None:
    bad = tmp_path / "range"
    bad.write_text("not numbers\n")
    picker = ports.PortPicker(range_file=bad)
    assert picker.ephemeral_range() == (32768, 60999)
    bad.write_text("40000\t50000\n")
    assert picker.ephemeral_range() == (40000, 50000)
    assert picker.pool() == range(20000, 40000)
    assert 20000 <= picker.free_port() < 40000
