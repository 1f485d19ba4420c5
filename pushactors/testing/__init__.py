"""Test support that ships with pushactors, for its own tests and for users' integrations.

What an integration's tests import comes from here (docs/testing.md, "The kit"):

* :class:`FakeFabric` / :class:`FakeNixlAgent`: a working NIXL stand-in that moves real bytes
  between registered CPU tensors.
* :class:`FaultPlan` and its rules: read only by :class:`FaultyAgent`, which the fake fabric
  gives each agent and which wraps a real NIXL agent the same way (:func:`faulty_factory`).
* :class:`SimEngine`: a stand-in engine that drives schedulers and workers end to end.
* :mod:`pushactors.testing.fixtures`: pytest fixtures (``pytest_plugins = ["pushactors.testing.fixtures"]``).
"""

from .builders import agent_info, raw_registration, registration
from .engine import LayeredPrefill, RecvRecord, SimEngine, SimSpec, StepReport, pattern, pattern_row
from .errors import FakeNixlError, FakePeerDisconnected
from .fabric import FabricStats, FakeFabric, FakeNixlAgent
from .faults import (
    Fault,
    FaultContext,
    FaultPlan,
    FaultyAgent,
    FaultyFactory,
    Gate,
    NotifFate,
    NotifRecorder,
    WriteFate,
    completion_of,
    faulty_factory,
    notif_contains,
    random_match,
)
from .pair import PushPair, wait_until
from .probe import ActorRig, Probe, ProbeSet

__all__ = [
    "ActorRig",
    "FabricStats",
    "FakeFabric",
    "FakeNixlAgent",
    "FakeNixlError",
    "FakePeerDisconnected",
    "Fault",
    "FaultContext",
    "FaultPlan",
    "FaultyAgent",
    "FaultyFactory",
    "Gate",
    "LayeredPrefill",
    "NotifFate",
    "NotifRecorder",
    "Probe",
    "ProbeSet",
    "PushPair",
    "RecvRecord",
    "SimEngine",
    "SimSpec",
    "StepReport",
    "WriteFate",
    "agent_info",
    "completion_of",
    "faulty_factory",
    "notif_contains",
    "pattern",
    "pattern_row",
    "random_match",
    "raw_registration",
    "registration",
    "wait_until",
]
