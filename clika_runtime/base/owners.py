"""Folders named after the process that made them, so that another process can tell the ones a
dead process left (SIGKILL, or SIGTERM's default action, runs no clean-up) from live ones."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
from pathlib import Path

logger = logging.getLogger("clika_runtime")

# This host, as a name part without dots: a pid means nothing on another host (or in another
# container sharing the folder).
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12]
_PID_LIMIT = 2**22  # Linux's largest pid_max
OWNED = "clika_runtime"  # the kind of the folders graphs are kept in: ``clika_runtime.<pid>.<host>.``


def owned(kind: str) -> str:
    """A folder name prefix that names this process and host: ``kind.pid.host.``."""
    return f"{kind}.{os.getpid()}.{_HOST}."


def abandoned(name: str) -> bool:
    """Whether a folder named with ``owned`` belongs to a process of this host that is gone."""
    parts = name.split(".")
    if len(parts) < 4 or parts[2] != _HOST or not (parts[1].isascii() and parts[1].isdigit()):
        return False  # another host's, or not named by us: not ours to judge
    pid = int(parts[1])
    return 0 < pid < _PID_LIMIT and not _alive(pid)  # past any pid: a name anyone could make, not ours


def remove_abandoned(folder: Path, kind: str = "") -> None:
    """Remove the folders in ``folder`` (those whose name starts with ``kind``) that processes of
    this host left when they died. Folders it cannot list or remove are left as they are."""
    try:
        names = [entry.name for entry in os.scandir(folder) if entry.name.startswith(kind)]
    except OSError:
        return
    for name in names:
        if abandoned(name) and (folder / name).is_dir():
            shutil.rmtree(folder / name, ignore_errors=True)
            logger.debug("removed %s, left by a process that is gone", folder / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (PermissionError), or one we cannot ask about: kept
        return True
    return True
