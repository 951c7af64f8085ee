"""The project's own CI graph validation: scripts/validate_graphs.py over the workload zoo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "validate_graphs.py"


@pytest.mark.slow
def test_every_zoo_graph_matches_eager_and_validates():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "zoo: all graphs valid" in result.stdout
    assert result.stdout.count("runs at") >= 15  # five graphs, each run at three sizes
