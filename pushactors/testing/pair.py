"""A prefill engine and a decode engine in one process, over one fake fabric."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..core.config import PushConfig
from ..transport.agent import AgentFactory
from ..transport.directory import InProcessDirectory
from .engine import SimEngine, SimSpec, StepReport
from .fabric import FakeFabric


def wait_until(
    predicate: Callable[[], bool], *, timeout: float = 10.0, interval: float = 0.002, what: str = "condition"
) -> None:
    """Poll ``predicate`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        pause.wait(interval)


class PushPair:
    """P (``prefill``) and D (``decode``) :class:`SimEngine` s wired through a :class:`FakeFabric`."""

    def __init__(
        self,
        *,
        fabric: FakeFabric | None = None,
        agent_factory: AgentFactory | None = None,
        directory: InProcessDirectory | None = None,
        p_tp: int = 1,
        d_tp: int = 1,
        p_pp: int = 1,
        p_spec: SimSpec | None = None,
        d_spec: SimSpec | None = None,
        seed: int = 0,
        p_config: dict[str, Any] | None = None,
        d_config: dict[str, Any] | None = None,
        **config: Any,
    ) -> None:
        """``config``: settings of both engines; ``p_config`` / ``d_config``: one side's, over them."""
        self.fabric = fabric or FakeFabric()
        factory: AgentFactory = agent_factory or self.fabric
        self.directory = directory or InProcessDirectory()
        p_spec = p_spec or SimSpec()
        d_spec = d_spec or p_spec
        p_end = self.directory.endpoint("prefill-host")
        d_end = self.directory.endpoint("decode-host")
        self.p_endpoint, self.d_endpoint = p_end, d_end
        self.prefill = SimEngine(
            PushConfig(engine_id="prefill", role="producer", **{**config, **(p_config or {})}),
            agent_factory=factory,
            source=self.directory,
            publisher_for_rank=lambda _r: p_end,
            tp_size=p_tp,
            pp_size=p_pp,
            spec=p_spec,
            seed=seed,
        )
        try:
            self.decode = SimEngine(
                PushConfig(engine_id="decode", role="consumer", **{**config, **(d_config or {})}),
                agent_factory=factory,
                source=self.directory,
                publisher_for_rank=lambda _r: d_end,
                tp_size=d_tp,
                spec=d_spec,
                seed=seed + 1,
            )
        except BaseException:
            self.prefill.shutdown(10.0)  # its actor threads would keep the process alive
            raise

    @property
    def sent(self) -> dict[str, str | None]:
        """P ids reported finished sending, with a failure reason or None when pushed."""
        return self.prefill.sent

    @property
    def received(self) -> dict[str, str | None]:
        """D ids reported, with a failure reason or None when the KV landed."""
        return self.decode.received

    def step(self) -> tuple[StepReport, StepReport]:
        return self.prefill.step(), self.decode.step()

    def pump(self, until: Callable[[], bool], *, timeout: float = 30.0, what: str = "the pair to settle") -> None:
        """Step both engines until ``until()`` holds."""

        def stepped() -> bool:
            self.step()
            return until()

        wait_until(stepped, timeout=timeout, interval=0.001, what=what)

    def settled(self) -> bool:
        return not (self.prefill.has_pending_push_work() or self.decode.has_pending_push_work())

    def close(self, timeout: float = 10.0) -> None:
        self.prefill.shutdown(timeout)
        self.decode.shutdown(timeout)

    def __enter__(self) -> PushPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
