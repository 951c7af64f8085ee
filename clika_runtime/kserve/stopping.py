"""How ``clika-runtime serve`` stops at any moment: signals, and every process its Ray started gone.

SIGINT and SIGTERM become a ``KeyboardInterrupt`` in the main thread, from before Ray starts, and
set a flag that the startup steps and the wait read: code that swallows the interrupt (an exception
raised in a ``__del__``, or in a callback run from C, is printed and dropped) cannot turn a stop
into a server that runs on. Once a stop came, a deadline bounds it: a shutdown stuck anywhere is
cut short, where it stood printed, and what it started killed.

The processes the server's Ray started are found down its process tree. A stop while Ray starts
kills daemons that are still starting children of their own (the dashboard's forkserver, the
raylet's agents), and an orphan is re-parented to init, out of that tree, so the server makes
itself their child subreaper first (Linux): orphans come to it instead. Not by their environment:
the agents and the dashboard's modules rename themselves (setproctitle), which overwrites it.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from typing import Any, Iterator

logger = logging.getLogger("clika_runtime")

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37  # linux/prctl.h
_ROUNDS = 3  # reaping rounds: a process killed while it forked leaves a child the next round finds


class Stop:
    """SIGINT and SIGTERM as ``Stopped`` (a ``KeyboardInterrupt``) in the main thread, then ignored while stopping.

    With ``deadline_s``, a stop also starts a clock the moment it arrives: a stop not over within
    ``deadline_s`` (until ``restore()``) ends the process with exit code 0, after killing every
    process started since this ``Stop`` was made."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, deadline_s: float | None = None) -> None:
        self._previous = {s: signal.getsignal(s) for s in self._SIGNALS}
        self._deadline_s = deadline_s
        self._spare = set(_descendants()) if deadline_s is not None else set()
        self._clock: threading.Timer | None = None
        self._lock = threading.Lock()
        self._over = False
        self._hearing: tuple[int, socket.socket, socket.socket] | None = None  # wakeup fd before, writer, reader
        self._unraisable = sys.unraisablehook
        self.requested = False  # a stop came (heard by the listening thread, or by the handler)
        self._raised = False  # the handler raised ``Stopped`` once: later signals only say so again

    def install(self) -> None:
        for s in self._SIGNALS:
            signal.signal(s, self._interrupt)
        sys.unraisablehook = self._drop_stops
        if self._deadline_s is not None and self._hearing is None:
            self._hear()

    def ignore(self) -> None:
        for s in self._SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    def restore(self) -> None:
        self.ignore()  # a signal meanwhile must not cut the restoring short (then the previous handlers)
        with self._lock:  # the listening thread starts no clock once this holds
            self._over = True
            if self._clock is not None:
                self._clock.cancel()
        if self._hearing is not None:
            previous, writer, _ = self._hearing
            signal.set_wakeup_fd(previous)
            writer.close()  # the listening thread reads the end of its stream and returns
            self._hearing = None
            _HEARING.discard(self)
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        sys.unraisablehook = self._unraisable

    def check(self) -> None:
        """Raise ``Stopped`` if a stop came, even one that code in between swallowed."""
        if self.requested:
            raise Stopped

    def wait(self) -> None:
        """Block until a stop comes; return never, raise ``Stopped``."""
        while not self.requested:
            time.sleep(0.5)  # a signal cuts the sleep short; the bound covers a swallowed stop
        raise Stopped

    def _interrupt(self, signum: int, frame: Any) -> None:
        self.requested = True
        if self._hearing is not None:  # heard already, unless something replaced the wakeup fd
            with contextlib.suppress(OSError):
                self._hearing[1].send(bytes([signum]))
        if not self._raised:  # once: a second one (Ctrl-C, then SIGTERM) raised in the stop's finally, skipping it
            self._raised = True
            raise Stopped

    def _drop_stops(self, unraisable: Any) -> None:
        """Say nothing of a stop dropped on its way (Python prints an exception raised in an
        at-fork hook, a ``__del__`` or a callback from C, then drops it): the flag carries it."""
        if not isinstance(unraisable.exc_value, Stopped):
            self._unraisable(unraisable)

    def _hear(self) -> None:
        """Hear a stop the moment it arrives, from a thread of its own that starts the clock:
        ``_interrupt`` runs only once the main thread is back in Python code, and ``ray.init``
        waits in C for seconds."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # as set_wakeup_fd requires: a full buffer drops bytes, never blocks
        self._hearing = (signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False), writer, reader)
        _HEARING.add(self)
        threading.Thread(target=self._listen, args=(reader,), name="clika-runtime stop", daemon=True).start()

    def _forget(self) -> None:
        """In a forked child: its signals are its own (it inherits the wakeup fd and both ends of the
        pair: a SIGTERM to the child ended the parent), and the parent's reader sees the end of its
        stream once the parent closes its writer."""
        if self._hearing is not None:
            previous, writer, reader = self._hearing
            with contextlib.suppress(ValueError, OSError):  # forked from another thread: not the main one
                signal.set_wakeup_fd(previous)
                for s, handler in self._previous.items():  # a worker's SIGTERM is its own end, not a server's stop
                    signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            writer.close()
            reader.close()
            self._hearing = None

    def _listen(self, reader: socket.socket) -> None:
        with reader:  # read until the writer closes: a reader closed early made later signals' writes fail
            while heard := reader.recv(64):  # the signals' numbers, a byte each; nothing once closed
                if any(number in heard for number in self._SIGNALS):
                    self._start_clock()

    def _start_clock(self) -> None:
        self.requested = True
        with self._lock:  # once: the first signal's
            if not self._over and self._deadline_s is not None and self._clock is None:
                self._clock = _exit_within(self._deadline_s, self._spare)


def _exit_within(seconds: float, spare: set[Any]) -> threading.Timer:
    """Start a clock that, unless cancelled within ``seconds``, prints where every thread stands,
    kills this process's descendants but ``spare``, and ends the process with exit code 0."""
    clock = threading.Timer(seconds, _cut_short, (seconds, spare))
    clock.daemon = True
    clock.start()
    return clock


