"""Process-wide limits. Change them by assignment: ``clika_runtime.config.cache_size = 16``."""

from __future__ import annotations

import difflib
import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from clika_runtime.base.precision import Agreement

AUTO = "auto"


def _default_tolerances() -> dict[str, tuple[float, float]]:
    # (rtol, atol) by dtype name. Graph and eager kernels differ in summation order and fusion,
    # so low-precision types get looser bounds; integer and bool outputs must match exactly.
    return {
        "float64": (1e-10, 1e-12),  # tight: a float32 constant in a float64 graph is a 1e-8 error
        "float32": (1e-4, 1e-5),
        "float16": (1e-2, 1e-3),
        "bfloat16": (5e-2, 1e-2),
    }


@dataclass
class Config:
    """The few process-wide limits of clika_runtime.

    Attributes:
        cache_size: captures kept per compiled function (least recently used dropped past it).
        recapture_limit: re-captures allowed before the function serves eagerly until ``reset()``.
        tolerances: ``{dtype name: (rtol, atol)}`` used when a new graph is verified against eager
            (each output's ``atol`` times its largest finite magnitude, where that is above 1, up to 16).
        agreement: how closely a reduced-precision graph (``precision="int8"``/``"fp16"``) must
            agree with eager fp32 to serve, for functions compiled without ``agreement=``
            (``Agreement()``: cosine >= 0.999 per float output, integer outputs exact).
        intra_op_threads: onnxruntime's intra-op threads for new sessions; ``None`` follows
            ``torch.get_num_threads()`` (or onnxruntime's default where torch is absent).
        cache_dir: the on-disk capture cache, shared by processes: ``"auto"`` (the default) is
            ``$CLIKA_RUNTIME_CACHE_DIR`` when set, else the user cache directory
            (``~/.cache/clika_runtime``); a path; ``None`` turns the cache off.
        cache_max_bytes: the cache's size bound; the least recently used entries go first.
        progress: a capture that takes longer than two seconds shows one progress line on
            stderr (what it is doing, how long it has taken): ``"auto"`` (the default) when
            stderr is a terminal or a notebook runs, ``True`` always, ``False`` never (the
            ``clika_runtime`` logger says the same at INFO either way).
    """

    cache_size: int = 8
    recapture_limit: int = 8
    intra_op_threads: int | None = None
    tolerances: dict[str, tuple[float, float]] = field(default_factory=_default_tolerances)
    agreement: Agreement = field(default_factory=Agreement)
    cache_dir: str | os.PathLike | None = AUTO
    cache_max_bytes: int = 4 * 2**30
    progress: bool | str = AUTO

    def __setattr__(self, name: str, value: object) -> None:
        # A value of the wrong kind is refused where it is set: taken, it failed every capture
        # later with an error that named neither the setting nor the value.
        if name not in _CHECKS:  # a misspelt setting, taken, changed nothing (cache_dri = None)
            close = difflib.get_close_matches(name, _CHECKS, n=1)
            hint = f": did you mean {close[0]!r}?" if close else f"; the settings are {', '.join(_CHECKS)}"
            raise AttributeError(f"clika_runtime.config has no setting {name!r}{hint}")
        check = _CHECKS[name]
        if not check[0](value):
            error = TypeError if not isinstance(value, check[2]) else ValueError
            raise error(f"clika_runtime.config.{name}: expected {check[1]}, got {value!r}")
        super().__setattr__(name, value)

    def shows_progress(self) -> bool:
        """Whether long captures show their progress line on stderr now."""
        if self.progress != AUTO:
            return bool(self.progress)
        stderr = sys.stderr
        return "ipykernel" in sys.modules or bool(stderr is not None and getattr(stderr, "isatty", lambda: False)())

    def session_threads(self) -> int | None:
        """onnxruntime's intra-op threads now: ``intra_op_threads``, else torch's count where torch
        is loaded, else ``None`` (onnxruntime's default)."""
        torch = sys.modules.get("torch")
        return self.intra_op_threads or (torch.get_num_threads() if torch is not None else None)

    def cache_path(self) -> Path | None:
        """The cache directory ``cache_dir`` means now (read when a cache is needed, not at import)."""
        if self.cache_dir is None:
            return None
        if self.cache_dir != AUTO:
            return Path(self.cache_dir)
        chosen = os.environ.get("CLIKA_RUNTIME_CACHE_DIR")
        if chosen is not None:
            return Path(chosen) if chosen.strip() else None
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "clika_runtime"

    def tolerance(self, dtype_name: str) -> tuple[float, float]:
        """``(rtol, atol)`` for a dtype name; exact (0, 0) for integer and bool types."""
        return self.tolerances.get(dtype_name, (0.0, 0.0))


def _count(least: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= least


def _bound(value: object) -> bool:  # a count that may be unbounded (math.inf) or a float (2e9)
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0


def _tolerances(value: object) -> bool:
    def pair(p: object) -> bool:  # finite: an infinite tolerance would turn verification off
        return isinstance(p, (tuple, list)) and len(p) == 2 and all(_bound(t) and math.isfinite(t) for t in p)

    return isinstance(value, dict) and all(isinstance(k, str) and pair(p) for k, p in value.items())


# setting: (whether a value is right, what is expected in words, the types a right value has)
_CHECKS = {
    "cache_size": (_count(1), "an int >= 1", numbers.Integral),
    "recapture_limit": (_bound, "a number >= 0 (math.inf: no limit)", numbers.Real),
    "intra_op_threads": (lambda v: v is None or _count(0)(v), "None or an int >= 0 (0, None: torch's thread count)",
                         (numbers.Integral, type(None))),
    "tolerances": (_tolerances, "a dict of dtype name -> (rtol, atol), finite", dict),
    "agreement": (lambda v: isinstance(v, Agreement), "clika_runtime.Agreement", Agreement),
    "cache_dir": (lambda v: v is None or isinstance(v, (str, os.PathLike)), "a path, 'auto' or None",
                  (str, os.PathLike, type(None))),
    "cache_max_bytes": (_bound, "a number of bytes >= 0", numbers.Real),
    "progress": (lambda v: v in (True, False) or v == AUTO, "True, False or 'auto'", (bool, int, str)),
}

config = Config()
