"""Reading pushactors' JSON mailbox logs: merge, follow, filter, trace, summarise, draw.

The library writes one JSON object per line and per mailbox message (:mod:`pushactors.logs`).
This package reads those files back for ``pushactors logs`` and ``pushactors top``:

* :mod:`.model` — one parsed :class:`~.model.Event` per line, and :class:`~.model.RequestIndex`,
  which finds every id one request has across P and D (transfer id, exact id, base id);
* :mod:`.clocks` — per-process wall-clock corrections from the handshakes' clock samples;
* :mod:`.source` — files, globs and directories, read incrementally and followed;
* :mod:`.filters`, :mod:`.render` — selecting events and showing them;
* :mod:`.stages`, :mod:`.trace`, :mod:`.summary`, :mod:`.plot` — the five stages of a push, one
  request's timeline, the run's stage and actor percentiles, and pictures of both;
* :mod:`.board` — the live per-rank numbers behind ``pushactors top``.
"""
