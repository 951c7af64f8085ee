"""Pytrees: fast flattening, torch's registry mirrored, leaf names, and a torch-free description.

The hot path flattens with optree (C++) in a namespace of our own where dicts keep insertion order,
as torch's pytree does. Node types registered with ``torch.utils._pytree`` (HuggingFace's
``ModelOutput``, registered dataclasses...) are mirrored into that namespace on a miss, so the
registry users already know is the one we follow.
"""

from __future__ import annotations

import dataclasses
import functools
import keyword
import re
import threading
from collections import OrderedDict, UserDict, defaultdict, deque
from collections.abc import MutableMapping
from typing import Any, Callable, Sequence

import optree

NAMESPACE = "clika_runtime"


def keep_insertion_order(namespace: str) -> None:
    """Make dicts flatten in insertion order in ``namespace``, as torch's pytree does.

    optree's public switch is a context manager (``dict_insertion_ordered``); the setting it
    wraps (``optree._C.set_dict_insertion_ordered``) is what we need for the whole process. Where
    that private call is gone, the public context manager is entered once and never left.
    """
    setter = _private_setter()
    if setter is not None:
        setter(True, namespace)
    else:  # kept referenced: a collected context manager would restore the old mode
        entered = optree.dict_insertion_ordered(True, namespace=namespace)
        entered.__enter__()
        _ENTERED.append(entered)


_ENTERED: list[Any] = []


def _private_setter() -> Callable[[bool, str], None] | None:
    return getattr(getattr(optree, "_C", None), "set_dict_insertion_ordered", None)


keep_insertion_order(NAMESPACE)

_NATIVE = (tuple, list, dict, OrderedDict, defaultdict, deque, type(None))
_mirrored: set[type] = set()
_REGISTERING = threading.RLock()  # misses of several functions register node types at once


# tree -> (leaves, structure); None is a leaf. A partial, not a def: it is on every call's hot path.
flatten = functools.partial(optree.tree_flatten, none_is_leaf=True, namespace=NAMESPACE)


def sync_registry(call: Any = ()) -> None:
    """Mirror node types newly registered with torch's pytree into our namespace; then adopt the
    containers of tensors among ``call``'s leaves (``adopt``)."""
    _mirror()
    adopt(call)


def adopt(tree: Any) -> None:
    """Register in our namespace the dataclass and ``UserDict`` types among ``tree``'s leaves that
    hold tensors (a ``Batch`` dataclass, the tokenizer's ``BatchEncoding``): their tensors then
    feed the graph as a dict's would, where the whole object would be one static leaf that
    cannot key a capture (every call eager)."""
    while new := {type(leaf) for leaf in flatten(tree)[0] if _holds_tensors(leaf)}:
        with _REGISTERING:  # another function's miss may adopt the same type meanwhile
            for cls in new - _mirrored:
                own(cls, *_container_functions(cls))


def _holds_tensors(leaf: Any, depth: int = 4) -> bool:
    """A dataclass or ``UserDict`` holding tensors, or such containers that do (``depth`` levels)."""
    import torch

    if depth == 0 or type(leaf) in _mirrored or not (_plain_user_dict(leaf) or _dataclass_instance(leaf)):
        return False
    fields = list(leaf.data.values()) if isinstance(leaf, UserDict) else [getattr(leaf, n) for n in _state(leaf)]
    return any(isinstance(x, torch.Tensor) or _holds_tensors(x, depth - 1) for x in flatten(fields)[0])


# What a tokenizer's BatchEncoding keeps beside its items (offsets, word ids): not what a model reads;
# ``BatchEncoding(items)`` leaves them None too.
_BOOKKEEPING = frozenset({"_encodings", "_n_sequences"})


def _plain_user_dict(leaf: Any) -> bool:
    """A ``UserDict`` whose state is its items (attributes beside them None or tokenizer
    bookkeeping): rebuilt from its items alone, it is the same object to the code that reads it."""
    return isinstance(leaf, UserDict) and all(
        v is None or k in _BOOKKEEPING for k, v in vars(leaf).items() if k != "data")


def _dataclass_instance(leaf: Any) -> bool:
    return dataclasses.is_dataclass(leaf) and not isinstance(leaf, type)


