"""Hostile graph files: loading or serving one never runs code, imports a module, reads a file
outside its folder, or raises anything but a library error (docs/SECURITY.md).

Every case is one real graph (a small capture, saved) edited the way an attacker would, then
loaded and called by the real library and onnxruntime. A case passes when the call is served with
plain containers (class names in the file are not called) or refused with ``GraphFileError``,
``GraphInputError`` or ``GraphRunError`` naming what is wrong; any other exception fails it. Where
imports matter, loads run in a fresh interpreter without torch or onnx, whose ``sys.modules`` is
compared before and after, next to a module that leaves a file behind if anything imports it.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import clika_runtime as cr
from clika_runtime import GraphFileError, GraphInputError, GraphRunError
from clika_runtime.cli import main as cli
from clika_runtime.shipped.inspection import inspect_graph
from clika_runtime.shipped.validation import SAFE_TO_OPEN, validate_graph

ROOT = Path(__file__).resolve().parents[1]
LIBRARY_ERRORS = (GraphFileError, GraphInputError, GraphRunError)
X = np.ones((3, 4), np.float32)
WEIGHT = torch.arange(4.0)
LEAF = {"kind": "leaf"}
OUTPUTS = [LEAF, LEAF, {"kind": "scalar", "type": "int"}]  # the graph's three outputs, as leaves
COMMAND = "echo PWNED > pwned.txt"
EXPLOIT = {"kind": "custom", "type": "subprocess:Popen", "keys": ["args", "shell"],
           "children": [{"kind": "const", "value": COMMAND}, {"kind": "const", "value": True}]}


def affine(x: torch.Tensor, scale: float) -> dict[str, Any]:
    return {"y": x * scale + WEIGHT, "pair": (x + 1, x.shape[0])}


class Shipped(NamedTuple):
    proto: onnx.ModelProto  # as captured, weights inside
    path: Path
    metadata: dict[str, str]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Shipped:
    f = cr.compile(affine)
    f(torch.ones(3, 4), 2.0)
    f(torch.ones(5, 4), 2.0)  # axis 0 becomes dynamic
    graph = f.take_graph()
    path = graph.save(tmp_path_factory.mktemp("shipped") / "affine.onnx")
    return Shipped(graph.model_proto, path, graph.metadata)


def _with_metadata(shipped: Shipped, **changes: str | None) -> onnx.ModelProto:
    """The shipped graph with ``clika_runtime.<key>`` metadata set (``None``: removed)."""
    proto = onnx.ModelProto()
    proto.CopyFrom(shipped.proto)
    props = dict(shipped.metadata)
    for key, value in changes.items():
        if value is None:
            props.pop(f"clika_runtime.{key}")
        else:
            props[f"clika_runtime.{key}"] = value
    del proto.metadata_props[:]
    for key, value in props.items():
        proto.metadata_props.add(key=key, value=value)
    return proto


def _edited(shipped: Shipped, path: Path, **changes: str | None) -> Path:
    """``_with_metadata``, saved at ``path``."""
    onnx.save_model(_with_metadata(shipped, **changes), str(path))
    return path


def _served_or_refused(source: Path | onnx.ModelProto, *args: Any) -> Any:
    """Load (a file with ``cr.load``, a graph in memory with ``ModelGraph.serve``) and call: the
    result, checked to hold only plain containers, or the library error."""
    try:
        served = cr.load(source) if isinstance(source, Path) else cr.ModelGraph(source).serve()
        result = served(*args)
    except LIBRARY_ERRORS as e:
        return e
    assert _plain(result), result
    return result


EXPECTED = [X * 2 + WEIGHT.numpy(), X + 1]  # the shipped graph's arrays for (X, 2.0)


def _assert_said_or_served(outcome: Any) -> None:
    """A refusal is one of the library's errors with a message; anything else is plain data."""
    if isinstance(outcome, LIBRARY_ERRORS):
        assert str(outcome).strip(), type(outcome)
    else:
        assert _plain(outcome), outcome


def _arrays(value: Any) -> list[np.ndarray]:
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    if isinstance(value, (list, tuple, collections.deque)):
        return [a for v in value for a in _arrays(v)]
    return []


