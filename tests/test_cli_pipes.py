"""The command in a pipeline whose reader stops early (`clika-runtime cache list | head -1`):
a quiet stop, as a tool killed by SIGPIPE, not a BrokenPipeError traceback. Real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _closed_early(args: list[str], tmp_path: Path, read_lines: int) -> tuple[int, str, list[str]]:
    """Run the command into a pipe whose reader reads ``read_lines`` lines then closes it."""
    env = dict(os.environ, CLIKA_RUNTIME_CACHE_DIR=str(tmp_path / "cache"))
    process = subprocess.Popen([sys.executable, "-m", "clika_runtime", *args], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = [process.stdout.readline().decode() for _ in range(read_lines)]
    process.stdout.close()  # the reader is gone: the next write gets EPIPE
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("the command did not exit after its reader closed the pipe")
    return process.returncode, stderr.decode(), lines


@pytest.mark.parametrize("action", ["info", "list"])
def test_cache_into_a_reader_that_closes_before_anything_is_written(tmp_path, action):
    (tmp_path / "cache").mkdir()  # an empty cache (of a folder that does not exist, both print a line)
    code, stderr, _ = _closed_early(["cache", action, "--dir", str(tmp_path / "cache")], tmp_path, read_lines=0)
    # `list` of an empty cache writes nothing, so no pipe breaks: it exits 0.
    assert (code, stderr) == ((141, "") if action == "info" else (0, ""))


def test_a_long_output_into_head_1_stops_quietly(tmp_path):
    """More lines than a pipe holds (64 KiB), the reader taking one: as `... | head -1`."""
    script = ("import sys\nfrom clika_runtime import cli\n"
              "cli._parser = (lambda make: lambda: _long(make()))(cli._parser)\n"
              "def _long(parser):\n"
              "    sub = parser._subparsers._group_actions[0]\n"
              "    sub.choices['cache'].set_defaults(run=lambda a: [print('x' * 79) for _ in range(10000)] and 0)\n"
              "    return parser\n"
              "sys.exit(cli.main(['cache', 'list']))\n")
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = process.stdout.readline()
    process.stdout.close()
    _, stderr = process.communicate(timeout=120)
    assert first == b"x" * 79 + b"\n"
    assert process.returncode == 141 and b"Traceback" not in stderr and b"BrokenPipe" not in stderr, stderr
