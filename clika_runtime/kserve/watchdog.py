"""The bound on a stop of ``clika-runtime serve``, kept from outside the server's process.

Run as a script, not imported (the standard library only, so it starts in milliseconds)::

    python watchdog.py SERVER_PID DEADLINE_S [SPARED_PID ...]

with its stdin one end of the socket pair whose other end is the server's signal wakeup fd.
CPython's C-level signal handler writes each signal's number there the moment it arrives, with
no need for the GIL; so the first SIGINT or SIGTERM starts this clock even while the server's
main thread sits in C code that keeps the GIL (Ray's constructors do), where no thread of the
server could run Python to keep a clock of its own. The server ends the watch by closing its
end (its stop is over) or by dying.

When the clock runs out: one line; the server prints where each of its threads stood
(faulthandler, registered on ``DUMP``, which needs no GIL either); then the server and what it
started but the spared (found before the ask for stacks too, should it end the server and orphan
them) are frozen (SIGSTOP, so nothing forks an orphan while they die) and killed (SIGKILL). Where
there is no ``/proc`` to walk, only the server is killed.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

DUMP = signal.SIGUSR2  # the server's faulthandler prints its threads' stacks on it
_STOPS = (signal.SIGINT, signal.SIGTERM)
_DUMP_WAIT_S = 0.5  # for the stacks to be printed before the server is frozen
_FREEZE_WAIT_S = 1.0  # for each round's frozen processes to stop, at most
_FREEZE_ROUNDS = 10  # a bound on the walk, should the processes it freezes keep forking


def main(argv: list[str]) -> None:
    server, deadline_s, spared = int(argv[1]), float(argv[2]), {int(pid) for pid in argv[3:]}
    for s in _STOPS:  # a stop signal sent here anyway (a session of its own keeps a terminal's Ctrl-C away)
        signal.signal(s, signal.SIG_IGN)  # must not end the watch before the stop it bounds
    if _over_in_time(deadline_s) or os.getppid() != server:  # over, or the server gone (its pid may be reused)
        return
    _say(f"clika-runtime: the stop did not end within {deadline_s:g} s; ending the server (pid {server}) "
         "and the processes it started. Where it stood:\n")
    spared.add(os.getpid())
    started = _descendants([server])  # known before the ask for stacks, should it end the server
    _send(server, DUMP)
    time.sleep(_DUMP_WAIT_S)
    _send(server, signal.SIGSTOP)  # first: a server forking in a loop would keep the walk below going
    for pid in [server, *_frozen_tree([server, *started], spared)]:
        _send(pid, signal.SIGKILL)


def _say(line: str) -> None:
    try:
        os.write(2, line.encode(errors="replace"))
    except OSError:  # stderr closed, or its reader gone (``serve ... | head``): the ending comes first
        pass


def _over_in_time(deadline_s: float) -> bool:
    """Read the signal numbers on stdin; True once it closes (the stop is over, or the server gone)
    before ``deadline_s`` passed since the first SIGINT or SIGTERM, False when the deadline passes."""
    ends = None
    while True:
        wait = None if ends is None else max(0.0, ends - time.monotonic())
        if not select.select([0], [], [], wait)[0]:
            return False
        heard = os.read(0, 64)
        if not heard:
            return True
        if ends is None and any(number in heard for number in _STOPS):
            ends = time.monotonic() + deadline_s


def _frozen_tree(roots: list[int], spared: set[int]) -> list[int]:
    """Stop (SIGSTOP) ``roots`` but the first and every descendant of them but ``spared``, round
    after round until a round finds none new (a process stopped while it forked leaves a child the
    next round finds), at most ``_FREEZE_ROUNDS`` rounds."""
    frozen: list[int] = []
    for _ in range(_FREEZE_ROUNDS):
        found = [*roots[1:], *_descendants(roots)]
        new = list(dict.fromkeys(pid for pid in found if pid not in spared and pid not in frozen))
        if not new:
            break
        for pid in new:
            _send(pid, signal.SIGSTOP)
        _wait_stopped(new)
        frozen += new
    return frozen


def _descendants(roots: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in _processes().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(roots)
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _wait_stopped(pids: list[int]) -> None:
    """Until each of ``pids`` is stopped or gone (a signal is sent at once, taken a moment later)."""
    ends = time.monotonic() + _FREEZE_WAIT_S
    while time.monotonic() < ends:
        states = _processes()
        if all(states.get(pid, (0, "X"))[1] in "TtZX" for pid in pids):
            return
        time.sleep(0.01)


def _processes() -> dict[int, tuple[int, str]]:
    """Each process's parent pid and state letter, from ``/proc`` (none elsewhere)."""
    found = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            state, ppid = stat[stat.rindex(b")") + 2:].split()[:2]  # the name in parentheses may hold spaces
            found[int(entry)] = (int(ppid), state.decode())
    return found


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:  # gone already
        pass


if __name__ == "__main__":
    main(sys.argv)
