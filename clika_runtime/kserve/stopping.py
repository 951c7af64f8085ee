"""How ``clika-runtime serve`` stops at any moment: signals, and every process its Ray started gone.

SIGINT and SIGTERM become a ``KeyboardInterrupt`` in the main thread, from before Ray starts, and
set a flag that the startup steps and the wait read: code that swallows the interrupt (an exception
raised in a ``__del__``, or in a callback run from C, is printed and dropped) cannot turn a stop
into a server that runs on. Once a stop came, a deadline bounds it, kept by a watchdog process
(``watchdog.py``): a stop stuck anywhere, in C code that holds the GIL included, is cut short,
where it stood printed, and what it started killed.

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
import subprocess
import sys
import time
import weakref
from typing import Any, Iterator

from clika_runtime.kserve import watchdog

logger = logging.getLogger("clika_runtime")

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37  # linux/prctl.h
_ROUNDS = 3  # reaping rounds: a process killed while it forked leaves a child the next round finds
_WATCHDOG_EXIT_S = 5.0  # for the watchdog to see its pair closed and exit
_MISSING = object()


class Stop:
    """SIGINT and SIGTERM as ``Stopped`` (a ``KeyboardInterrupt``) in the main thread, then ignored while stopping.

    With ``deadline_s``, a watchdog process, started now, bounds a stop: one not over within
    ``deadline_s`` of its signal (until ``restore()``) ends with where this process stood printed,
    every process it started since this ``Stop`` was made killed, then this process (SIGKILL)."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, deadline_s: float | None = None) -> None:
        self._previous = {s: signal.getsignal(s) for s in self._SIGNALS}
        self._unraisable = sys.unraisablehook
        self._watch = _Watch(deadline_s) if deadline_s is not None else None
        if self._watch is not None:
            _WATCHING.add(self)
        self.requested = False  # a stop came
        self._raised = False  # the handler raised ``Stopped`` once: later signals only say so again

    def install(self) -> None:
        for s in self._SIGNALS:
            signal.signal(s, self._interrupt)
        sys.unraisablehook = self._drop_stops
        if self._watch is not None:
            self._watch.hear()

    def ignore(self) -> None:
        for s in self._SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    def restore(self) -> None:
        self.ignore()  # a signal meanwhile must not cut the restoring short (then the previous handlers)
        if self._watch is not None:  # the stop is over: the watchdog sees its pair closed and exits
            self._watch.close()
            self._watch = None
            _WATCHING.discard(self)
        self._put_back()
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
        if self._watch is not None:  # told by the C-level handler already, unless something replaced the wakeup fd
            self._watch.tell(signum)
        if not self._raised:  # once: a second one (Ctrl-C, then SIGTERM) raised in the stop's finally, skipping it
            self._raised = True
            raise Stopped

    def _put_back(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def _drop_stops(self, unraisable: Any) -> None:
        """Say nothing of a stop dropped on its way (Python prints an exception raised in an
        at-fork hook, a ``__del__`` or a callback from C, then drops it): the flag carries it."""
        if not isinstance(unraisable.exc_value, Stopped):
            self._unraisable(unraisable)

    def _forget(self) -> None:
        """In a forked child: its signals are its own (a SIGTERM to the child must not start the
        parent's clock), and the watchdog sees the pair closed once the parent closes its end."""
        if self._watch is not None:
            with contextlib.suppress(ValueError, OSError):  # forked from another thread: not the main one
                self._put_back()  # a worker's SIGTERM is its own end, not a server's stop
            self._watch.forget()
            self._watch = None


class _Watch:
    """The watchdog process of a ``Stop`` and this process's end of the socket pair it reads.

    Once heard (``hear``), that end is this process's signal wakeup fd: CPython's C-level handler
    writes each signal's number to it on arrival, without the GIL, so the watchdog's clock starts
    even while the main thread sits in C that holds it."""

    def __init__(self, deadline_s: float) -> None:
        ours, theirs = socket.socketpair()
        spared = [str(p.pid) for p in _descendants()]  # not started by the server: left alone
        with theirs:  # a session of its own: a terminal's Ctrl-C, sent to its process group, misses it
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", watchdog.__file__, str(os.getpid()), f"{deadline_s:g}", *spared],
                stdin=theirs.fileno(), start_new_session=True)
        ours.setblocking(False)  # as set_wakeup_fd requires: a full buffer drops bytes, never blocks
        self._end = ours
        self._wakeup_before: int | None = None  # the wakeup fd ours replaced, once heard
        self._dump_before: Any = None  # the stacks' signal's handler before, once heard

    def hear(self) -> None:
        if self._wakeup_before is None:
            self._wakeup_before = signal.set_wakeup_fd(self._end.fileno(), warn_on_full_buffer=False)
            self._dump_before = signal.getsignal(watchdog.DUMP)
            try:
                faulthandler.register(watchdog.DUMP, file=sys.stderr, all_threads=True)
            except (AttributeError, ValueError, OSError, RuntimeError):  # a stderr closed or not a file: no stacks,
                signal.signal(watchdog.DUMP, signal.SIG_IGN)  # and the watchdog's ask for them must not end us

    def tell(self, signum: int) -> None:
        with contextlib.suppress(OSError):
            self._end.send(bytes([signum]))

    def close(self) -> None:
        self._unhear()
        try:
            self._process.wait(timeout=_WATCHDOG_EXIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def forget(self) -> None:
        """In a forked child: the wakeup fd and the stacks' signal back as they were, the end closed."""
        with contextlib.suppress(ValueError, OSError):
            self._unhear()
        self._end.close()  # also where putting the wakeup fd back failed (forked from another thread)

    def _unhear(self) -> None:
        """The wakeup fd back, then the end closed (the watchdog's watch is over), and only then the
        stacks' signal back: until the watchdog knows, its ask for them must not end this process."""
        if self._wakeup_before is not None:
            signal.set_wakeup_fd(self._wakeup_before)
        self._end.close()
        if self._wakeup_before is not None:
            if not faulthandler.unregister(watchdog.DUMP):  # ignored instead: as it was before
                signal.signal(watchdog.DUMP, self._dump_before if self._dump_before is not None else signal.SIG_DFL)
            self._wakeup_before = None


_WATCHING: "weakref.WeakSet[Stop]" = weakref.WeakSet()  # the stops with a watchdog in this process


def _forget_in_child() -> None:
    for stop in list(_WATCHING):
        stop._forget()
    _WATCHING.clear()


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
    node for up to 30 s and exits 1), and the driver's core worker installs a C handler (absl's
    failure handler: a stack dump, then the previous handler) unless Ray's constant says not to;
    that constant is read from the environment when Ray is imported, so setting the variable
    before ``ray.init`` changed nothing. Ours stays instead (the processes Ray started are ended
    by ``reap``)."""
    from ray._private import ray_constants, utils

    setter = getattr(utils, "set_sigterm_handler", None)
    disabled = vars(ray_constants).get("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", _MISSING)
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    if setter is not None:
        utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if setter is not None:
            utils.set_sigterm_handler = setter
        if disabled is _MISSING:
            del ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
        else:
            ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = disabled


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
