"""``pushactors settings``: every PushConfig setting with its type, default and description, as
plain text or (``--markdown``) as docs/settings.md, built from the fields' own metadata.

    pushactors settings                          # the reference, as help(PushConfig) shows it
    pushactors settings --markdown > docs/settings.md
"""

from __future__ import annotations

import argparse
import re

from ..core.config import SETTING_GROUPS, PushConfig
from ..core.settings_doc import Setting, grouped, settings_of, settings_text

REGENERATE = "pushactors settings --markdown > docs/settings.md"

_INTRO = f"""\
# Settings

<!-- Generated from pushactors/core/config.py by `{REGENERATE}`.
     Edit the descriptions there, then regenerate; tests/test_settings_doc.py fails while they differ. -->

Every setting of one engine's push transport is a field of `PushConfig`
(`pushactors/core/config.py`). This page is built from each field's own description, the text
`help(PushConfig)` prints too. Durations are in seconds. A key the code does not know, or a value
out of range, is an error before anything starts, and settings that break the timing rules are
refused together (docs/reliability.md, "Timing rules").

## How to set them

- **Python**: `PushConfig(engine_id="prefill-0", lease_duration=30.0)`, or
  `PushConfig.from_dict({{"engine_id": "prefill-0", "lease_duration": 30.0}})` from a mapping;
  `config.replace(lease_duration=60.0)` for a changed copy.
- **vLLM**: keys of `kv_connector_extra_config` in `--kv-transfer-config`, e.g.
  `"kv_connector_extra_config": {{"side_channel_port": 5600, "push_mode": "layerwise"}}`.
  `engine_id` and `role` come from vLLM's own `engine_id` and `kv_role`. The connector also
  takes vLLM's names `kv_lease_duration` and `push_registration_timeout`, its own
  `compat_model`, and ignores keys of vLLM's NIXL connector that mean nothing here
  (`num_threads`: use `nixl_num_threads`); docs/vllm.md, "Settings".
- **Benches**: `pushactors bench SUITE --config KEY=VALUE` sets a key on both nodes (repeatable;
  VALUE is read as JSON when it parses, e.g. `--config staging_bytes=2147483648`); the
  layerwise suite's `--p-config` / `--d-config` set one side (docs/performance.md).

Settings marked **vLLM only** are read by the vLLM connector alone: elsewhere they are accepted
and change nothing.
"""


def settings_page() -> str:
    """docs/settings.md: the intro, then one table per group."""
    groups = grouped(settings_of(PushConfig), SETTING_GROUPS)
    out = [_INTRO]
    out.append(" · ".join(f"[{_short(title)}](#{_slug(title)})" for _, title, _ in groups) + "\n")
    for _, title, members in groups:
        out.append(f"## {title}\n")
        out.append("| setting | type, range | default | what it does |")
        out.append("|---|---|---|---|")
        out += [_row(s) for s in members]
        out.append("")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--markdown", action="store_true", help=f"print docs/settings.md ({REGENERATE})")


def run(args: argparse.Namespace) -> int:
    print(settings_page() if args.markdown else settings_text(PushConfig, SETTING_GROUPS).lstrip("\n"), end="")
    if not args.markdown:
        print()
    return 0


def _row(s: Setting) -> str:
    description = ("**vLLM only.** " if s.vllm_only else "") + s.description
    default = s.default_json if s.required else f"`{s.default_json}`"
    if s.default_note:
        default += f" ({s.default_note})"
    cells = [f"`{s.name}`", s.kind, default, description]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _cell(text: str) -> str:
    # A pipe ends a cell; "<stem>" would be read as an HTML tag and vanish.
    return re.sub(r"<(?=[A-Za-z/!])", "&lt;", text.replace("|", "\\|").replace("\n", " "))


def _short(title: str) -> str:
    return title.partition(":")[0]


def _slug(title: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
