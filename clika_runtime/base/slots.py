"""How a call's keywords move into positional slots: the one rule behind both canonical forms,
``trees.calls.CallForms`` (a call's form for the cache key) and ``ServedGraph`` (a call to a
shipped graph, re-slotted as at capture). Pure: names in, a plan out.

A keyword that names a positional parameter past the call's positional arguments moves to its
slot; a slot the call skips before it takes ``fill(index, name)``. The two callers differ only in
what they fill a slot with (the parameter's default; the value the graph was captured with) and
in how far they go (``to_the_end``: a shipped graph takes every slot it was captured with, so
slots past the last keyword are filled while ``fill`` has a value).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

KEYWORD = object()  # a plan entry: take this slot from the call's keyword of that name
MISSING = object()  # what ``fill`` returns for a slot it has no value for

Plan = tuple[tuple[tuple[str, Any], ...], tuple[str, ...]]  # (the slots to add, the keywords that move)


def slotted(positional: Sequence[str | None], nargs: int, names: Sequence[str], fill: Callable[[int, str | None], Any],
            *, to_the_end: bool = False) -> Plan | None:
    """The slots a call with ``nargs`` positional arguments and keywords ``names`` adds (each
    ``(name, KEYWORD)`` or ``(name, value)``) and the keywords that move; ``None`` when no keyword
    moves, or (``to_the_end`` off) a skipped slot before the last one that does has no value."""
    movable = [i for i in range(nargs, len(positional)) if positional[i] in names]
    if not movable:
        return None
    slots: list[tuple[str | None, Any]] = []
    for i in range(nargs, len(positional) if to_the_end else movable[-1] + 1):
        name = positional[i]
        value = KEYWORD if name in names else fill(i, name)
        if value is MISSING:
            if not to_the_end:
                return None  # a required parameter is missing (the target raises), or a default left as given
            break
        slots.append((name, value))
    moved = tuple(name for name, value in slots if value is KEYWORD)
    return (tuple(slots), moved) if moved else None
