"""Reduced precision: the precisions a graph can serve at, and how closely a reduced-precision
graph must agree with its reference to serve.

A reduced-precision graph cannot pass the fp32 tolerance, so it is judged by its measured
agreement with the reference (eager fp32 at capture, the fp32 graph for ``ModelGraph.quantized``):
per output, the cosine similarity, the largest absolute difference, and that difference relative
to the reference's largest magnitude. Integer and bool outputs (token ids, an argmax, a mask)
must match exactly. NumPy only: shipped graphs are judged on boxes without torch.
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

FP32, INT8, FP16 = "fp32", "int8", "fp16"
PRECISIONS = (FP32, INT8, FP16)
FINITE_ONLY = frozenset({INT8})  # precisions whose graphs cannot carry a NaN or an infinity (``non_finite``)
NON_FINITE = ("holds NaN or infinity, which an int8 graph cannot carry: it quantizes each activation per call "
              "with one scale for the tensor, which a NaN escapes and an infinity makes infinite")


def checked(precision: Any) -> str:
    """``precision`` if it is one of ``PRECISIONS``; else ``ValueError`` in one line."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    return precision


def non_finite(precision: str, feeds: Sequence[Any]) -> int | None:
    """The position of the first float feed (a tensor or an array) holding NaN or an infinity,
    when a graph at ``precision`` cannot carry one; else ``None``. An int8 graph quantizes each
    activation per call with one scale for the tensor: the range it measures skips a NaN (which
    then comes out as a plausible number) and is made infinite by an inf (which makes every row
    of the batch NaN)."""
    if precision not in FINITE_ONLY:
        return None
    return next((i for i, feed in enumerate(feeds) if not math.isfinite(magnitude(feed))), None)


def magnitude(feed: Any) -> float:
    """The largest absolute value of a float tensor or array (NaN when it holds one, inf for an
    infinity; one reduction, which cannot overflow); 0.0 for anything else, or an empty one."""
    dtype = getattr(feed, "dtype", None)
    if dtype is None or not _floating(dtype):
        return 0.0
    if hasattr(feed, "isfinite"):  # a tensor (torch's max lets a NaN through)
        return float(feed.abs().amax()) if feed.numel() else 0.0
    return float(np.abs(feed).max()) if feed.size else 0.0


def _floating(dtype: Any) -> bool:
    floating = getattr(dtype, "is_floating_point", None)  # torch's dtypes say; numpy's are asked
    return floating if floating is not None else bool(np.issubdtype(dtype, np.floating))


def refusal(precision: str, device: str) -> str | None:
    """Why ``precision`` cannot serve on a ``device`` ("cpu", "cuda"), with what to use instead;
    ``None`` when it can."""
    if precision == INT8 and device != "cpu":
        return ("precision='int8' serves on CPU only: onnxruntime's CUDA provider runs dynamic int8 graphs "
                "slower than fp32; use precision='fp16' on CUDA, or place='cpu'")
    if precision == FP16 and device == "cpu":
        return ("precision='fp16' needs a CUDA place: onnxruntime's CPU provider has no fp16 kernels for most "
                "ops; use precision='int8' on CPU, or place='cuda'")
    return None


