"""Ctrl-C for the commands that run until interrupted (``top``, ``logs --follow``)."""

from __future__ import annotations

import signal
import threading


def interruptible() -> None:
    """Let Ctrl-C raise KeyboardInterrupt even where SIGINT was ignored when the process started.

    A shell starts a background job (``cmd &``) with SIGINT ignored, and Python then installs no
    handler of its own: a terminal opened later from there (tmux, a pty) could not stop the
    command with Ctrl-C. A command a person watches and ends by hand must always be stoppable.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
