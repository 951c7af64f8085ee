"""The bound on a stop of ``clika-runtime serve``, kept from outside the server's process.

Run as a script, not imported (the standard library only, so it starts in milliseconds)::

    python watchdog.py SERVER_PID DEADLINE_S [SPARED_PID ...]

with its stdin one end of the socket pair whose other end is the server's signal wakeup fd.
CPython's C-level signal handler writes each signal's number there the moment it arrives, with
no need for the GIL; so the first SIGINT or SIGTERM starts this clock even while the server's
main thread sits in C code that keeps the GIL (Ray's constructors do), where no thread of the
server could run Python to keep a clock of its own. The server ends the watch by closing its
end (its stop is over) or by dying.

When the clock runs out: one line; what the server started but the spared is frozen (SIGSTOP, so
nothing forks an orphan while they die); the server prints where each of its threads stood
(faulthandler, registered on ``DUMP``, which needs no GIL either); then the server is frozen too,
with whatever it started meanwhile, and all are killed (SIGKILL). Where there is no ``/proc`` to
walk, only the server is killed.
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
_FREEZE_WAIT_S = 1.0  # for each frozen process to stop, at most


def main(argv: list[str]) -> None:
    server, deadline_s, spared = int(argv[1]), float(argv[2]), {int(pid) for pid in argv[3:]}
    for s in _STOPS:  # a Ctrl-C reaches the terminal's whole process group: this must outlive the stop it bounds
        signal.signal(s, signal.SIG_IGN)
    if _over_in_time(deadline_s) or os.getppid() != server:  # over, or the server gone (its pid may be reused)
        return
    print(f"clika-runtime: the stop did not end within {deadline_s:g} s; ending the server (pid {server}) "
          "and the processes it started. Where it stood:", file=sys.stderr, flush=True)
    spared.add(os.getpid())
    frozen = _frozen_tree(server, spared)  # first: should the ask for stacks end the server, they are known
    _send(server, DUMP)
    time.sleep(_DUMP_WAIT_S)
    _send(server, signal.SIGSTOP)
    frozen += _frozen_tree(server, spared | set(frozen))  # what it started meanwhile
    for pid in [server, *frozen]:
        _send(pid, signal.SIGKILL)


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


def _frozen_tree(root: int, spared: set[int]) -> list[int]:
    """Stop (SIGSTOP) every descendant of ``root`` but ``spared``, round after round until a round
    finds none new: a process stopped while it forked leaves a child the next round finds."""
    frozen: list[int] = []
    while new := [pid for pid in _descendants(root) if pid not in spared and pid not in frozen]:
        for pid in new:
            _send(pid, signal.SIGSTOP)
        _wait_stopped(new)
        frozen += new
    return frozen


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in _processes().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
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
