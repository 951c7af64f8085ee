"""A pytest helper for users' own suites: assert that a function's graph matches eager.

    from clika_runtime.testing import assert_graph_matches_eager

    def test_my_model_exports():
        assert_graph_matches_eager(model, [(x8,), (x16,), ((x32,), {"mask": m32})])
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from clika_runtime.base.precision import Agreement, shortfall
from clika_runtime.function.compiled import CompiledFunction, State
from clika_runtime.trees import pytrees as trees


def _split_call(example: Any) -> tuple[tuple, dict]:
    if isinstance(example, tuple) and len(example) == 2 and isinstance(example[0], tuple) and isinstance(example[1], dict):
        return example
    return (example if isinstance(example, tuple) else (example,)), {}


def assert_graph_matches_eager(
    fn: Callable[..., Any],
    examples: Sequence[Any],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    **compile_options: Any,
) -> CompiledFunction:
    """Compile ``fn``, run every example through it, and assert the graph serves them all like eager.

    Each example is a tuple of positional arguments, a single argument, or ``(args, kwargs)``. The
    examples are called once to capture (shapes may drift between them), then once more: each call
    of the second pass must be served by a graph, without re-capture, and match eager within
    ``rtol``/``atol`` (default: ``torch.testing.assert_close``'s for the dtype; for a graph at
    reduced precision, the agreement it serves by, its rows included). Failures name the example,
    the output path and the worst difference. Returns the compiled function for further checks.
    """
    f = CompiledFunction(fn, **compile_options)
    calls = [_split_call(e) for e in examples]
    with torch.no_grad():
        for args, kwargs in calls:
            f(*args, **kwargs)
        if f.state is not State.Compiled:
            raise AssertionError(f"{f.__name__} did not compile: {f.fallback_reason or '; '.join(f.recapture_reasons)}")
        for index, (args, kwargs) in enumerate(calls):
            hits, count = _hits(f), f.recapture_count
            served = f(*args, **kwargs)
            if f.recapture_count != count or f.state is not State.Compiled:
                reasons = f.recapture_reasons[count - f.recapture_count:] if f.recapture_count > count else []
                raise AssertionError(f"{f.__name__}: the examples were not all served by one set of graphs: "
                                     f"example {index} re-captured: {reasons or f.fallback_reason}")
            if _hits(f) <= hits:  # answered eagerly: a refused key, or a call the graphs decline
                notes = f.capture_notes or ["it ran eagerly"]
                why = "; ".join(f.eager_keys.values()) or f.fallback_reason or notes[-1]
                raise AssertionError(f"{f.__name__}: example {index} was not served by a graph: {why}")
            expected = fn(*args, **kwargs)
            _compare(index, served, expected, rtol, atol, _agreement(f) if rtol is None and atol is None else None)
    return f


def _agreement(f: CompiledFunction) -> Agreement | None:
    """The agreement a function's reduced-precision graphs serve by, where one serves."""
    lifecycle = f._lifecycle  # the helper reads what the function holds, as its own tests do
    reduced = any(c.precision is not None for c in lifecycle.table.captures)
    return lifecycle.target.agreement_now() if reduced else None


def _hits(f: CompiledFunction) -> int:
    return sum(capture.hits or 0 for capture in f.captures)


def _compare(index: int, served: Any, expected: Any, rtol: float | None, atol: float | None,
             agreement: Agreement | None) -> None:
    served_leaves, served_spec = trees.flatten(served)
    expected_leaves, expected_spec = trees.flatten(expected)
    if served_spec != expected_spec:
        raise AssertionError(f"example {index}: output structure {served_spec}, eager {expected_spec}")
    names = trees.output_names(expected, expected_leaves)
    for name, got, want in zip(names, served_leaves, expected_leaves):
        if not isinstance(want, torch.Tensor):
            if got != want:
                raise AssertionError(f"example {index}: output '{name}' is {got!r}, eager {want!r}")
            continue
        if agreement is not None and want.is_floating_point():  # an int8 graph: by the agreement it serves by
            short = shortfall(agreement, name, _float64(want), _float64(got))
            if short:
                raise AssertionError(f"example {index}: {short} (by the agreement the graph serves by)")
            continue
        tolerances = {} if rtol is None and atol is None else {"rtol": rtol or 0.0, "atol": atol or 0.0}
        try:
            torch.testing.assert_close(got, want, **tolerances)
        except AssertionError as e:
            worst = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "n/a"
            raise AssertionError(f"example {index}: output '{name}' differs from eager (worst |diff| {worst}): {e}") from None


def _float64(t: torch.Tensor) -> Any:
    return t.detach().cpu().to(torch.float64).numpy()
