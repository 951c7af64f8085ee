"""A long capture shows one progress line on stderr where a person watches (a terminal, a
notebook), and nothing where output is read by a program; ``cr.config.progress`` decides."""

from __future__ import annotations

import pytest
import torch

import clika_runtime as cr
from clika_runtime.function import degrade


@pytest.fixture
def long_captures(monkeypatch):
    monkeypatch.setattr(degrade, "PROGRESS_AFTER", 0.0)  # every capture counts as long


def _capture() -> None:
    f = cr.compile(lambda x: x.relu() * 2)
    with torch.no_grad():
        f(torch.randn(3, 4))


def test_a_long_capture_says_what_it_does_and_how_long_it_took(long_captures, monkeypatch, capsys):
    monkeypatch.setattr(cr.config, "progress", True)
    _capture()
    err = capsys.readouterr().err
    assert "\rclika_runtime: capturing _capture.<locals>.<lambda>(x[3,4]) ... " in err
    assert err.rstrip().split("\r")[-1].startswith("clika_runtime: captured _capture.<locals>.<lambda>(x[3,4]) in ")
    assert "export" in err and err.endswith("\n")


@pytest.mark.parametrize("setting", [False, "auto"], ids=["off", "auto, stderr not a terminal"])
def test_no_line_where_nobody_watches_or_when_turned_off(setting, long_captures, monkeypatch, capsys):
    monkeypatch.setattr(cr.config, "progress", setting)
    _capture()
    assert "clika_runtime: captur" not in capsys.readouterr().err