def _plain(value: Any) -> bool:
    if type(value) in (dict, collections.OrderedDict):
        return all(_plain(v) for v in value.values())
    if type(value) in (list, tuple, collections.deque):
        return all(_plain(v) for v in value)
    return isinstance(value, (np.ndarray, str, int, float, bool, type(None)))


# ----------------------------------------------------------------------- class names that run code


def _around(node: dict) -> dict:
    """An output tree holding ``node`` next to the graph's own outputs, so that the graph serves."""
    return {"kind": "dict", "type": "builtins:dict", "keys": ["planted", "y", "pair_0", "n"], "children": [node, *OUTPUTS]}


def _named(kind: str, type_name: str, first: Any = COMMAND) -> dict:
    """A ``kind`` node naming class ``type_name``, whose fields are ``first`` and the graph's outputs."""
    return {"kind": kind, "type": type_name, "keys": [0, 1, 2, 3], "children": [{"kind": "const", "value": first}, *OUTPUTS]}


SERVED_AS_TUPLE = ["tuple", COMMAND, "array", "array", 3]
HOSTILE_CLASSES = {  # case: (output tree, what the call gives: a result summary, or the error's regex)
    "the exploit: subprocess:Popen": (EXPLOIT, r"GraphFileError: .* the output tree takes 0 values, the graph has 3"),
    "the exploit beside the outputs": (
        _around(EXPLOIT), {"planted": {"args": COMMAND, "shell": True}, "y": "array", "pair_0": "array", "n": 3}),
    "os:system as a namedtuple": (_named("namedtuple", "os:system"), SERVED_AS_TUPLE),
    "os:system as a structsequence": (_named("structsequence", "os:system"), SERVED_AS_TUPLE),
    "os:system as a structseq": (_named("structseq", "os:system"), r"GraphFileError: .*unknown kind 'structseq'"),
    "builtins:eval": (_named("namedtuple", "builtins:eval", "__import__('os').system('echo PWNED > pwned.txt')"),
                      ["tuple", "__import__('os').system('echo PWNED > pwned.txt')", "array", "array", 3]),
    "a class of a module not imported": (_named("namedtuple", "clika_probe:Probe"), SERVED_AS_TUPLE),
    "importlib:import_module of that module": (
        _named("custom", "importlib:import_module", "clika_probe"),
        {"0": "clika_probe", "1": "array", "2": "array", "3": 3}),
}

_FRESH = textwrap.dedent("""
    import json, sys
    for name in ("torch", "onnx", "optree"):
        sys.modules[name] = None  # a deployment box: these cannot be imported, and nothing may need them
    import numpy as np
    import clika_runtime as cr

    cases, benign = json.loads(sys.argv[1]), sys.argv[2]
    x = np.ones((3, 4), np.float32)
    cr.load(benign)(x, 2.0)  # what loading and serving import on first use is imported now
    before = set(sys.modules)

    def summary(value):
        if isinstance(value, np.ndarray):
            return "array"
        if type(value) is dict:
            return {str(k): summary(v) for k, v in value.items()}
        if type(value) in (list, tuple):
            return [type(value).__name__] + [summary(v) for v in value]
        if value is None or type(value) in (bool, int, float, str):
            return value
        return "NOT PLAIN: " + type(value).__qualname__

    outcomes = {}
    for name, path in cases.items():
        try:
            outcomes[name] = summary(cr.load(path)(x, 2.0))
        except cr.ClikaError as e:  # anything else ends the script with a traceback
            outcomes[name] = f"{type(e).__name__}: {e}"
    print(json.dumps({"outcomes": outcomes, "imported": sorted(set(sys.modules) - before)}))
""")