def _state(obj: Any) -> tuple[str, ...]:
    """A dataclass instance's attributes as set: ``init=False`` fields, what ``__post_init__`` made
    (from an ``InitVar`` too), anything set since; its fields when it has no ``__dict__`` (slots)."""
    state = getattr(obj, "__dict__", None)
    return tuple(state) if state is not None else tuple(f.name for f in dataclasses.fields(obj) if hasattr(obj, f.name))


def _container_functions(cls: type) -> tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]:
    """optree's flatten and unflatten for an adopted type: a ``UserDict`` by its items, a
    dataclass by its attributes as set; both rebuilt without running their constructor (which
    may take other arguments, and whose ``__post_init__`` run again on traced tensors or served
    outputs would change them), with every attribute they had."""
    if issubclass(cls, UserDict):
        def flatten_items(obj: Any) -> tuple[list[Any], tuple, tuple]:
            keys = tuple(obj.data)
            return [obj.data[k] for k in keys], (keys, tuple(k for k in vars(obj) if k != "data")), keys

        def unflatten_items(context: tuple, children: Any) -> Any:
            keys, others = context
            obj = cls.__new__(cls)
            obj.__dict__.update(dict.fromkeys(others), data=dict(zip(keys, children)))  # the others: None
            return obj

        return flatten_items, unflatten_items

    def flatten_state(obj: Any) -> tuple[list[Any], tuple, tuple]:
        names = _state(obj)
        return [getattr(obj, n) for n in names], names, names

    def unflatten_state(names: tuple[str, ...], children: Any) -> Any:
        obj = cls.__new__(cls)
        for name, value in zip(names, children):
            object.__setattr__(obj, name, value)  # frozen dataclasses too
        return obj

    return flatten_state, unflatten_state


def _mirror() -> None:
    try:
        import torch
        from torch.utils import _pytree
    except ImportError:  # torch-free serving: only builtin containers
        return
    with _REGISTERING:
        for cls, node in list(_pytree.SUPPORTED_NODES.items()):
            if not isinstance(cls, type) or cls in _mirrored or cls in _NATIVE or optree.is_structseq_class(cls):
                continue
            _mirrored.add(cls)
            # torch's pytree rebuilds a torch.Size as a plain tuple; eager returns the Size (``.numel()``)
            rebuild = _size if cls is torch.Size else node.unflatten_fn
            optree.register_pytree_node(cls, _flatten_with_entries(node), _unflatten(rebuild), namespace=NAMESPACE)


def _size(children: list[Any], _: Any) -> Any:
    """A ``torch.Size`` rebuilt from its sizes; children that are not sizes (the placeholders
    ``calls.original_slots`` maps a call's leaves with) pass through as a tuple."""
    import torch

    if all(isinstance(c, (int, torch.SymInt)) for c in children):
        return torch.Size(children)
    return tuple(children)


def own(cls: type, flatten_fn: Callable[[Any], Any], unflatten_fn: Callable[[Any, Any], Any]) -> None:
    """Register ``cls`` in our namespace with our own functions (optree's signatures), in place of
    any mirror of torch's registration, which ``sync_registry`` then leaves alone (KV caches:
    ``kvcache.py`` decides how they flatten, whatever torch's registry says)."""
    with _REGISTERING:
        if cls in _mirrored:
            try:
                optree.unregister_pytree_node(cls, namespace=NAMESPACE)
            except ValueError:  # marked but never registered here
                pass
        _mirrored.add(cls)
        optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)


def _flatten_with_entries(node: Any) -> Any:
    """optree flatten function for a torch pytree node, with key names as entries when torch has them."""
    flatten_fn, with_keys = node.flatten_fn, node.flatten_with_keys_fn
    if with_keys is None:
        return flatten_fn

    def flatten(obj: Any) -> tuple[list[Any], Any, list[str]]:
        # The context must come from flatten_fn: for some types (dataclasses) the keyed variant's differs.
        children, context = flatten_fn(obj)
        return children, context, [_key_text(k) for k, _ in with_keys(obj)[0]]

    return flatten


def _unflatten(unflatten_fn: Any) -> Any:
    return lambda context, children: unflatten_fn(children, context)


