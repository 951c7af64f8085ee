"""How ``clika-runtime serve`` takes a stop: real signals to a real ``python -m`` process, without Ray but in
one test (which C-level handler ``ray.init`` leaves in place)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]

# What Ray's startup does at times: run Python code from C (PyRun_String, as Cython modules do
# while they import). A SIGTERM lands in it; the server catches the stop and returns normally.
_STOPPED_INSIDE_C = textwrap.dedent("""
    import ctypes, os, signal, sys, threading
    from clika_runtime.kserve.stopping import Stop

    stop = Stop()
    stop.install()
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    run_string = ctypes.pythonapi.PyRun_String
    run_string.restype = ctypes.py_object
    run_string.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
    try:
        run_string(b"import time\\ntime.sleep(30)", 257, {}, {})  # 257: Py_file_input
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        stop.restore()
""")


def test_a_stop_caught_inside_code_run_from_c_still_exits_0(tmp_path):
    """CPython remembers a bare ``KeyboardInterrupt`` that ends code run by PyRun_String and, under
    ``python -m``, ends the process with SIGINT at exit even though it was caught: a SIGTERM early
    in ``ray.init`` made ``python -m clika_runtime serve`` exit -2 (once in about 50 stops)."""
    result = _run_script(tmp_path, "stopped_inside_c", _STOPPED_INSIDE_C, timeout=60)
    assert (result.returncode, result.stdout) == (0, "stopped\n"), result.stderr[-2000:]


def _run_script(tmp_path: Path, name: str, text: str, timeout: float) -> subprocess.CompletedProcess:
    (tmp_path / f"{name}.py").write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    return subprocess.run([sys.executable, "-m", name], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


# Python drops an exception raised in an at-fork hook, a ``__del__`` or a callback from C, after
# printing it: a SIGTERM landed in logging's at-fork hook while Ray started its daemons. Then the
# server's wait.
_SWALLOWED = textwrap.dedent("""
    import os, signal, time
    from clika_runtime.kserve.stopping import Stop, Stopped

    class Dropping:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)

    stop = Stop()
    stop.install()
    Dropping()
    print("dropped", flush=True)
    try:
        stop.wait()
    except Stopped:
        print("stopped", flush=True)
    finally:
        stop.restore()
""")


def test_trap_a_stop_swallowed_on_its_way_still_stops_the_wait(tmp_path):
    """A stop whose ``KeyboardInterrupt`` Python dropped while Ray started left the server serving:
    it then waited for a signal that had come already (once in a CI run, the server did not exit
    within 60 s of a SIGTERM sent as Ray started). It stops, and prints no dropped exception."""
    result = _run_script(tmp_path, "swallowed", _SWALLOWED, timeout=30)
    assert (result.returncode, result.stdout) == (0, "dropped\nstopped\n"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr


# A stop that arrives while the main thread is in C code that keeps the GIL (Ray's constructors
# run so: a CI run's server stood 60 s in one after a SIGTERM), so no thread of the process can
# run Python, and stays there. The signal comes from outside, while the process is in that C.
_STUCK = textwrap.dedent("""
    import ctypes, os, subprocess, sys
    from clika_runtime.kserve.stopping import Stop

    stop = Stop(deadline_s=1.0)
    stop.install()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)
    subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -TERM {os.getpid()}"])
    lock = ctypes.PyDLL(None).pthread_mutex_lock  # called with the GIL held
    mutex = ctypes.create_string_buffer(64)  # zeroed: a default mutex, which a second lock deadlocks
    lock(mutex)
    try:
        lock(mutex)
    except KeyboardInterrupt:  # the signal came before: stuck in the shutdown instead
        lock(mutex)
    print("slept on", flush=True)
