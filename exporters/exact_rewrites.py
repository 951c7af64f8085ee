"""The exporter's optimiser, made to remove only the arithmetic that does nothing.

onnxscript's rewriter (which ``torch.onnx.export(optimize=True)`` runs) replaces ``x + c`` and
``x - c`` by ``x`` when ``|c| <= 1e-8``, and ``x * c`` and ``x / c`` when ``c`` is within 1e-5 of 1:
its constant patterns match with ``math.isclose``'s tolerances. The epsilon a function adds to
keep a log or a division finite at 0 (``torch.log(p + 1e-10)``, ``x / (norm + 1e-8)``,
``rsqrt(var + 1e-12)``) was dropped, and the graph returned ``-inf``, NaN or ``inf`` exactly where
the epsilon mattered, at values its verification never saw. ``exact`` makes those patterns match
their constant exactly (``math.isclose`` with both tolerances 0 is ``==``).
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)


@functools.cache
def exact() -> None:
    """Make the default rewrite rules' scalar constant patterns match exactly (once a process)."""
    try:
        from onnxscript.rewriter import _DEFAULT_REWRITE_RULES, _pattern_ir

        for rule in _DEFAULT_REWRITE_RULES:
            for node in rule._target_pattern._nodes:
                for value in node.inputs:
                    if isinstance(value, _pattern_ir.Constant) and isinstance(value._value, (int, float)):
                        value._rel_tol = value._abs_tol = 0.0
    except (ImportError, AttributeError) as e:  # another onnxscript: its rules as they are
        logger.warning("onnxscript's rewrite rules not made exact (%s): a graph may drop an added "
                       "constant of 1e-8 or less", e)
