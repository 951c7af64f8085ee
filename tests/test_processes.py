"""A compiled function in a forked child (DataLoader workers, fork-context pools, pre-fork
servers): what the parent started (threads, sessions) is not in the child, which must capture,
serve and re-capture as a fresh process would."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# A fresh process, as a pre-fork server's parent is (a pytest worker holds the threads of every
# test it ran before, Ray's and gRPC's included, and a fork inherits their locks as they stand).
_FORK_AFTER_CAPTURE = textwrap.dedent("""
    import faulthandler, multiprocessing, sys, torch
    import clika_runtime as cr

    cr.config.cache_dir, threads = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()
    f = cr.compile(model)
    torch.set_num_threads(threads)
    with torch.no_grad():
        f(torch.randn(5, 4)), f(torch.randn(5, 4))

    def child(batches):  # forked: finds f and model as the parent left them, not pickled
        faulthandler.dump_traceback_later(100, exit=True)  # a hang says where it stood
        torch.set_num_threads(threads)
        with torch.no_grad():
            for batch in batches:
                x = torch.randn(batch, 4)
                torch.testing.assert_close(f(x), model(x))
        return [c.hits for c in f.captures]

    with multiprocessing.get_context("fork").Pool(1) as pool:
        print(sum(pool.apply(child, ([5, 7, 7, 9, 5],))), flush=True)
""")


@pytest.mark.parametrize("threads", [1, 2])
def test_trap_a_forked_child_captures_and_serves(tmp_path, threads):
    """After a capture in the parent (disk cache on), a forked child's first capture waited for
    ever on the disk cache's thread pool, whose worker threads the child does not have."""
    script = tmp_path / "fork_after_capture.py"
    script.write_text(_FORK_AFTER_CAPTURE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "cache"), str(threads)],
                            capture_output=True, text=True, timeout=200, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout) >= 3, result.stdout  # the parent's graph at 5, the child's own from 7 on


def test_trap_a_forked_child_that_exits_leaves_the_parents_graphs(tmp_path):
    """A forked child ending as a normal interpreter does (a gunicorn worker's sys.exit(0))
    ran the finalizers it inherited: it removed the parent's capture folders, and the parent's
    take_graph() then failed with 'model.onnx: no such file'."""
    script = textwrap.dedent("""
        import os, sys, torch, clika_runtime as cr
        model = torch.nn.Linear(4, 3).eval()
        f = cr.compile(model)
        with torch.no_grad():
            f(torch.randn(5, 4))
        child = os.fork()
        if child == 0:  # ends as an interpreter does: atexit handlers and finalizers run
            import atexit
            atexit._run_exitfuncs()
            os._exit(0)  # (not onnxruntime's C++ exit handlers: they hang a forked child)
        os.waitpid(child, 0)
        f.take_graph().save(sys.argv[1])
        print("saved")
    """)
    env = {**os.environ, "CLIKA_RUNTIME_CACHE_DIR": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m.onnx")], capture_output=True, text=True,
                            timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0 and "saved" in result.stdout, result.stderr[-2000:]


_FORK_DURING_EXPORT = textwrap.dedent("""
    import faulthandler, os, threading, time, torch
    import clika_runtime as cr
    from torch._subclasses.fake_tensor import FakeTensor

    tracing = threading.Event()

    class Slow(torch.nn.Module):  # its trace holds the export open while the main thread forks
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x):
            if isinstance(x, FakeTensor):
                tracing.set()
                time.sleep(1.0)
            return self.fc(x)

    model = Slow().eval()
    f = cr.compile(model)
    x = torch.randn(3, 8)

    def warm_up():
        with torch.no_grad():
            f(x)

    capture = threading.Thread(target=warm_up)
    capture.start()
    assert tracing.wait(60)
    child = os.fork()
    if child == 0:
        # A stuck child ends here, saying where. Its capture sleeps in each trace: at 20 s, one full
        # run under load ended the child inside the compiled call (slow or hung: its stack did not say).
        faulthandler.dump_traceback_later(120, exit=True)
        with torch.no_grad():
            plain, served = model(x), f(x)
        ok = torch.equal(plain, model.fc(x)) and torch.allclose(served, plain, atol=1e-6)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    capture.join()
    print(os.waitstatus_to_exitcode(status))
""")


def test_trap_a_fork_while_another_thread_exports_leaves_the_child_a_working_model(tmp_path):
    """A fork while another thread exported the model (a DataLoader's workers starting while a
    background warm-up captures): the child's plain ``model(x)``, ``state_dict()`` and compiled
    calls each waited 30 s for the export's thread, which the child does not have, then raised
    (a trial). A fork now waits for the exports in progress to end; the child's compiled call
    then hung in ``platform.processor()``'s lock, held by the capture thread (now read from
    /proc/cpuinfo), or on the parent's hold of ``TARGETS`` (renewed in the child)."""
    env = {**os.environ, "CLIKA_RUNTIME_CACHE_DIR": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", _FORK_DURING_EXPORT], capture_output=True, text=True,
                            timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["0"], (result.stdout, result.stderr[-2000:])