""")


def test_trap_a_stop_stuck_in_c_holding_the_gil_ends_the_process_within_its_deadline(tmp_path):
    """The stop's deadline holds where no thread of the process can run Python (the clock used to
    be a thread of the process itself): past it, where each thread stood is printed, what the
    process started is killed, then the process (SIGKILL)."""
    started = time.monotonic()
    result = _run_script(tmp_path, "stuck", _STUCK, timeout=30)
    took = time.monotonic() - started
    child = int(result.stdout.split()[0])
    assert result.returncode == -signal.SIGKILL and "slept on" not in result.stdout, result.stderr[-2000:]
    assert took < 10, f"{took:.1f} s"
    assert "the stop did not end within 1 s" in result.stderr and "stuck.py" in result.stderr, result.stderr[-2000:]
    assert _gone(child, timeout=2), "the process it started outlived it"


# The watchdog's life: a Ctrl-C (sent to the whole process group) leaves it watching; it ends
# with the stop (``restore``), and with its process when that dies without one.
_WATCHDOG_LIFE = textwrap.dedent("""
    import os, signal, sys, time
    import psutil
    from clika_runtime.kserve.stopping import Stop

    stop = Stop(deadline_s=30)
    stop.install()
    watchdog, = psutil.Process().children()
    os.kill(watchdog.pid, signal.SIGINT)
    time.sleep(0.3)
    print(watchdog.is_running(), flush=True)
    stop.restore()
    print(psutil.Process().children(), flush=True)
    stop = Stop(deadline_s=30)
    stop.install()
    print(psutil.Process().children()[0].pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_the_watchdog_outlives_a_ctrl_c_and_ends_with_the_stop_or_its_process(tmp_path):
    result = _run_script(tmp_path, "watchdog_life", _WATCHDOG_LIFE, timeout=30)
    alive, after_restore, second = result.stdout.split("\n")[:3]
    assert (alive, after_restore) == ("True", "[]"), result.stderr[-2000:]
    assert _gone(int(second), timeout=5), "the watchdog outlived its process"


def _gone(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` ends within ``timeout`` (a zombie counts: its parent may not reap it)."""
    ends = time.monotonic() + timeout
    while time.monotonic() < ends:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_trap_a_stop_stuck_with_its_stderr_reader_gone_still_ends(tmp_path):
    """``serve ... 2>&1 | head -1``, once ``head`` exited: the watchdog's line to stderr raised
    BrokenPipeError, and the watchdog died before it ended anything (an attack)."""
    (tmp_path / "stuck.py").write_text(_STUCK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    with subprocess.Popen([sys.executable, "-m", "stuck"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=write, text=True) as process:
        os.close(write)
        child = int(process.stdout.readline())
        try:
            code = process.wait(timeout=15)
        finally:
            process.kill()
    assert code == -signal.SIGKILL, code
    assert _gone(child, timeout=2), "the stuck server's child outlived it"


# A stop whose process forks in a loop meanwhile: the walk that froze its tree went on as long as
# it forked, past the deadline (an attack).
_FORKING = textwrap.dedent("""
    import os, time
    from clika_runtime.kserve.stopping import Stop

    stop = Stop(deadline_s=1.0)
    stop.install()
    try:
        os.kill(os.getpid(), 15)
        time.sleep(5)
    except KeyboardInterrupt:
        ends = time.monotonic() + 8
        while time.monotonic() < ends:
            if os.fork() == 0:
                time.sleep(0.2)
                os._exit(0)
    print("forked on", flush=True)
""")


def test_trap_a_stop_that_forks_in_a_loop_still_ends_at_its_deadline(tmp_path):
    started = time.monotonic()
    result = _run_script(tmp_path, "forking", _FORKING, timeout=30)
    took = time.monotonic() - started
    assert result.returncode == -signal.SIGKILL and "forked on" not in result.stdout, result.stderr[-2000:]
    assert took < 5, f"{took:.1f} s"


# Where faulthandler cannot print (stderr closed: ``2>&-``; or not a file: captured, a notebook):
# the server starts all the same, and a stuck stop still ends with what it started killed (the
# dump's signal, unhandled, ended the server before the watchdog found its children: orphans).
_NO_STDERR_FILE = _STUCK.replace("stop = Stop(deadline_s=1.0)\n", textwrap.dedent("""
    import io
    closed = Stop(deadline_s=30)
    sys.stderr = None  # as `2>&-` leaves it
    closed.install()
    closed.restore()
    sys.stderr = io.StringIO()
    stop = Stop(deadline_s=1.0)
"""), 1)


def test_trap_a_stderr_that_is_no_file_neither_stops_the_start_nor_orphans_a_stuck_stops_children(tmp_path):
    result = _run_script(tmp_path, "no_stderr_file", _NO_STDERR_FILE, timeout=30)
    assert result.returncode == -signal.SIGKILL, (result.returncode, result.stderr[-2000:])
    assert _gone(int(result.stdout.split()[0]), timeout=2), "the stuck server's child outlived it"


# A Ctrl-C the moment the watchdog starts (a terminal sends it to the whole process group): the
# watchdog, not yet past its own start, died of it, and that stop had no deadline.
_CTRL_C_AT_START = textwrap.dedent("""
    import os, signal, time
    import psutil
    from clika_runtime.kserve.stopping import Stop

    signal.signal(signal.SIGINT, lambda *_: None)  # this process lives on; what it starts does not inherit it
    stop = Stop(deadline_s=30)
    os.killpg(0, signal.SIGINT)
    time.sleep(0.5)
    print([c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in psutil.Process().children()], flush=True)
    stop.restore()
""")


def test_trap_a_ctrl_c_as_the_watchdog_starts_leaves_it_watching(tmp_path):
    (tmp_path / "ctrl_c_at_start.py").write_text(_CTRL_C_AT_START)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    result = subprocess.run([sys.executable, "-m", "ctrl_c_at_start"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=30, start_new_session=True)  # its own group: the Ctrl-C stays there
    assert (result.returncode, result.stdout) == (0, "[True]\n"), result.stderr[-2000:]


_TWO_SIGNALS = textwrap.dedent("""
    import os, signal, threading, time
    from clika_runtime.kserve.stopping import Stop

    def run_like():  # deployment.run's shape
        stop = Stop(deadline_s=5.0)
        try:
            stop.install()
            stop.wait()
        except KeyboardInterrupt:
            pass
        finally:
            stop.ignore()
            try:
                print("shut down", flush=True)
            finally:
                stop.restore()

    def send():
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send).start()
    run_like()
    print("returned", flush=True)
""")


def test_trap_a_ctrl_c_and_a_sigterm_together_still_shut_down(tmp_path):
    """The second signal's ``Stopped`` was raised inside the stop's own ``finally``, before the
    signals were ignored: the shutdown never ran and the stop escaped as an exception (an attack)."""
    result = _run_script(tmp_path, "two_signals", _TWO_SIGNALS, timeout=30)
    assert (result.returncode, result.stdout) == (0, "shut down\nreturned\n"), result.stderr[-2000:]


_FORKED = textwrap.dedent("""
    import os, signal, time
    from clika_runtime.kserve.stopping import Stop

    stop = Stop(deadline_s=1.0)
    stop.install()
    child = os.fork()
    if child == 0:  # a multiprocessing worker forked without exec
        try:
            time.sleep(30)
        except BaseException:
            pass
        os._exit(0)
    time.sleep(0.3)
    os.kill(child, signal.SIGTERM)  # the child's stop, not ours
    os.waitpid(child, 0)
    time.sleep(2.0)  # past our deadline, had the child's signal started our clock
    print(stop.requested, flush=True)
    stop.restore()
""")


def test_trap_a_signal_to_a_forked_child_is_not_the_parents_stop(tmp_path):
    """A child forked without exec inherited the wakeup fd and the pair it writes to: a SIGTERM to
    the child alone started the parent's clock, which ended the parent (an attack)."""
    result = _run_script(tmp_path, "forked", _FORKED, timeout=30)
    assert (result.returncode, result.stdout) == (0, "False\n"), (result.stdout, result.stderr[-2000:])


_HEARD_FIRST = textwrap.dedent("""
    import hashlib, os, signal, threading
    from clika_runtime.kserve.stopping import Stop, Stopped

    stop = Stop(deadline_s=30)
    stop.install()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    data = b"x" * (1 << 28)
    try:
        for _ in range(4):
            hashlib.sha256(data).digest()  # in C, the GIL released: the watchdog hears it first
        for _ in range(1000):
            pass
        print("not raised", flush=True)
    except Stopped:
        print("raised", flush=True)
    finally:
        stop.restore()
""")


def test_trap_the_first_signal_raises_when_the_watchdog_heard_it_first(tmp_path):
    """A thread that heard the wakeup fd (the watchdog's forerunner) set the flag before the handler
    ran, which then took the signal for a second one and raised nothing (an attack)."""
    result = _run_script(tmp_path, "heard_first", _HEARD_FIRST, timeout=60)
    assert (result.returncode, result.stdout) == (0, "raised\n"), result.stderr[-2000:]


_IN_RESTORE = textwrap.dedent("""
    import os, signal, time
    from clika_runtime.kserve.stopping import Stop, Stopped

    signal.signal(signal.SIGINT, signal.default_int_handler)  # the previous handler, whatever was inherited
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    stop = Stop(deadline_s=30)
    stop.install()
    real = signal.set_wakeup_fd

    def timed(*args, **kwargs):  # a Ctrl-C arriving while restore() runs
        done = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return done

    signal.set_wakeup_fd = timed
    stop.restore()
    signal.set_wakeup_fd = real
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
        print("swallowed", signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")


def test_trap_a_signal_while_restoring_leaves_the_previous_handlers_in_place(tmp_path):
    """A signal inside ``restore()`` raised half-way: the stop's handler stayed installed and every
    later Ctrl-C was swallowed (an attack)."""
    result = _run_script(tmp_path, "in_restore", _IN_RESTORE, timeout=60)
    assert (result.returncode, result.stdout) == (0, "interrupted\n"), result.stderr[-2000:]


# Which C-level handler takes a SIGTERM while ``ray.init`` runs, read with sigaction every half
# millisecond from a thread: the driver's core worker installed absl's failure handler over
# Python's (a stack dump on each stop, then Python's), though the variable that disables it was set.
_RAY_INIT_HANDLERS = textwrap.dedent("""
    import ctypes, signal, threading, time
    import ray
    from clika_runtime.kserve import stopping

    libc = ctypes.CDLL(None)
    def handler():
        action = ctypes.create_string_buffer(256)  # a struct sigaction, its handler first
        libc.sigaction(signal.SIGTERM, None, action)
        return action.raw[:8]
    stop = stopping.Stop()
    stop.install()
    ours, seen, running = handler(), set(), True
    def watch():
        while running:
            seen.add(handler())
            time.sleep(0.0005)
    watcher = threading.Thread(target=watch)
    watcher.start()
    with stopping.ray_keeps_our_handlers():
        ray.init(address="local", include_dashboard=False, num_cpus=1)
    running = False
    watcher.join()
    ray.shutdown()
    stop.restore()
    print(seen == {ours}, flush=True)
""")


@pytest.mark.slow
def test_trap_ray_init_leaves_pythons_c_level_sigterm_handler_in_place(tmp_path):
    result = _run_script(tmp_path, "ray_init_handlers", _RAY_INIT_HANDLERS, timeout=120)
    assert (result.returncode, result.stdout) == (0, "True\n"), result.stderr[-3000:]
