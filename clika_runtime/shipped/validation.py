"""Check a shipped graph the way CI should: checker, shape inference, onnxruntime at several sizes.

numpy only at run time (torch is not needed): this is what ``clika-runtime validate`` runs.
"""

from __future__ import annotations

import itertools
import logging
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

import serving
from clika_runtime.base.errors import GraphFileError, GraphInputError, PlaceError, first_line
from clika_runtime.base.precision import Record, shortfall
from clika_runtime.format import digest, graphfile
from clika_runtime.format.graphfile import existing
from clika_runtime.guards.guard import Guard
from clika_runtime.shipped.inspection import what_to_pass
from clika_runtime.shipped.served import metadata_and_guard, read_session
from clika_runtime.triton.checker import check_repository, latest_model, read_config
from clika_runtime.triton.rules import CONFIG_FILE
from serving import DTYPE_NAMES as ONNX_TYPE_NAMES

logger = logging.getLogger("clika_runtime")

# Inputs are generated up to this many elements each: a graph that declares a static size of
# 10**12 (or a capture example that large) gets a failed check, not an allocation that never ends.
MAX_GENERATED_ELEMENTS = 2**26
SAFE_TO_OPEN = "readable, reads only files in its folder"  # the first check: graphfile.check
DIGEST = "content digest"  # the second: digest.verify


@dataclass
class Check:
    """One row of the report."""

    name: str
    passed: bool
    detail: str = ""