@pytest.fixture(scope="module")
def fresh(shipped: Shipped, escapes: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The hostile class names and the external data cases, loaded and called in a fresh interpreter
    whose working folder holds an importable module that writes ``imported.txt`` when imported."""
    folder = tmp_path_factory.mktemp("fresh")
    (folder / "clika_probe.py").write_text("open('imported.txt', 'w').write('imported')\nclass Probe(tuple): pass\n")
    cases = {name: str(_edited(shipped, folder / f"case{i}.onnx", outputs=json.dumps(tree)))
             for i, (name, (tree, _)) in enumerate(HOSTILE_CLASSES.items())}
    cases.update({f"external data: {name}": str(path) for name, path in escapes.items()})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)])}
    result = subprocess.run([sys.executable, "-c", _FRESH, json.dumps(cases), str(shipped.path)], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return folder, json.loads(result.stdout.splitlines()[-1])


def test_class_names_in_a_file_run_nothing_and_import_nothing(fresh: tuple[Path, dict]) -> None:
    folder, run = fresh
    assert run["imported"] == []
    assert not (folder / "pwned.txt").exists() and not (folder / "imported.txt").exists()


@pytest.mark.parametrize("case", HOSTILE_CLASSES)
def test_each_class_name_is_served_as_plain_containers_or_refused(fresh: tuple[Path, dict], case: str) -> None:
    outcome, expected = fresh[1]["outcomes"][case], HOSTILE_CLASSES[case][1]
    if isinstance(expected, str):
        assert re.match(expected, outcome), outcome
    else:
        assert outcome == expected


@pytest.mark.parametrize("case", HOSTILE_CLASSES)
def test_class_names_run_nothing_where_torch_registered_node_types(shipped, tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    path = _edited(shipped, tmp_path / "case.onnx", outputs=json.dumps(HOSTILE_CLASSES[case][0]))
    before = set(sys.modules)
    outcome = _served_or_refused(path, X, 2.0)
    assert set(sys.modules) == before and list(tmp_path.iterdir()) == [path]
    assert isinstance(outcome, GraphFileError) == isinstance(HOSTILE_CLASSES[case][1], str)


class Pair(NamedTuple):
    a: Any
    b: Any


@dataclasses.dataclass
class Strict:
    y: Any
    pair_0: Any
    n: Any

    def __post_init__(self) -> None:
        if not isinstance(self.n, str):
            raise ValueError(f"n must be a str, got {type(self.n).__name__}")


ALLOWED_MISUSED = {  # case: (output tree, output_types, the refusal's words; None: refused at the call)
    "tuple called with keywords": (
        {"kind": "custom", "type": "builtins:tuple", "keys": ["y", "p", "n"], "children": OUTPUTS}, (),
        r"builtins:tuple cannot be rebuilt from a custom with entries \['y', 'p', 'n'\]"),
    "a structsequence of four fields named torch.return_types.max": (
        _named("structsequence", "torch.return_types:max"), (),
        r"torch\.return_types:max cannot be rebuilt from a structsequence with entries \[0, 1, 2, 3\]"),
    "a namedtuple of three fields named Pair": (
        {"kind": "namedtuple", "type": f"{__name__}:Pair", "keys": [0, 1, 2], "children": OUTPUTS}, (Pair,),
        r"test_security:Pair cannot be rebuilt from a namedtuple with entries \[0, 1, 2\]"),
    "a dataclass given a field it lacks": (
        {"kind": "custom", "type": f"{__name__}:Strict", "keys": ["y", "z", "n"], "children": OUTPUTS}, (Strict,),
        r"test_security:Strict cannot be rebuilt from a custom with entries \['y', 'z', 'n'\]"),
    "a dataclass that refuses the values": (
        {"kind": "custom", "type": f"{__name__}:Strict", "keys": ["y", "pair_0", "n"], "children": OUTPUTS}, (Strict,),
        None),
}


@pytest.mark.parametrize("case", ALLOWED_MISUSED)
def test_allowed_classes_named_for_the_wrong_fields_are_refused(shipped, tmp_path, case):
    tree, output_types, words = ALLOWED_MISUSED[case]
    path = _edited(shipped, tmp_path / "case.onnx", outputs=json.dumps(tree))
    if words is not None:
        with pytest.raises(GraphFileError, match=words):
            cr.load(path, output_types=output_types)
        return
    served = cr.load(path, output_types=output_types)
    with pytest.raises(GraphFileError, match=r"the outputs do not fit the output tree it describes"):
        served(X, 2.0)


# ------------------------------------------------------------------------------- malformed metadata


def _guard(shipped: Shipped, **changes: Any) -> str:
    """The shipped guard's JSON with fields replaced."""
    return json.dumps({**json.loads(shipped.metadata["clika_runtime.guard"]), **changes})


def _condition(tree: Any) -> dict[str, Any]:
    return {"conditions": [{"when": tree, "is": True}]}


def _nested(levels: int) -> str:
    return '{"kind": "list", "keys": [0], "children": [' * levels + '{"kind": "leaf"}' + "]}" * levels


def _inputs(*leaves: dict) -> str:
    args = {"kind": "tuple", "type": "builtins:tuple", "keys": list(range(len(leaves))), "children": list(leaves)}
    return json.dumps({"kind": "tuple", "type": "builtins:tuple", "keys": [0, 1],
                       "children": [args, {"kind": "dict", "type": "builtins:dict", "keys": [], "children": []}]})


X_RULE = {"name": "x", "dtype": "float32", "shape": ["x_dim0", 4]}
MALFORMED: dict[str, tuple[str, Callable[[Shipped], str | None], str]] = {  # case: (key, value, refusal)
    "10 000 levels of nesting": ("outputs", lambda s: _nested(10_000), r"clika_runtime\.outputs is nested too deep"),
    "100 levels of nesting": ("outputs", lambda s: _nested(100), r"at root(\[0\]){65}: deeper than 64"),
    "a 50 MB value": ("outputs", lambda s: json.dumps("x" * 50_000_000),
                      r"clika_runtime\.outputs is 50,000,002 characters, past the 4,194,304 allowed"),
    "malformed JSON": ("outputs", lambda s: '{"kind": "dict", "keys": [', r"clika_runtime\.outputs is not JSON"),
    "an unknown schema version": ("schema", lambda s: "3", r"metadata schema 3 is newer than this clika_runtime reads \(2\)"),
    "a schema of a Unicode digit": ("schema", lambda s: "²", r"malformed clika_runtime metadata schema '²'"),
    "a schema of 5000 digits": ("schema", lambda s: "9" * 5000, r"malformed clika_runtime metadata schema '9{20}'"),
    "the guard missing": ("guard", lambda s: None, r"clika_runtime\.guard is missing"),
    "a guard that is not JSON": ("guard", lambda s: "{", r"clika_runtime\.guard is not JSON"),
    "a guard of a newer version": ("guard", lambda s: _guard(s, version=2), r"guard: unknown version 2"),
    "a guard that is a list": ("guard", lambda s: "[1, 2]", r"guard: unknown version None"),
    "a condition on input 5 of 1": (
        "guard", lambda s: _guard(s, **_condition(["eq", ["size", 5, 0], ["const", 1]])), r"input 5 out of range \(1 inputs\)"),
    "a condition on input -1": (
        "guard", lambda s: _guard(s, **_condition(["eq", ["size", -1, 0], ["const", 1]])), r"expected an int in \[0, "),
    "a condition on axis 7 of a rank-2 input": (
        "guard", lambda s: _guard(s, **_condition(["eq", ["size", 0, 7], ["const", 1]])), r"input 'x' has no axis 7"),
    "a condition reading a tensor as a number": (
        "guard", lambda s: _guard(s, **_condition(["eq", ["num", 0], ["const", 1]])), r"input 'x' is not a number"),
    "a condition with an unknown op": (
        "guard", lambda s: _guard(s, **_condition(["__import__", ["const", 1]])),
        r"unknown node '__import__' with 1 argument"),
    "a condition with an op of the wrong arity": (
        "guard", lambda s: _guard(s, **_condition(["eq", ["const", 1]])), r"unknown node 'eq' with 1 argument"),
    "a condition 40 levels deep": (
        "guard", lambda s: _guard(s, **_condition(json.loads('["neg", ' * 40 + '["const", 1]' + "]" * 40))),
        r"expected a list of at most 32 levels"),
    "20 000 conditions": (
        "guard", lambda s: _guard(s, conditions=[{"when": ["const", 1], "is": 1}] * 20_000), r"10000 nodes in all"),
    "a huge constant": (
        "guard", lambda s: _guard(s, **_condition(["eq", ["const", 10**300], ["const", 1]])), r"got an int of 997 bits"),
    "a float constant": (
        "guard", lambda s: _guard(s, **_condition(["eq", ["const", 1.5], ["const", 1]])), r"got 1\.5"),
    "a 5000-digit range": (
        "guard", lambda s: _guard(s).replace('"ranges": {}', '"ranges": {"x_dim0": [0, ' + "9" * 5000 + "]}"),
        r"clika_runtime\.guard is not JSON this reader takes \(Exceeds the limit"),
    "an Infinity range": (
        "guard", lambda s: _guard(s).replace('"ranges": {}', '"ranges": {"x_dim0": [0, Infinity]}'), r"got inf"),
    "a range past int64": ("guard", lambda s: _guard(s, ranges={"x_dim0": [0, 2**64]}), r"got an int of 65 bits"),
    "a size of true": ("guard", lambda s: _guard(s, inputs=[{**X_RULE, "shape": ["x_dim0", True]}]), r"got True"),
    "a dim named like a number": (
        "guard", lambda s: _guard(s, inputs=[{**X_RULE, "shape": ["#x", 4]}]), r"dim name '#x' starts with '#'"),
    "a dtype that is a numpy type code": (
        "guard", lambda s: _guard(s, inputs=[{**X_RULE, "dtype": "f4,i4"}]), r"dtype 'f4,i4' is not a dtype name"),
    "a guard for other inputs": (
        "guard", lambda s: _guard(s, inputs=[{**X_RULE, "name": "y"}]),
        r"the guard is for inputs \['y'\], the graph's are \['x'\]"),
    "a guard for no inputs": ("guard", lambda s: _guard(s, inputs=[]), r"the guard is for inputs \[\], the graph's are"),
    "a guard of another dtype": (
        "guard", lambda s: _guard(s, inputs=[{**X_RULE, "dtype": "int64"}]),
        r"the guard takes input 'x' as int64\['x_dim0', 4\], the graph as x: float32\[x_dim0, 4\]"),
    "a guard letting a static axis vary": (
        "guard", lambda s: _guard(s, inputs=[{**X_RULE, "shape": ["x_dim0", "free"]}]),
        r"the guard lets input 'x' vary where the graph is static"),
    "an output tree of one value": ("outputs", lambda s: json.dumps(LEAF), r"takes 1 values, the graph has 3 outputs"),
    "a number read from a tensor output": (
        "outputs", lambda s: json.dumps({"kind": "list", "keys": [0, 1, 2], "children": OUTPUTS[::-1]}),
        r"output 'y' is y: float32\[x_dim0, 4\], not a number the output tree can return"),
    "a constant without a value": (
        "outputs", lambda s: json.dumps({"kind": "list", "keys": [0, 1, 2, 3], "children": [{"kind": "const"}, *OUTPUTS]}),
        r"at root\[0\]: a constant needs a value"),
    "an input tree feeding two tensors": ("inputs", lambda s: _inputs(LEAF, LEAF), r"feeds 2 tensors, the graph has 1"),
    "inputs that are not the (args, kwargs) pair": (
        "inputs", lambda s: json.dumps(LEAF), r"inputs: expected the \(args, kwargs\) pair"),
    "parameters that are not names": ("parameters", lambda s: "[1, 2]", r"parameters: expected a list of names"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_metadata_is_refused_at_load_naming_what_is_wrong(shipped, tmp_path, case):
    key, value, refusal = MALFORMED[case]
    path = _edited(shipped, tmp_path / "case.onnx", **{key: value(shipped)})
    with pytest.raises(GraphFileError, match=refusal):
        cr.load(path)


WRONG = [None, True, -1, 2**63, 1.5, "custom", [], {"kind": "leaf"}]


def _paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every position in a JSON value: dict keys and list indices from the root."""
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _paths(child, path + (key,))


def _put(value: Any, path: tuple, new: Any) -> Any:
    """``value`` with the position ``path`` replaced by ``new``."""
    if not path:
        return new
    value = copy.deepcopy(value)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return value


def _json_metadata(shipped: Shipped) -> dict[str, Any]:
    return {k.removeprefix("clika_runtime."): json.loads(v) for k, v in shipped.metadata.items()
            if k != "clika_runtime.version"}


def test_a_wrong_type_anywhere_in_the_metadata_is_served_or_refused(shipped):
    outcomes = collections.Counter()
    for key, value in _json_metadata(shipped).items():
        for path in _paths(value):
            for wrong in WRONG:
                edited = _with_metadata(shipped, **{key: json.dumps(_put(value, path, wrong))})
                outcome = _served_or_refused(edited, X, 2.0)  # any other exception fails the test here
                outcomes[type(outcome).__name__] += 1
    assert outcomes["GraphFileError"] > 300 and sum(outcomes.values()) > 500, outcomes


# ------------------------------------------------------------------------- guards and inputs at call


def test_a_condition_that_divides_by_a_size_of_zero_refuses_that_call(shipped, tmp_path):
    tree = ["eq", ["mod", ["const", 4], ["size", 0, 0]], ["const", 0]]  # 4 % rows == 0, True when traced
    served = cr.load(_edited(shipped, tmp_path / "case.onnx", guard=_guard(shipped, **_condition(tree))))
    np.testing.assert_array_equal(served(np.ones((2, 4), np.float32), 2.0)["y"], np.ones((2, 4)) * 2 + np.arange(4))
    with pytest.raises(GraphInputError, match=r"4 % x\.shape\[0\] == 0 was True, now False"):
        served(X, 2.0)
    # Size 0 is refused before the condition is read (a shipped graph serves no size 0), and the
    # condition divides by nothing: refused either way, never a ZeroDivisionError.
    with pytest.raises(GraphInputError, match=r"input 'x' axis 0: size 0, which the trace assumed away"):
        served(np.ones((0, 4), np.float32), 2.0)
    problems = served.guard.mismatches([np.ones((0, 4), np.float32)])
    assert [p.kind for p in problems] == ["special", "condition"] and "now undefined (division by zero)" in str(problems[1])


def test_inputs_of_the_wrong_kind_are_input_errors(shipped):
    served = cr.load(shipped.path)
    with pytest.raises(GraphInputError, match=r"input 'x': expected an array of float32, got list"):
        served([[1.0] * 4] * 3, 2.0)
    with pytest.raises(GraphInputError, match=r"input scale: the graph was captured with the static value 2\.0"):
        served(X, np.ones(3))  # an array where the capture had a constant: its truth would be ambiguous


def test_a_graph_failing_in_onnxruntime_is_a_graph_run_error(tmp_path):
    table = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2), "table")
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["rows"])], "lookup",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["n", 2])], [table])
    path = tmp_path / "lookup.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    served = cr.load(path)
    assert served(np.array([2]))["rows"].tolist() == [[4.0, 5.0]]
    with pytest.raises(GraphRunError, match=r"lookup\.onnx: onnxruntime failed running the graph: .*out of"):
        served(np.array([42]))


def test_names_and_metadata_that_are_not_utf8_are_refused(shipped, tmp_path):
    proto = _with_metadata(shipped, dims="@@@@")
    path = tmp_path / "latin.onnx"
    path.write_bytes(proto.SerializeToString().replace(b"@@@@", b"\xff\xfe\xfd\xfc"))
    with pytest.raises(GraphFileError, match=r"a name or metadata value in the graph is not UTF-8 text"):
        cr.load(path)


def test_validate_does_not_allocate_what_a_graph_declares(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [10**12])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "huge", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [10**12])])
    path = tmp_path / "huge.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = validate_graph(path)
    assert not report.passed
    assert report.checks[-1].detail == "input(s) ['x']: a type that cannot be generated, or more than 67,108,864 elements"


def test_inspect_refuses_an_element_type_onnx_does_not_know(tmp_path):
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "xy")
    x.type.tensor_type.elem_type = 999
    path = tmp_path / "unknown.onnx"
    onnx.save_model(helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])),
                    str(path))
    with pytest.raises(GraphFileError, match=r"the graph's inputs or outputs do not parse: 999"):
        inspect_graph(path)  # was a KeyError, a traceback from the command


# ------------------------------------------------------------------------------------ external data


def _absolute(folder: Path) -> str:
    return str(folder.parent / "secrets" / "weights.bin")


def _climbing(folder: Path) -> str:
    return "../secrets/weights.bin"


def _linked_file(folder: Path) -> str:
    (folder / "weights.bin").symlink_to(folder.parent / "secrets" / "weights.bin")
    return "weights.bin"


def _linked_folder(folder: Path) -> str:
    (folder / "sub").symlink_to(folder.parent / "secrets", target_is_directory=True)
    return "sub/weights.bin"


def _fifo(folder: Path) -> str:
    os.mkfifo(folder / "weights.bin")  # a reader opening it would wait for a writer forever
    return "weights.bin"


def _loop(folder: Path) -> str:
    (folder / "loop").symlink_to("loop")
    return "loop"


def _beside(folder: Path) -> str:
    shutil.copy(folder.parent / "secrets" / "weights.bin", folder / "weights.bin")
    return "weights.bin"


ESCAPES = {  # case: (how the model's folder is made, where the weights' location points, the refusal)
    "an absolute path": (_absolute, "initializer", r"is absolute or climbs out of the model's folder"),
    "a path climbing out with ..": (_climbing, "initializer", r"'\.\./secrets/weights\.bin' is absolute or climbs out"),
    "a link to a file outside": (_linked_file, "initializer", r"'weights\.bin' links out of the model's folder"),
    "a path through a linked folder": (_linked_folder, "initializer", r"'sub/weights\.bin' links out of the model's"),
    "a Constant node's tensor climbing out": (_climbing, "constant", r"tensor 'planted': external data location '\.\./"),
    "a FIFO in the folder": (_fifo, "initializer", r"'weights\.bin' is not a regular file"),
    "a link loop": (_loop, "initializer", r"'loop' cannot be resolved: Symlink loop"),
    "a NUL in the name": (lambda folder: "weights.bin\0.txt", "initializer", r"'weights\.bin\\x00\.txt' holds a NUL"),
    "a name too long": (lambda folder: "w" * 300, "initializer", r"'w{100}'\.\.\. cannot be resolved: File name too long"),
}


def _point_weights(proto: onnx.ModelProto, location: str, where: str) -> None:
    """Make the weights of ``proto`` (saved with external data) read from ``location``: every
    initializer's, or a new Constant node's tensor."""
    if where == "initializer":
        for tensor in proto.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = location
        return
    planted = numpy_helper.from_array(np.zeros(4, np.float32), "planted")
    planted.ClearField("raw_data")
    planted.data_location = TensorProto.EXTERNAL
    planted.external_data.add(key="location", value=location)
    proto.graph.node.append(helper.make_node("Constant", [], ["planted_out"], value=planted))


@pytest.fixture(scope="module")
def escapes(shipped: Shipped, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per case, a model whose weights are read from a readable copy of its real weights outside its
    folder (so that only the rule refuses it); and ``beside``: the same with the copy in its folder."""
    root = tmp_path_factory.mktemp("escapes")
    saved = cr.ModelGraph(shipped.proto).save(root / "source" / "affine.onnx", external_data=True)
    (root / "secrets").mkdir()
    (data,) = saved.parent.glob("affine.onnx.*.data")  # named by content
    shutil.copy(data, root / "secrets" / "weights.bin")
    made = {}
    for name, (make, where, _) in {**ESCAPES, "beside": (_beside, "initializer", "")}.items():
        folder = root / re.sub(r"\W+", "_", name)
        folder.mkdir()
        proto = onnx.load_model(str(saved), load_external_data=False)
        _point_weights(proto, make(folder), where)
        onnx.save_model(proto, str(folder / "affine.onnx"))
        made[name] = folder / "affine.onnx"
    return made


ENTRY_POINTS: dict[str, Callable[[Path], Any]] = {
    "cr.load": cr.load,
    "ModelGraph.load": cr.ModelGraph.load,
    "inspect": inspect_graph,
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", ESCAPES)
def test_external_data_outside_the_folder_is_refused_before_it_is_read(escapes, case, entry):
    with pytest.raises(GraphFileError, match=ESCAPES[case][2]):
        ENTRY_POINTS[entry](escapes[case])


@pytest.mark.parametrize("case", ESCAPES)
def test_validate_and_the_triton_command_refuse_external_data_outside_the_folder(escapes, case, capsys):
    report = validate_graph(escapes[case])
    assert not report.passed and [c.name for c in report.checks] == [SAFE_TO_OPEN]  # nothing else opened it
    assert re.search(ESCAPES[case][2], report.checks[0].detail)
    repository = escapes[case].parent / "repository"
    assert cli(["triton", str(escapes[case]), "--repository", str(repository)]) == 2
    assert re.search(ESCAPES[case][2], capsys.readouterr().err) and not repository.exists()


def test_external_data_beside_the_model_is_served(escapes):
    out = cr.load(escapes["beside"])(X, 2.0)
    np.testing.assert_array_equal(out["y"], X * 2 + np.arange(4))
    assert validate_graph(escapes["beside"]).passed


def test_load_refuses_external_data_outside_the_folder_without_onnx(fresh):
    outcomes = fresh[1]["outcomes"]  # loaded in the fresh interpreter, where onnx cannot be imported
    for case, (_, _, refusal) in ESCAPES.items():
        assert re.match(r"GraphFileError: .*" + refusal, outcomes[f"external data: {case}"])
    assert outcomes["external data: beside"]["y"] == "array"


# --------------------------------------------------------------------------- nodes that run code


def _with_node(shipped: Shipped, path: Path, node: onnx.NodeProto) -> Path:
    proto = onnx.ModelProto()
    proto.CopyFrom(shipped.proto)
    proto.graph.node.append(node)
    onnx.save_model(proto, str(path))
    return path


def _branch(node: onnx.NodeProto) -> onnx.NodeProto:
    """An If node whose branches hold ``node``: code can hide in a subgraph."""
    output = helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)
    branch = helper.make_graph([node], "branch", [], [output])
    return helper.make_node("If", ["flag"], ["chosen"], name="choice", then_branch=branch, else_branch=branch)


ENGINE = helper.make_node("EPContext", [], ["engine_out"], name="engine", domain="com.microsoft", embed_mode=1,
                          ep_cache_context="a provider's compiled engine")
CODE_NODES = {  # case: (node, the refusal)
    "a provider's compiled engine": (ENGINE, r"node EPContext 'engine' runs code"),
    "a Python call": (helper.make_node("PyOp", ["x"], ["py_out"], name="call", domain="com.microsoft", module="os",
                                       class_name="system", compute="run"), r"node PyOp 'call' runs code"),
    "an engine in a subgraph": (_branch(ENGINE), r"node EPContext 'engine' runs code"),
}


@pytest.mark.parametrize("case", CODE_NODES)
def test_nodes_that_run_code_are_refused(shipped, tmp_path, case):
    node, refusal = CODE_NODES[case]
    path = _with_node(shipped, tmp_path / "case.onnx", node)
    for load in (cr.load, cr.ModelGraph.load):
        with pytest.raises(GraphFileError, match=refusal):
            load(path)


# ------------------------------------------------------------------------------------------ fuzzing

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.sampled_from(["leaf", "custom"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FUZZ = settings(max_examples=150, deadline=timedelta(seconds=5))  # a hang or a slow path fails the deadline


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "mutant.onnx"


@FUZZ
@given(data=st.data())
def test_fuzzed_metadata_is_served_or_refused(shipped, data):
    originals = _json_metadata(shipped)
    key = data.draw(st.sampled_from(sorted(originals)))
    value = originals[key]
    how = data.draw(st.sampled_from(["truncate", "replace", "swap"]))
    text = json.dumps(value)
    if how == "truncate":
        text = text[: data.draw(st.integers(0, len(text) - 1))]
    elif how == "replace":
        text = json.dumps(data.draw(JSON_VALUES))
    else:
        path = data.draw(st.sampled_from(list(_paths(value))))
        text = json.dumps(_put(value, path, data.draw(JSON_VALUES | st.sampled_from(WRONG))))
    outcome = _served_or_refused(_with_metadata(shipped, **{key: text}), X, 2.0)
    _assert_said_or_served(outcome)
    # Metadata describes the graph; it cannot change what the graph computes.
    assert all(any(np.array_equal(a, e) for e in EXPECTED) for a in _arrays(outcome)), outcome


@FUZZ
@given(data=st.data())
def test_fuzzed_bytes_are_served_or_refused(shipped, fuzz_path, data):
    raw = bytearray(shipped.path.read_bytes())
    how = data.draw(st.sampled_from(["overwrite", "truncate", "duplicate"]))
    at = data.draw(st.integers(0, len(raw) - 1))
    if how == "overwrite":
        chunk = data.draw(st.binary(min_size=1, max_size=8))
        raw[at:at + len(chunk)] = chunk
    elif how == "truncate":
        del raw[at:]
    else:
        raw[at:at] = raw[at:at + data.draw(st.integers(1, 64))]
    fuzz_path.write_bytes(bytes(raw))
    _assert_said_or_served(_served_or_refused(fuzz_path, X, 2.0))