def rebuilder(spec: optree.PyTreeSpec, example: Sequence[Any]) -> Callable[[Sequence[Any]], Any]:
    """``spec.unflatten``, or an equivalent that skips node types' constructors.

    HuggingFace's ``ModelOutput`` constructor costs ~17 us a call (dataclass field scans on every
    attribute set), as much as a small graph's run. When a registered node's object, built from
    ``example``, holds nothing but its children and ``None`` (in its ``__dict__`` and, for dict
    subclasses, its items), the same state is set on a fresh instance directly. The clone is
    compared with the constructor's object here; anything else (computed attributes,
    ``__slots__``, copies of children) keeps the constructor, and so do leaves other than tensors:
    where the constructor put each leaf is read from object identity, which says nothing for
    numbers and strings (cached, interned). A node over subtrees (a ``Seq2SeqLMOutput`` holding
    its cache) is cloned over its children, each built by its own rebuilder.
    """
    return _clone_builder(spec, list(example)) or spec.unflatten


def _clone_builder(spec: optree.PyTreeSpec, leaves: list[Any]) -> Callable[[Sequence[Any]], Any] | None:
    """A constructor-free builder of ``spec`` (see ``rebuilder``), or ``None`` where there is none."""
    import torch

    if spec.is_leaf() or spec.type in _NATIVE:
        return None
    if spec.num_nodes != spec.num_children + 1:  # some child is a subtree
        return _nested_builder(spec, leaves)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return None
    return _checked_clone(spec.unflatten, leaves)


def _checked_clone(unflatten: Callable[[Sequence[Any]], Any], children: list[Any]) -> Callable[[Sequence[Any]], Any] | None:
    """The state clone of what ``unflatten`` builds from ``children``, when it matches the original."""
    try:
        made = unflatten(children)
        clone = _state_clone(made, children)
        if clone is None or not _same_state(clone(children), made):
            return None
    except Exception:  # an unusual type: the constructor it is
        return None
    return clone


def _nested_builder(spec: optree.PyTreeSpec, leaves: list[Any]) -> Callable[[Sequence[Any]], Any] | None:
    """The node at ``spec``'s root cloned over its children; subtrees built by their own rebuilders.

    A child that is a leaf must be a tensor, and one built by a rebuilder a new object on each
    call (a ``None`` child is ``None``): the clone places children by identity."""
    import torch

    spans, start = [], 0
    for child in spec.children():
        end = start + child.num_leaves
        spans.append((start, end, None if child.is_leaf() else rebuilder(child, leaves[start:end])))
        start = end
    children = [leaves[a] if build is None else build(leaves[a:z]) for a, z, build in spans]
    if any(build is None and not isinstance(c, torch.Tensor) for c, (_, _, build) in zip(children, spans)):
        return None
    top = _checked_clone(spec.one_level().unflatten, children)
    if top is None:
        return None

    def build(outs: Sequence[Any]) -> Any:
        return top([outs[a] if sub is None else sub(outs[a:z]) for a, z, sub in spans])

    return build


def _state_clone(made: Any, leaves: list[Any]) -> Callable[[Sequence[Any]], Any] | None:
    """A builder of ``type(made)`` from new children, when ``made``'s state is exactly children and ``None``."""
    cls = type(made)
    if not hasattr(made, "__dict__") or not all(map(_plain_layout, cls.__mro__)):
        return None
    placed = [(i, leaf) for i, leaf in enumerate(leaves) if leaf is not None]  # a None child stays None
    index = {id(leaf): i for i, leaf in placed}
    if len(index) != len(placed):  # one object twice: positions would be ambiguous
        return None
    attrs = [(k, None if v is None else index.get(id(v), -1)) for k, v in vars(made).items()]
    items = [(k, index.get(id(v), -1)) for k, v in dict.items(made)] if isinstance(made, dict) else []
    if any(i == -1 for _, i in attrs + items):
        return None  # state that is not a leaf: computed in the constructor, so it must run
    setitem = OrderedDict.__setitem__ if isinstance(made, OrderedDict) else dict.__setitem__
    new = cls.__new__

    def clone(outs: Sequence[Any]) -> Any:
        obj = new(cls)
        state = obj.__dict__
        for k, i in attrs:
            state[k] = None if i is None else outs[i]
        for k, i in items:
            setitem(obj, k, outs[i])
        return obj

    return clone


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python, not in C