@dataclass(frozen=True)
class Agreement:
    """How closely a reduced-precision graph must agree with its reference, per output.

    Attributes:
        cosine: the least cosine similarity of each floating-point output with the reference
            (flattened); 0.999 by default. Cosine is blind to scale, so the output's norm must
            also lie within ``sqrt(2 * (1 - cosine))`` of the reference's, relatively (4.5% at 0.999).
        max_abs: if set, the largest absolute difference allowed.
        max_rel: if set, the largest absolute difference allowed relative to the reference's
            largest magnitude.
        top1: if set, the least share of rows (along the last axis) whose largest entry sits
            where the reference's does: ``1.0`` for a classifier whose every predicted class
            must stay eager's (argmax-like uses of a float output); not applied to a decoder's
            key/value cache outputs (``present.*``), whose argmax means nothing.
    Integer and bool outputs must always match exactly; NaN and infinities must sit where the
    reference has them.
    """

    cosine: float = 0.999
    max_abs: float | None = None
    max_rel: float | None = None
    top1: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.cosine, (int, float)) and -1.0 <= self.cosine <= 1.0):
            raise ValueError(f"Agreement.cosine: expected a number in [-1, 1], got {self.cosine!r}")
        for name in ("max_abs", "max_rel"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"Agreement.{name}: expected None or a number >= 0, got {value!r}")
        if self.top1 is not None and not (isinstance(self.top1, (int, float)) and 0 <= self.top1 <= 1):
            raise ValueError(f"Agreement.top1: expected None or a share in [0, 1], got {self.top1!r}")

    def __str__(self) -> str:
        bounds = [f"cosine >= {self.cosine}"]
        bounds += [f"max abs <= {self.max_abs}"] if self.max_abs is not None else []
        bounds += [f"rel <= {self.max_rel}"] if self.max_rel is not None else []
        bounds += [f"top-1 >= {self.top1}"] if self.top1 is not None else []
        return ", ".join(bounds)

    def problem(self, measured: "Measured") -> str | None:
        """Why ``measured`` falls short of this agreement, in words (``None`` when it does not)."""
        if measured.exact is not None:
            how_many = f"{measured.differing:,} of {measured.size:,} values" if measured.size else "values"
            return None if measured.exact else \
                f"output '{measured.name}': {how_many} differ (integer and bool outputs must match exactly)"
        if measured.misplaced:
            return f"output '{measured.name}': NaN or infinity where the reference has none, or the reverse"
        short = []
        if measured.cosine < self.cosine:
            short.append(f"cosine {measured.cosine:.5f} < {self.cosine}")
        # Cosine is blind to scale: the norms must agree as closely as that cosine allows a
        # difference of equal-norm vectors to be (relative error sqrt(2 * (1 - cosine))).
        allowed = math.sqrt(2 * (1 - self.cosine))
        if abs(measured.norm - 1) > allowed:
            short.append(f"norm {measured.norm:.4g}x the reference's (cosine {self.cosine} allows "
                         f"{1 - allowed:.3g}x to {1 + allowed:.3g}x)")
        if self.max_abs is not None and measured.max_abs > self.max_abs:
            short.append(f"max abs difference {measured.max_abs:.3g} > {self.max_abs}")
        if self.max_rel is not None and measured.max_rel > self.max_rel:
            short.append(f"relative difference {measured.max_rel:.3g} > {self.max_rel}")
        if self.top1 is not None and measured.top1 < self.top1:
            short.append(f"top-1 agreement {measured.top1:.4f} < {self.top1}")
        return f"output '{measured.name}': {', '.join(short)}" if short else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> "Agreement":
        if not isinstance(value, Mapping) or set(value) - {"cosine", "max_abs", "max_rel", "top1"}:
            raise ValueError(f"expected an object with cosine, max_abs, max_rel, top1, got {str(value)[:80]}")
        return cls(**value)


@dataclass(frozen=True)
class Measured:
    """One output's agreement with its reference. ``exact`` is set for integer and bool outputs
    (whether they match); ``misplaced``: NaN or infinities where the reference has none;
    ``top1``: the share of rows whose largest entry sits where the reference's does; ``norm``:
    the output's norm over the reference's (cosine alone is blind to scale)."""

    name: str
    cosine: float = 1.0
    max_abs: float = 0.0
    max_rel: float = 0.0
    exact: bool | None = None
    misplaced: bool = False
    top1: float = 1.0
    norm: float = 1.0  # the output's norm over the reference's
    differing: int | None = None  # an integer or bool output that differs: how many of its ``size`` values do
    size: int | None = None

    def __str__(self) -> str:
        if self.exact is not None:
            return f"'{self.name}' {'exact' if self.exact else 'differs'}"
        return (f"'{self.name}' cosine {self.cosine:.5f}, max abs {self.max_abs:.3g}, rel {self.max_rel:.3g}"
                + (f", top-1 {self.top1:.4f}" if self.top1 < 1.0 else ""))

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


# A decoder's key/value cache outputs (docs/DECODERS.md's names): their last axis is a head's
# channels, not classes, so their argmax says nothing and top-1 is not measured for them.
CACHE_OUTPUTS = "present."


def measure(name: str, reference: Any, got: Any) -> Measured:
    """How closely ``got`` agrees with ``reference`` (arrays or numbers of one shape)."""
    ref, out = np.asarray(reference), np.asarray(got)
    if ref.shape != out.shape:
        raise ValueError(f"output '{name}': shape {out.shape}, reference {ref.shape}")
    if not np.issubdtype(ref.dtype, np.floating) and not np.issubdtype(ref.dtype, np.complexfloating):
        differing = int(np.count_nonzero(ref != out))
        return Measured(name, exact=not differing, differing=differing or None,
                        size=int(ref.size) if differing else None)
    top1 = 1.0 if name.startswith(CACHE_OUTPUTS) else _top1(ref, out)
    ref, out = ref.astype(np.float64).reshape(-1), out.astype(np.float64).reshape(-1)
    finite = np.isfinite(ref)
    misplaced = not np.array_equal(finite, np.isfinite(out)) or not np.array_equal(ref[~finite], out[~finite], equal_nan=True)
    ref, out = ref[finite], out[finite]
    if ref.size == 0:
        return Measured(name, misplaced=misplaced)
    difference = float(np.abs(out - ref).max())
    scale = float(np.abs(ref).max())
    return Measured(name, _cosine(ref, out), difference, difference / scale if scale else difference,
                    misplaced=misplaced, top1=top1, norm=_norm_ratio(ref, out))


def _norm_ratio(reference: np.ndarray, got: np.ndarray) -> float:
    norm = float(np.linalg.norm(reference))
    if norm == 0.0:  # an all-zero reference: agreement means zeros (the cosine says so too)
        return 1.0 if not got.any() else math.inf
    return float(np.linalg.norm(got)) / norm


