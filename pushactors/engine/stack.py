"""An engine's push transport over real NIXL, built from its :class:`PushConfig` in one call.

:func:`open_engine` wires what a real deployment needs and the fake-fabric examples leave out:
the NIXL agent factory for the config's NIXL settings, the HMAC keyring (``auth_keys``) on
both ends of the side channel, the ZMQ side channel that serves this engine's handshakes, and
each worker rank's publisher. Ranks in other processes than the scheduler (as in vLLM) use
:func:`open_worker` with a :class:`~pushactors.transport.directory.HeldMetadata` publisher and
hand its payload to the scheduler process, which serves it with
:meth:`PushEngine.publish_held`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.config import PushConfig
from ..protocol import CompatSpec
from ..transport.agent import AgentFactory
from ..transport.auth import Keyring
from ..transport.directory import MetadataPublisher, decode_held
from ..transport.sidechannel import SideChannelClient, SideChannelServer
from .scheduler import PushScheduler
from .worker import PushWorker


@dataclass
class PushEngine:
    """One engine's push transport: its scheduler side, the side channel that serves its
    handshakes, and the worker ranks built in this process (``workers[r]`` is TP rank ``r``
    of PP stage 0 unless ``ranks`` said otherwise)."""

    config: PushConfig
    scheduler: PushScheduler
    side_channel: SideChannelServer
    workers: list[PushWorker] = field(default_factory=list)

    @property
    def worker(self) -> PushWorker:
        """The first (for TP=1, the only) worker rank built in this process."""
        if not self.workers:
            raise LookupError("this engine's worker ranks run in other processes (open_engine(ranks=()))")
        return self.workers[0]

    def publish_held(self, payload: bytes) -> None:
        """Serve the handshake payload a rank in another process published into a
        :class:`~pushactors.transport.directory.HeldMetadata` (its ``payload()``)."""
        info, compat_hash = decode_held(payload)
        self.side_channel.publish(info, compat_hash)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the ranks built here (in-flight WRITEs settle or are cancelled within
        ``timeout``), then the side channel."""
        try:
            for worker in self.workers:
                worker.shutdown(timeout=timeout)
        finally:
            self.side_channel.close()


def open_worker(
    config: PushConfig,
    *,
    publisher: MetadataPublisher,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    compat: CompatSpec | None = None,
    agent_factory: AgentFactory | None = None,
) -> PushWorker:
    """One worker rank over real NIXL: an agent built for ``config``'s NIXL settings and a
    side-channel client that signs and checks with ``config``'s keys. ``agent_factory``
    replaces NIXL (the fake fabric in tests)."""
    if agent_factory is None:
        from ..transport.nixl import agent_factory_from_config  # NIXL is imported only when used

        agent_factory = agent_factory_from_config(config)
    return PushWorker(
        config,
        agent_factory=agent_factory,
        source=SideChannelClient(keyring=Keyring.from_config(config)),
        publisher=publisher,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        compat=compat,
    )


def open_engine(
    config: PushConfig,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    ranks: tuple[tuple[int, int], ...] | None = None,
    compat: CompatSpec | None = None,
    agent_factory: AgentFactory | None = None,
) -> PushEngine:
    """The push transport of one engine over real NIXL and the ZMQ side channel, from
    ``config`` alone: the side channel listens on ``side_channel_host:side_channel_port`` (0:
    any free port) with ``config``'s keyring, the scheduler advertises it, and each (pp_rank,
    tp_rank) in ``ranks`` (default: every TP rank of stage 0 when ``pp_size`` is 1, else
    none) gets a worker that publishes to it. Call :meth:`PushEngine.close` when done."""
    keyring = Keyring.from_config(config)
    server = SideChannelServer(
        config.side_channel_host, config.side_channel_port, engine_id=config.engine_id, keyring=keyring
    )
    workers: list[PushWorker] = []
    try:
        scheduler = PushScheduler(
            config,
            side_channel_host=config.side_channel_host,
            side_channel_port=server.port,
            tp_size=tp_size,
            pp_size=pp_size,
        )
        if ranks is None:
            ranks = tuple((0, r) for r in range(tp_size)) if pp_size == 1 else ()
        for pp_rank, tp_rank in ranks:
            workers.append(
                open_worker(
                    config,
                    publisher=server,
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    pp_rank=pp_rank,
                    pp_size=pp_size,
                    compat=compat,
                    agent_factory=agent_factory,
                )
            )
    except BaseException:
        for worker in workers:
            worker.shutdown(timeout=1.0)
        server.close()
        raise
    return PushEngine(config=config, scheduler=scheduler, side_channel=server, workers=workers)
