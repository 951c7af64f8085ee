"""The served call's checks that the tensors a graph baked and the Python state it watches are as
they were (``weights.Watch``, ``snapshot.Snapshot``), each one call over plain tuples.

``_unchanged.c`` does the same in C, and is used where it was built (``pip install`` builds it
where a C compiler is found): the Python forms below allocate iterators and tuples on every
call, and the garbage collections those trigger land inside served calls (callgrind: a third of
an MLP's served call went to these checks). Both answer ``False`` where a value cannot be read
or compared, and the miss path then looks carefully; ``COMPILED`` says which one runs.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

_version = operator.attrgetter("_version")
_call = getattr(operator, "call", None) or (lambda f, x: f(x))  # operator.call: Python 3.11+


def _weights_unchanged(data_ptr: Callable[[Any], int], versioned: tuple, versions: int, slots: tuple,
                       names: tuple, placed: tuple, tensors: tuple, pointers: tuple) -> bool:
    """The baked tensors' versions sum to ``versions``; ``data_ptr(slots[i][names[i]])`` is
    ``placed[i]`` (a module's tensors, read where the module keeps them); ``data_ptr(tensors[i])``
    is ``pointers[i]``."""
    try:
        return (sum(map(_version, versioned)) == versions
                and tuple(map(data_ptr, map(operator.getitem, slots, names))) == placed
                and tuple(map(data_ptr, tensors)) == pointers)
    except Exception:  # a tensor that cannot say (swapped out by a trace), an entry gone or None
        return False


def _state_unchanged(sized: tuple, sizes: tuple, readers: tuple, containers: tuple, values: tuple) -> bool:
    """``len(sized[i]) == sizes[i]`` and ``readers[i](containers[i]) == values[i]`` (identity first)."""
    try:
        return tuple(map(len, sized)) == sizes and tuple(map(_call, readers, containers)) == values
    except Exception:  # a value whose == cannot answer (an array)
        return False


try:
    from clika_runtime.state._unchanged import state_unchanged, weights_unchanged

    COMPILED = True
except ImportError:  # not built (no C compiler where it was installed): the Python forms, the same answers
    weights_unchanged, state_unchanged = _weights_unchanged, _state_unchanged
    COMPILED = False
