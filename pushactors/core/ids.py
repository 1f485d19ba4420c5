"""Request identity: how P's and D's ids for one router request are related
(docs/protocol.md, 'Matching')."""

from __future__ import annotations

import re

# Engines append "-" + 8 random hex digits to the router's id, per engine. Only that exact
# suffix is stripped: the completion index before it keeps sub-requests of one
# multi-prompt request apart.
_ENGINE_SUFFIX = re.compile(r"-[0-9a-fA-F]{8}\Z")


def base_request_id(request_id: str) -> str:
    """Return ``request_id`` without its per-engine random suffix, if it has one."""
    match = _ENGINE_SUFFIX.search(request_id)
    if match is None:
        return request_id
    return request_id[: match.start()]