def _cut_short(seconds: float, spare: set[Any]) -> None:
    with contextlib.suppress(Exception):  # a closed stream must not keep the process alive
        sys.stdout.flush()
        print(f"clika-runtime: the stop did not end within {seconds:g} s; ending the process. "
              "Where it stood:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    with contextlib.suppress(Exception):
        reap(spare, 0.2)
    os._exit(0)


_HEARING: "weakref.WeakSet[Stop]" = weakref.WeakSet()  # the stops listening in this process


def _forget_in_child() -> None:
    for stop in list(_HEARING):
        stop._forget()
    _HEARING.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM asked the server to stop; caught as a ``KeyboardInterrupt``.

    A subclass, because CPython remembers a bare ``KeyboardInterrupt`` that ends code a C
    extension runs (PyRun_String, as Cython modules do while Ray starts) and, under ``python -m``,
    ends the process with SIGINT at exit even when it was caught (exit code -2): it checks the
    exception's type by identity."""


@contextlib.contextmanager
def ray_keeps_our_handlers() -> Iterator[None]:
    """Keep Ray from replacing the SIGTERM handler while ``ray.init`` runs.

    ``ray.init`` installs handlers of its own for SIGTERM (``sys.exit``, then one that drains the
    node for up to 30 s and exits 1), and the driver's core worker installs a C handler that
    aborts with a stack dump: a SIGTERM during startup then ended the server with -6 and left
    Ray's agents running. Ours stays instead (the processes Ray started are ended by ``reap``).
    """
    from ray._private import utils

    setter = getattr(utils, "set_sigterm_handler", None)
    had = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER" in os.environ
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    if setter is not None:
        utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if setter is not None:
            utils.set_sigterm_handler = setter
        if not had:
            os.environ.pop("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)


@contextlib.contextmanager
def adopting_orphans() -> Iterator[set[Any]]:
    """Make this process the child subreaper of all it starts meanwhile (Linux; elsewhere nothing),
    and yield the descendants it had before, which ``reap`` leaves alone.

    An orphaned descendant is then re-parented to this process instead of init: what a stop while
    Ray starts orphans (the raylet's agents, the dashboard's forkserver) stays in this process's
    tree, where ``reap`` finds it. Orphans that exit while the server runs wait as zombies until
    ``reap`` collects them (psutil waits on a child with ``waitpid``)."""
    before = set(_descendants())
    was = _subreaper(True)
    try:
        yield before
    finally:
        if was is False:
            _subreaper(False)


def _subreaper(on: bool) -> bool | None:
    """Set this process's child-subreaper flag (``prctl``); return what it was, or None where
    the call is missing or fails (not Linux, a kernel before 3.4, a seccomp filter)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    was = ctypes.c_int(0)
    if prctl(_PR_GET_CHILD_SUBREAPER, ctypes.addressof(was), 0, 0, 0) != 0:
        return None
    if prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        return None
    return bool(was.value)


def reap(before: set[Any], timeout_s: float) -> None:
    """End this process's descendants but those in ``before``: ``timeout_s`` to exit on their own,
    then a SIGTERM and as long again, then a SIGKILL; a few rounds, for the orphans of a process
    killed while it started children (re-parented here under ``adopting_orphans``).

    ``ray.shutdown`` kills the daemons it recorded; the dashboard's modules outlive it by 2-3 s,
    and a stop during startup kills the daemons while they start their own children (the
    dashboard's forkserver, the raylet's agents), which would otherwise live on for a minute."""
    for _ in range(_ROUNDS):
        processes = [p for p in _descendants() if p not in before]
        if not processes:
            return
        _end(processes, timeout_s)


def _descendants() -> list[Any]:
    """This process's descendants, by psutil; none without it."""
    try:
        import psutil  # Ray ships it (ray/thirdparty_files) and puts it on the path
    except ImportError:
        return []
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _end(processes: list[Any], timeout_s: float) -> None:
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for signal_name, method in (("SIGTERM", "terminate"), ("SIGKILL", "kill")):
        for process in alive:
            try:
                logger.debug("%s to %s (pid %d), left by Ray", signal_name, process.name(), process.pid)
                getattr(process, method)()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(alive, timeout=timeout_s)
        if not alive:
            return
