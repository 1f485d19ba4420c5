"""Test support that ships with pushactors, for its own tests and for users' integrations.

* :class:`FakeFabric` / :class:`FakeNixlAgent`: a working NIXL stand-in that moves real bytes
  between registered CPU tensors, with fault injection (:class:`FaultPlan`).
* :class:`SimEngine`: a stand-in engine that drives schedulers and workers end to end.
* :mod:`pushactors.testing.fixtures`: pytest fixtures (``pytest_plugins = ["pushactors.testing.fixtures"]``).
"""

from .builders import agent_info, raw_registration, registration
from .engine import LayeredPrefill, RecvRecord, SimEngine, SimSpec, StepReport, pattern, pattern_row
from .fabric import (
    FabricStats,
    FakeFabric,
    FakeNixlAgent,
    FakeNixlError,
    Fault,
    FaultContext,
    FaultPlan,
    Gate,
    completion_of,
    notif_contains,
)
from .pair import PushPair, wait_until
from .probe import ActorRig, Probe, ProbeSet

__all__ = [
    "ActorRig",
    "FabricStats",
    "FakeFabric",
    "FakeNixlAgent",
    "FakeNixlError",
    "Fault",
    "FaultContext",
    "FaultPlan",
    "Gate",
    "LayeredPrefill",
    "Probe",
    "ProbeSet",
    "PushPair",
    "RecvRecord",
    "SimEngine",
    "SimSpec",
    "StepReport",
    "agent_info",
    "completion_of",
    "notif_contains",
    "pattern",
    "pattern_row",
    "raw_registration",
    "registration",
    "wait_until",
]
