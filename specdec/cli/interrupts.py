"""SIGTERM as Ctrl-C, for the commands that start the roles as child
processes (`specd bench`, `specd soak`).

The children run in sessions of their own (`specdec.processes`), so a
signal to the command reaches them only through the command: SIGTERM's
default action would end it at once and leave them running. Raising
KeyboardInterrupt instead unwinds the command through its `finally`
clauses, which stop the children.
"""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupted_by_signals():
    """SIGTERM and SIGINT raise KeyboardInterrupt meanwhile (SIGINT too: a
    shell starting `specd bench &` leaves SIGINT ignored); the handlers
    before are restored after. Only the main thread can install handlers:
    elsewhere this does nothing."""
    def on_signal(*_):
        raise KeyboardInterrupt

    with handling_signals(on_signal):
        yield


@contextlib.contextmanager
def handling_signals(handler):
    """SIGTERM and SIGINT call `handler(signum, frame)` meanwhile; the
    handlers before are restored after. Only the main thread can install
    handlers: elsewhere this does nothing."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
