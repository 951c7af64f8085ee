"""The public surface: exactly what DESIGN.md names (and ``Agreement``, issue 24's ``agreement=``),
each with a docstring and type hints."""

from __future__ import annotations

import inspect

import clika_runtime as cr

EXPECTED = {
    "compile", "load", "CompiledFunction", "ModelGraph", "TensorSpec", "DynamicAxes", "PlaceLike", "config",
    "ClikaError", "CaptureError", "VerificationError", "PlaceError", "StateError", "SignatureError",
    "SignatureValueError", "GraphInputError", "GraphFileError", "GraphRunError", "DeployError", "Agreement",
}


def test_all_is_exactly_the_public_names():
    assert set(cr.__all__) == EXPECTED
    for name in cr.__all__:
        assert getattr(cr, name) is not None


def test_nothing_looks_public_without_being_exported():
    leaked = {
        name for name, value in vars(cr).items()
        if not name.startswith("_") and not inspect.ismodule(value) and name not in cr.__all__
        and name not in ("annotations", "TYPE_CHECKING", "Any")
    }
    assert not leaked, f"public-looking names not in __all__: {leaked}; add them to __all__ or prefix them with _"


def test_public_callables_have_docstrings_and_hints():
    for name in cr.__all__:
        value = getattr(cr, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), f"{name} has no docstring"
    for fn in (cr.compile, cr.load, cr.CompiledFunction.__init__, cr.CompiledFunction.take_graph,
               cr.CompiledFunction.reset, cr.ModelGraph.save, cr.ModelGraph.serve):
        hints = inspect.signature(fn)
        assert hints.return_annotation is not inspect.Signature.empty, fn
    for member in ("state", "recapture_count", "input_names", "take_graph", "reset"):
        assert inspect.getdoc(getattr(cr.CompiledFunction, member)), member


def test_state_is_nested_and_matches_the_spec():
    State = cr.CompiledFunction.State
    assert [s.name for s in State] == ["Pending", "Compiled", "Fallback"]
    parameters = inspect.signature(cr.CompiledFunction.__init__).parameters
    assert list(parameters) == ["self", "target", "signature", "dynamic", "fullgraph", "optimize", "specialize",
                                "place", "dynamic_axes", "output_names", "graph_name", "precision", "agreement"]
    assert cr.config.cache_size == 8 and cr.config.recapture_limit == 8