@dataclass
class Report:
    """Every check run on a graph; ``passed`` only when all passed."""

    path: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every check passed (and at least one ran)."""
        return bool(self.checks) and all(c.passed for c in self.checks)

    def add(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, passed, detail))
        return passed

    def table(self) -> str:
        """A fixed-width table, one check per line, and a closing line that counts them."""
        width = max([len(c.name) for c in self.checks] + [5])
        lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
        lines += [f"{c.name:<{width}}  {'ok' if c.passed else 'FAIL':<6}  {c.detail}" for c in self.checks]
        failed = sum(not c.passed for c in self.checks)
        lines.append(f"{self.path}: {len(self.checks) - failed} passed, {failed} failed")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"path": self.path, "passed": self.passed, "checks": [c.__dict__ for c in self.checks]}



def validate_graph(
    path: str | os.PathLike,
    *,
    reference: str | os.PathLike | None = None,
    dims: Mapping[str, Sequence[int]] | None = None,
    place: Any = "cpu",
    rtol: float = 1e-4,
    atol: float = 1e-5,
    seed: int = 0,
    verify_digest: bool = True,
) -> Report:
    """Validate a graph file; see the module docstring. Never raises for a bad graph: it reports.

    ``path`` may also be a Triton model folder (one holding config.pbtxt): it is checked with
    ``clika_runtime.triton.checker.check_repository``, then the model file of its highest version is
    validated. ``dims`` gives sizes per dynamic dim name (default 1, 3, 8 each); an unknown name is
    an error (``ValueError`` listing the graph's dim names). ``reference`` is an ``.npz`` with arrays
    named after graph inputs and outputs: the graph is run on those inputs and compared with those outputs.
    ``verify_digest``: check the content digest the file records (a file without one passes, with
    a note in the row); False leaves the row out.
    """
    report = Report(str(path))
    path = existing(path, folders=True)
    if path.is_dir() and not (path / CONFIG_FILE).is_file():
        raise GraphFileError(f"{path}: a folder without config.pbtxt: {what_to_pass(path, takes_model_folder=True)}")
    arrays = _read_reference(reference) if reference is not None else None  # unusable input before any check
    if path.is_dir():
        path = _check_triton_folder(path, report)
        if path is None:
            return report
    checked = _opens_safely(path, report)
    if checked is None or (verify_digest and not _digest_matches(path, checked, report)):
        return report
    session = _checked_session(path, place, report)
    if session is None:
        return report
    try:
        found, guard = metadata_and_guard(read_session(session, str(path)), str(path))
        report.add("clika_runtime metadata", True)
    except GraphFileError as e:
        report.add("clika_runtime metadata", False, first_line(e))
        return report
    record = found.precision if found is not None else None
    if record is not None:
        short = record.problems()  # figures its own acceptance refuses: not a record a capture writes
        report.add(f"{record.precision} agreement recorded", not short, "; ".join(short) or str(record))
    _run_sizes(session, guard, str(path), dims or {}, np.random.default_rng(seed), report)
    if arrays is not None:
        report.add("matches reference outputs", *_compare_reference(session, arrays, str(reference), rtol, atol, record))
    return report


def _opens_safely(path: Path, report: Report) -> graphfile.Checked | None:
    """Report whether the file reads only files in its folder and runs no code (before anything
    opens it: the checker and onnxruntime would read its external data). A file that is no graph
    at all is unusable input, as a missing one is: ``GraphFileError``, not a failed check."""
    try:
        checked = graphfile.check(path)
    except GraphFileError as e:
        if not _is_protobuf(path):
            raise
        _refuse_missing_data(path)
        report.add(SAFE_TO_OPEN, False, first_line(e))
        return None
    report.add(SAFE_TO_OPEN, True)
    return checked


def _digest_matches(path: Path, checked: graphfile.Checked, report: Report) -> bool:
    """Report whether the file's content is what its digest records; a file without one passes,
    with a note (graphs saved before digests, other tools' graphs)."""
    try:
        found = digest.verify(checked.data, path.absolute().parent, str(path))
    except GraphFileError as e:
        return report.add(DIGEST, False, first_line(e).removeprefix(f"{path}: "))
    if found.recorded is None:
        return report.add(DIGEST, True, "none recorded (saved before clika_runtime wrote digests, or by another "
                                        "tool): content not checked")
    shown = f"{digest.ALGORITHM} {found.computed.overall[:16]}..."
    return report.add(DIGEST, True, f"{shown} (graph + {len(found.computed.tensors)} tensors)")


def _refuse_missing_data(path: Path) -> None:
    """``GraphFileError`` naming the external data files missing from the graph's folder when they
    are all that keeps it from opening: a missing file is unusable input (exit 2), as a missing
    graph file is; a location reaching out of the folder, or a code node, stays a failed row."""
    contents = graphfile.scan(memoryview(graphfile.read_bytes(path)), str(path))
    folder = path.absolute().parent
    problems = {r.location: why for r in contents.references if (why := graphfile.outside(folder, r.location))}
    # outside()'s words for a location inside the folder where nothing is
    missing = sorted(location for location, why in problems.items() if why.startswith("names no file"))
    if not missing or len(missing) < len(problems) or contents.code_nodes:
        return
    files = ", ".join(map(repr, missing))
    raise GraphFileError(f"{path}: its external data file{'s' if len(missing) > 1 else ''} {files} "
                         f"{'are' if len(missing) > 1 else 'is'} missing from {path.parent}: copy "
                         f"{'them' if len(missing) > 1 else 'it'} beside the graph file")


def _is_protobuf(path: Path) -> bool:
    """The file parses as a serialised model (asked only after ``graphfile.check`` refused it, to
    tell a graph reaching outside its folder from bytes that are no graph)."""
    try:  # read, not mapped, as graphfile.check reads it: a map faults when the file is truncated under it
        graphfile.scan(memoryview(graphfile.read_bytes(path)), str(path))
    except GraphFileError:
        return False
    return True



def _checked_session(path: Path, place: Any, report: Report) -> Any:
    """The full checker, strict shape inference and an onnxruntime session, each reported; the
    session, or ``None`` when the graph is too broken to run."""
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
        report.add("onnx checker (full)", True)
    except Exception as e:  # the checker raises several types; all mean the same: invalid graph
        report.add("onnx checker (full)", False, first_line(e))
        return None
    try:
        model = onnx.load_model(str(path))
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
        report.add("strict shape inference", True)
    except Exception as e:
        report.add("strict shape inference", False, first_line(e))
    try:
        session = serving.open_session(str(path), serving.resolve(place))
    except ValueError as e:
        raise PlaceError(str(e)) from e
    except Exception as e:
        report.add(f"loads in onnxruntime on {place}", False, first_line(e))
        return None
    report.add(f"loads in onnxruntime on {place}", True, ", ".join(session.get_providers()))
    return session


def _run_sizes(session: Any, guard: Guard, where: str, dims: Mapping[str, Sequence[int]],
               rng: np.random.Generator, report: Report) -> None:
    """Run the graph at sizes of each dynamic dim, from the capture's example (all its sizes
    together), one dim at a time: ``dims`` where given, else sizes around the example. A
    combination the guard refuses is skipped and logged; a size given in ``dims`` fails when no
    combination with it could run, and a pass must have run the graph at least once."""
    graph_dims = _dim_names(session)
    unknown = sorted(set(dims) - set(graph_dims))
    if unknown:
        raise ValueError(f"--dims: unknown dim name(s) {unknown}; this graph's dynamic dims are {sorted(graph_dims)}")
    sizes = {name: _default_sizes(guard, name) for name in graph_dims}
    sizes.update({k: list(v) for k, v in dims.items()})
    example = dict(guard.example)  # the capture's sizes together: a decoder's total == past + 1 holds there
    base = {k: v[0] if k in dims or k not in example else example[k] for k, v in sizes.items()}
    refused, ran = [], set()
    for assignment in _assignments(sizes, base):
        label = ", ".join(f"{k}={v}" for k, v in assignment.items()) or "static shapes"
        feeds = generated_feeds(session, guard, assignment, rng)
        generated = all(v is not None for v in feeds.values())  # else _run_once reports what was not
        problem = guard.check([feeds[i.name] for i in session.get_inputs()]) if generated else None
        if problem is not None:
            refused.append((assignment, f"{label} ({problem})"))  # a combination the guard rules out: not run
        else:
            report.add(f"runs at {label}", *_run_once(session, feeds, assignment))
            ran.update(assignment.items())
    for name, values in dims.items():  # a size asked for fails when no combination with it could run
        for value in values:
            if (name, value) not in ran:
                report.add(f"runs at {name}={value}", False, "outside the graph's guard with every other size tried: "
                           + "; ".join(text for tried, text in refused if tried.get(name) == value))
    said = "; ".join(text for _, text in refused)
    if refused:
        logger.info("validate %s: sizes outside the graph's guard, not run: %s", where, said)
    if not any(c.name.startswith("runs at ") for c in report.checks):  # a pass must have run the graph
        report.add("runs at some size", False, f"every size tried is outside the graph's guard: {said}")


def _check_triton_folder(folder: Path, report: Report) -> Path | None:
    """Report what Triton would refuse in the folder; return its highest version's model file."""
    problems = check_repository(folder)
    for problem in problems:
        report.add("triton model folder", False, problem)
    try:
        filename = read_config(folder / CONFIG_FILE).model_filename
    except (OSError, ValueError):
        return None  # reported above
    version, model = latest_model(folder, filename)
    if not problems:
        report.add("triton model folder", True, f"config.pbtxt agrees with version {version}: {model}")
    return model


def _guard(session: Any, where: str) -> Guard:
    """The graph's shipped guard (checked to describe the graph), or one read from its declared
    input shapes; ``GraphFileError`` for metadata that is malformed or describes another graph."""
    declared = read_session(session, where)  # names decoded once here: later reads of them succeed
    return metadata_and_guard(declared, where)[1]


def _default_sizes(guard: Guard, dim: str) -> list[int]:
    """Sizes to run a dim at: the capture's example and sizes around it, inside the dim's range
    (1, 3, 8 when the graph says nothing)."""
    lo, hi = guard.bounds(dim)
    example = dict(guard.example).get(dim)
    if example is None:
        candidates = [max(lo, 1), max(lo, 3), max(lo, 8)]
    else:
        candidates = [example, example + 1, example * 2, max(lo, 1)]
    sizes = sorted({c for c in candidates if hi is None or c <= hi})
    return sizes or [lo]


def _dim_names(session: Any) -> list[str]:
    names: list[str] = []
    for value in session.get_inputs():
        for d in value.shape:
            if isinstance(d, str) and d not in names:
                names.append(d)
    return names


def _assignments(sizes: Mapping[str, Sequence[int]], base: Mapping[str, int]) -> list[dict[str, int]]:
    """``base``, then each dim through its sizes with the others at ``base``, then all at their last."""
    if not sizes:
        return [{}]
    runs = [dict(base)]
    for name, values in sizes.items():
        for v in values:
            runs.append({**base, name: v})
    runs.append({k: v[-1] for k, v in sizes.items()})
    unique = []
    for run in runs:
        if run not in unique:
            unique.append(run)
    return unique


def generated_feeds(session: Any, guard: Guard, assignment: Mapping[str, int], rng: np.random.Generator) -> dict[str, Any]:
    """Generated inputs at these dim sizes: random floats, small non-negative ints (valid indices
    for embeddings and gathers alike), lifted numbers at their capture value."""
    example = dict(guard.example)
    feeds = {}
    for value in session.get_inputs():
        name = ONNX_TYPE_NAMES.get(value.type)
        dtype = np.dtype(name).type if name and name != "bfloat16" and not name.startswith("complex") else None
        shape = [assignment.get(d, 1) if isinstance(d, str) or d is None else d for d in value.shape or ()]
        if dtype is None or min(shape, default=0) < 0 or np.prod(shape, dtype=object) > MAX_GENERATED_ELEMENTS:
            feeds[value.name] = None
            continue
        if not shape and f"#{value.name}" in example:
            feeds[value.name] = np.asarray(example[f"#{value.name}"], dtype=dtype)
        elif np.issubdtype(dtype, np.floating):
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype is np.bool_:
            feeds[value.name] = rng.random(shape) > 0.5
        else:
            feeds[value.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def _run_once(session: Any, feeds: Mapping[str, Any], assignment: Mapping[str, int]) -> tuple[bool, str]:
    missing = [name for name, value in feeds.items() if value is None]
    if missing:
        return False, (f"input(s) {missing}: a type that cannot be generated, or more than "
                       f"{MAX_GENERATED_ELEMENTS:,} elements")
    try:
        outs = session.run(None, dict(feeds))
    except Exception as e:
        return False, first_line(e)
    problems = []
    for meta, out in zip(session.get_outputs(), outs):
        if np.ndim(out) != len(meta.shape or ()):
            problems.append(f"output '{meta.name}': rank {np.ndim(out)}, graph declares {len(meta.shape or ())}")
            continue
        for axis, d in enumerate(meta.shape or ()):
            if isinstance(d, int) and np.shape(out)[axis] != d:
                problems.append(f"output '{meta.name}' axis {axis}: {np.shape(out)[axis]}, graph declares {d}")
            if isinstance(d, str) and d in assignment and np.shape(out)[axis] != assignment[d]:
                problems.append(f"output '{meta.name}' axis {axis} ({d}): {np.shape(out)[axis]}, expected {assignment[d]}")
        if np.issubdtype(np.asarray(out).dtype, np.floating) and not np.isfinite(out).all():
            problems.append(f"output '{meta.name}' has non-finite values")
    shapes = ", ".join(f"{m.name}{list(np.shape(o))}" for m, o in zip(session.get_outputs(), outs))
    return (not problems), "; ".join(problems) or shapes


def _read_reference(reference: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of a ``--reference`` file, by name; ``GraphInputError`` naming the file and what
    it holds instead of an ``.npz`` of numeric arrays (pickled objects are never loaded)."""
    expected = "expected an .npz of arrays (numpy.savez)"
    path = Path(reference)
    if not path.is_file():
        raise GraphInputError(f"--reference {reference}: {'a folder, ' + expected if path.is_dir() else 'no such file'}")
    try:
        loaded = np.load(path)
        if isinstance(loaded, np.ndarray):  # an .npy holds one array, with no name to match
            arrays = None
        else:
            with loaded:
                arrays = {name: loaded[name] for name in loaded.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:  # numpy's own words are about pickles
        raise GraphInputError(f"--reference {reference}: {expected}, got {_kind_of_file(path, e)}") from None
    if arrays is None:
        raise GraphInputError(f"--reference {reference}: {expected}, got one unnamed array (an .npy): save the "
                              f"inputs and outputs by name with numpy.savez")
    return arrays


def _kind_of_file(path: Path, error: BaseException) -> str:
    """What a file that is not an .npz looks like, in a few words."""
    with path.open("rb") as handle:
        head = handle.read(512)
    if head.startswith(b"PK"):
        return f"a zip that numpy cannot read as arrays ({first_line(error)})"
    if not head:
        return "an empty file"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return "a file of another format"
    return "a text file"


def _compare_reference(session: Any, data: Mapping[str, np.ndarray], reference: str, rtol: float,
                       atol: float, record: Record | None) -> tuple[bool, str]:
    """The graph's outputs on the reference inputs against the reference outputs: within rtol/atol,
    or for a reduced-precision graph (``record``) by the agreement it was accepted with, judged as a
    capture is: each whole output, then its rows (one loud row must not hide the others' errors)."""
    inputs = [i.name for i in session.get_inputs()]
    # Arrays that do not fit the graph make the reference unusable, not the graph wrong.
    missing = [n for n in inputs if n not in data]
    if missing:
        raise GraphInputError(f"--reference {reference}: lacks input(s) {missing}; it holds {sorted(data)}")
    problem = _guard(session, str(reference)).check([data[n] for n in inputs])
    if problem is not None:
        raise GraphInputError(f"--reference {reference}: {problem}")
    try:
        outs = session.run(None, {n: data[n] for n in inputs})
    except Exception as e:  # onnxruntime's types
        return False, f"the graph does not run on the reference inputs: {first_line(e)}"
    compared = []
    for meta, out in zip(session.get_outputs(), outs):
        if meta.name not in data:
            continue
        expected = data[meta.name]
        if expected.shape != np.shape(out):
            return False, f"output '{meta.name}': shape {list(np.shape(out))}, reference {list(expected.shape)}"
        if record is not None:
            short = shortfall(record.agreement, meta.name, expected, out)
            if short:
                return False, f"{short} (by the {record.precision} graph's recorded agreement, not rtol/atol)"
        elif not np.allclose(out, expected, rtol=rtol, atol=atol, equal_nan=True):
            worst = float(np.nanmax(np.abs(out.astype(np.float64) - expected.astype(np.float64))))
            return False, f"output '{meta.name}': max |diff| {worst:.3g} > rtol={rtol}, atol={atol}"
        compared.append(meta.name)
    if not compared:
        return False, f"reference holds none of the outputs {[o.name for o in session.get_outputs()]}"
    if record is not None:
        return True, f"compared {compared} by the {record.precision} graph's recorded agreement ({record.agreement})"
    return True, f"compared {compared}"



def save_reference(path: str | os.PathLike, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
    """Write an ``.npz`` reference (arrays named after graph inputs and outputs) for ``validate``."""
    arrays = {k: np.asarray(v) for k, v in itertools.chain(inputs.items(), outputs.items())}
    np.savez(path, **arrays)