def _top1(reference: np.ndarray, got: np.ndarray) -> float:
    """The share of rows (along the last axis) whose largest entry is where the reference's is."""
    if reference.ndim == 0 or reference.size == 0:
        return 1.0
    return float(np.mean(np.argmax(reference, axis=-1) == np.argmax(got, axis=-1)))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a)) * float(np.linalg.norm(b))
    if norms == 0.0:  # an all-zero side: agreement means both are zero
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(np.clip(a @ b / norms, -1.0, 1.0))


def row_error(reference: np.ndarray, got: np.ndarray) -> float:
    """The error nine rows (along the last axis) of ``got`` in ten stay within, each relative to
    the reference row's norm, or to the median row's where the row is smaller (a near-zero
    prediction is judged by the scale of the others, not by its own sign). A whole tensor's
    cosine hides the rows one loud row ruins under one int8 scale per tensor (every quieter row);
    this does not. Nine in ten, not all: the largest of a thousand rows' errors is several times
    the typical one even where nothing is wrong."""
    if reference.size == 0:
        return 0.0
    width = reference.shape[-1] if reference.ndim else 1
    a, b = reference.reshape(-1, width).astype(np.float64), got.reshape(-1, width).astype(np.float64)
    norms = np.linalg.norm(a, axis=1)
    scale = np.maximum(norms, np.median(norms))
    errors = np.linalg.norm(b - a, axis=1)
    relative = np.where(scale > 0, errors / np.where(scale > 0, scale, 1.0), np.where(errors > 0, np.inf, 0.0))
    return float(np.quantile(relative, 0.9))


def row_error_allowed(cosine: float) -> float:
    """The row error (``row_error``) a cosine of ``cosine`` allows between vectors of
    equal norm: sqrt(2 * (1 - cosine)), 0.045 at 0.999."""
    return math.sqrt(2.0 * (1.0 - cosine))


def rows_problem(agreement: Agreement, name: str, reference: Any, got: Any) -> str | None:
    """Why a float output's rows fall short of ``agreement`` (``row_error`` against what its cosine
    allows), in words; ``None`` when they do not, or the output is not floating point."""
    reference, got = np.asarray(reference), np.asarray(got)
    if not np.issubdtype(reference.dtype, np.floating):
        return None
    allowed, error = row_error_allowed(agreement.cosine), row_error(reference, got)
    if error > allowed:
        return (f"output '{name}': rows' errors up to {error:.4g} of their norms (nine in ten) > {allowed:.4g}, "
                f"what cosine {agreement.cosine} allows")
    return None


def shortfall(agreement: Agreement, name: str, reference: Any, got: Any) -> str | None:
    """Why one output falls short of ``agreement``, judged as a capture is: whole, then by rows."""
    return agreement.problem(measure(name, reference, got)) or rows_problem(agreement, name, reference, got)


def judged(agreement: Agreement, names: Sequence[str], reference: Sequence[Any], got: Sequence[Any]) -> tuple[list[Measured], str | None]:
    """Each output measured, and the first shortfall in words (``None``: the graph agrees)."""
    measured = [measure(n, r, g) for n, r, g in zip(names, reference, got)]
    return measured, next((p for m in measured if (p := agreement.problem(m)) is not None), None)


@dataclass(frozen=True)
class Record:
    """What a reduced-precision graph carries (``f.captures``, ``inspect``, the shipped metadata):
    its precision, the agreement it was accepted by, and each output's measured agreement."""

    precision: str
    agreement: Agreement
    measured: tuple[Measured, ...]

    def __str__(self) -> str:
        return f"{self.precision}, agreement with fp32 (accepted at {self.agreement}): {'; '.join(map(str, self.measured))}"

    def problems(self) -> list[str]:
        """Where the measured figures fall short of the agreement they were accepted at (a record
        edited by hand, or made by another tool): empty for a record any capture writes."""
        return [problem for m in self.measured if (problem := self.agreement.problem(m)) is not None]

    def to_json(self) -> dict[str, Any]:
        return {"precision": self.precision, "agreement": self.agreement.to_json(),
                "measured": [m.to_json() for m in self.measured]}

    @classmethod
    def from_json(cls, value: Any) -> "Record":
        """The record of a graph file's metadata; ``ValueError`` saying what is malformed."""
        if not isinstance(value, Mapping) or set(value) != {"precision", "agreement", "measured"}:
            raise ValueError("precision: expected an object with precision, agreement and measured")
        if value["precision"] not in PRECISIONS or not isinstance(value["measured"], list):
            raise ValueError(f"precision: expected one of {PRECISIONS} and a list of measured outputs")
        measured = []
        for entry in value["measured"]:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) or \
                    set(entry) - {"name", "cosine", "max_abs", "max_rel", "exact", "misplaced", "top1", "norm",
                                  "differing", "size"} or \
                    not all(isinstance(v, (int, float)) for k, v in entry.items() if k != "name"):
                raise ValueError(f"precision: malformed measured output {str(entry)[:80]}")
            measured.append(Measured(**entry))
        return cls(value["precision"], Agreement.from_json(value["agreement"]), tuple(measured))