def _plain_layout(c: type) -> bool:
    """Whether ``c`` keeps no state outside ``__dict__`` and dict items (no C fields, no slots)."""
    if c in (object, dict, OrderedDict):
        return True
    return bool(c.__flags__ & _HEAP_TYPE) and not vars(c).get("__slots__")


def _same_state(a: Any, b: Any) -> bool:
    if type(a) is not type(b) or list(vars(a)) != list(vars(b)):
        return False
    if any(v is not vars(b)[k] for k, v in vars(a).items()):
        return False
    if isinstance(a, dict):
        pairs_a, pairs_b = list(dict.items(a)), list(dict.items(b))
        return len(pairs_a) == len(pairs_b) and all(ka == kb and va is vb for (ka, va), (kb, vb) in zip(pairs_a, pairs_b))
    return True


# ---------------------------------------------------------------------------------------------- names

_NOT_IDENT = re.compile(r"\W+")


def _key_text(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_paths(tree: Any, leaves: Sequence[Any]) -> list[tuple[str, ...]]:
    """Each leaf's path as text parts: torch's key paths where they agree with our leaves, else optree's."""
    try:
        from torch.utils import _pytree

        pairs = _pytree.tree_flatten_with_path(tree)[0]
        if len(pairs) == len(leaves) and all(v is leaf for (_, v), leaf in zip(pairs, leaves)):
            return [tuple(_key_text(k) for k in path) for path, _ in pairs]
    except Exception:  # a node type without key paths: fall back to optree's entries
        pass
    paths = optree.tree_paths(tree, none_is_leaf=True, namespace=NAMESPACE)
    return [tuple(str(p) for p in path) for path in paths]


def identifier(parts: Sequence[str], empty: str) -> str:
    """A valid identifier from path parts (``('batch', 'input_ids')`` -> ``batch_input_ids``)."""
    text = "_".join(p for p in (_NOT_IDENT.sub("_", part).strip("_") for part in parts) if p) or empty
    if text[0].isdigit() or keyword.iskeyword(text):
        text = f"_{text}"
    return text


def unique(names: Sequence[str]) -> list[str]:
    """Names made unique by suffixes, first occurrence kept as is."""
    seen: set[str] = set()
    out = []
    for name in names:
        candidate, k = name, 1
        while candidate in seen:
            k += 1
            candidate = f"{name}_{k}"
        seen.add(candidate)
        out.append(candidate)
    return out


def output_names(tree: Any, leaves: Sequence[Any]) -> list[str]:
    """Default output names: ``output`` for a lone leaf, keys/paths otherwise (``logits``, ``out_0``)."""
    names = []
    for path in leaf_paths(tree, leaves):
        name = identifier(path, "output")
        names.append(f"out{name}" if name.startswith("_") and name[1:2].isdigit() else name)
    return unique(names)


def puttable(tree: Any, path: Sequence[Any]) -> bool:
    """Whether ``put`` can replace the node at ``path`` in trees shaped as ``tree``."""
    return blocking(tree, path) is None


def blocking(tree: Any, path: Sequence[Any]) -> str | None:
    """The type of the first node on ``path`` that ``put`` cannot rebuild, or ``None``."""
    node = tree
    for entry in path:
        if not isinstance(node, (tuple, list, MutableMapping)) and not dataclasses.is_dataclass(node):
            return type(node).__name__
        node = entry(node)
    return None


def put(tree: Any, path: tuple, value: Any) -> Any:
    """``tree`` with the node at ``path`` replaced by ``value`` (mappings and lists in place,
    tuples and frozen dataclasses rebuilt)."""
    if not path:
        return value
    entry = path[0]
    child = entry(tree)
    new = put(child, path[1:], value)
    if new is child:
        return tree
    key = entry.entry
    if isinstance(tree, MutableMapping):  # dicts, BatchEncodings, ModelOutputs (whose setitem sets the attribute too)
        tree[key] = new
        return tree
    if isinstance(tree, list):
        tree[key] = new
        return tree
    if isinstance(tree, tuple):
        items = list(tree)
        items[key] = new
        return tree._make(items) if hasattr(tree, "_make") else type(tree)(items)
    if dataclasses.is_dataclass(tree):
        try:
            setattr(tree, key, new)
            return tree
        except dataclasses.FrozenInstanceError:
            return dataclasses.replace(tree, **{key: new})
    raise ValueError(f"cannot put a value into a {type(tree).__name__}")
