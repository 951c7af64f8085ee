"""KV caches through one adapter: a decoder's cache object in, the same object updated out.

A HuggingFace decoder called with ``use_cache=True`` (the default) returns a cache object
(``DynamicCache``) and takes it back on the next step as ``cache=`` / ``past_key_values=``, which
it updates in place (each layer's ``keys`` / ``values`` replaced by longer tensors). A graph
takes tensors and returns tensors; this module is the one place that maps between the two, so
the lifecycle has no cache special cases, only hooks that ask this module:

- **Flatten.** In our pytree namespace (``trees.NAMESPACE``) a supported cache is a node whose
  children are one ``(key, value)`` pair per layer (``()`` for a layer not filled yet): 2 graph
  inputs per layer. Its context (per layer whether it is filled and its device, the cache's own
  settings) joins the call's structure, so an empty cache, a filled one and one of another
  layout are different keys. torch's pytree registry is not used nor needed: the tracer rebuilds
  the call from the fed leaves with ``unflatten``, so the export sees a fresh cache holding the
  traced tensors and the user's cache is never touched by a trace. An encoder-decoder's
  ``EncoderDecoderCache`` (two ``DynamicCache``s: self-attention, cross-attention) flattens to one
  ``(self key, self value, cross key, cross value)`` tuple per layer, with ``is_updated`` (which
  layers' cross-attention caches are filled) in its context: the decoder's first step (both
  empty) and its steps with past (both filled) are two keys, two graphs.
- **Unflatten** builds a cache of the same class holding the tensors as they are (the class's
  constructor would concatenate them into copies): cheap enough for every served step.
- **Names** (``renamed``): the leaves of a cache in the call are named ``past_key_values.{i}.key``
  / ``past_key_values.{i}.value`` and those in the output ``present.{i}.key`` / ``present.{i}.value``,
  as Optimum's ONNX exports and onnxruntime-genai (``genai_config.json``) name them, whatever the
  keyword (``cache=`` or ``past_key_values=``) and the output field (``cache``) are called; an
  encoder-decoder cache's ``past_key_values.{i}.decoder.key`` / ``past_key_values.{i}.encoder.key``
  (self- and cross-attention, as Optimum's seq2seq exports name them).
- **Dynamic axes** (``planned``): a call whose output holds a cache is a decoder step. Its
  capture asks for the past length of every cache input (axis 2, named ``past_sequence_length``)
  and every other input axis whose size is the output cache's length dynamic (the prompt in a
  prefill, named ``sequence_length``; the attention mask in a decode step, named
  ``total_sequence_length``; axis 0 of a rank-2+ input, the batch, never): a prefill then serves
  prompts of any length and the first decode step already serves every later one. A past of 1
  is asked dynamic as a declared axis is (the capture verifies the graph at 1). The length of a
  cross-attention cache, and every input axis as long as it (the encoder's output and mask),
  is named ``encoder_sequence_length``.
- **Write-back** (``writeback``): when eager returned the very cache object the call passed in
  (a decode step, or ``generate``'s prefill of the empty cache it made), serving a call writes the
  graph's present tensors into the caller's cache, as eager's update would, and returns that
  object in the output; a cache the call did not pass (a prefill with no cache) comes back as a
  new cache object, as eager's does.
- **Shipping** (``shipped``): a shipped graph's tree description holds a cache as a tuple of
  per-layer ``(key, value)`` pairs, so ``cr.load`` takes and returns that plain form (numpy in,
  numpy out) where no cache class is importable.
- **Refusal.** Every other ``transformers`` ``Cache`` subclass (``StaticCache``, quantized and
  offloaded caches...), a ``DynamicCache`` with other layer types (sliding-window layers:
  Mistral's default) or offloading, and an ``EncoderDecoderCache`` of anything else, flattens to a ``Refused`` leaf carrying why and the fix
  (``use_cache=False``): an input serves eagerly with that reason said once, an output refuses the
  capture with it.

Another cache class is supported by writing a ``CacheAdapter`` for it and listing it in
``_adapters_for``: nothing else in the library changes. Nothing here imports torch or transformers
at module level; the classes are registered on the first miss after ``transformers`` is imported.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Hashable, Iterable, Mapping, NamedTuple, Sequence

import optree

from clika_runtime.format.treedesc import type_name
from clika_runtime.trees import pytrees as trees
from clika_runtime.trees.key import Unkeyable

PAST = "past_key_values"  # graph input names: past_key_values.{layer}.key / .value
PRESENT = "present"  # graph output names: present.{layer}.key / .value
PAST_DIM = "past_sequence_length"  # the dim name of the past length of every cache input
SEQUENCE_DIM = "sequence_length"  # a prefill's (no cache in the call) inputs as long as its output cache
TOTAL_DIM = "total_sequence_length"  # a decode step's inputs as long as its output cache (the attention mask)
ENCODER_DIM = "encoder_sequence_length"  # the cross-attention cache's length, and inputs as long as it
KINDS = ("key", "value")
DECODER, ENCODER = "decoder", "encoder"  # an encoder-decoder cache's self- and cross-attention parts
SEQUENCE_AXIS = 2  # [batch, heads, sequence, head_dim]
_FIX = ("use the default cache (a DynamicCache; an EncoderDecoderCache of two), or call the model (or generate) "
        "with use_cache=False to serve it from a graph")


class Refused(Unkeyable):
    """The leaf a cache the adapter does not support flattens to: keying it raises why (an input
    serves eagerly, said once); an output holding it refuses the capture with the same words."""


class CacheAdapter:
    """How one cache class goes through a graph. ``cls`` is the class; the methods follow optree's
    conventions (``flatten`` -> children, context, entries; ``unflatten(context, children)``)."""

    cls: type

    def flatten(self, cache: Any) -> tuple[list[Any], Hashable, Sequence[Any]]:
        """One ``(key, value)`` pair per layer (``()`` for an empty layer), a hashable context
        enough to rebuild the cache, and the layer indices as entries. Returns
        ``refuse(cache, why)`` for a cache this adapter cannot serve."""
        raise NotImplementedError

    def unflatten(self, context: Any, children: Sequence[Any]) -> Any:
        """A cache of the same class holding ``children`` as they are (never read them: during an
        export and in ``calls.original_slots`` they are stand-ins, not tensors)."""
        raise NotImplementedError

    def adopt(self, target: Any, made: Any) -> None:
        """Make ``target`` (the caller's cache) hold what ``made`` (rebuilt from a graph's outputs)
        holds, exactly as the eager update would have left it."""
        raise NotImplementedError

    def slot(self, layer: int, index: int) -> Slot:
        """What the ``index``-th tensor of a layer's child is."""
        return Slot(layer, None, index)


class Slot(NamedTuple):
    """One tensor of a cache: its layer, its part (``DECODER`` / ``ENCODER`` in an encoder-decoder
    cache, ``None`` in a decoder's) and 0 for the key, 1 for the value."""

    layer: int
    part: str | None
    kind: int

    def name(self, prefix: str) -> str:
        """``past_key_values.0.key``; ``past_key_values.0.decoder.key`` in an encoder-decoder cache."""
        middle = f".{self.part}" if self.part else ""
        return f"{prefix}.{self.layer}{middle}.{KINDS[self.kind]}"


def refuse(cache: Any, why: str) -> tuple[list[Any], Hashable, Sequence[Any]]:
    """The flattening of a cache that cannot be served: one ``Refused`` leaf saying why."""
    name = type(cache).__name__
    return [Refused(f"a {name} ({why}) cannot go through a graph: {_FIX}")], ("refused", name, why), [name]


class DynamicCacheAdapter(CacheAdapter):
    """``transformers.DynamicCache`` of full-attention ``DynamicLayer`` layers (GPT-2, Llama,
    Qwen2, ... by default). A layer holds ``keys``, ``values`` ([batch, kv heads, sequence,
    head_dim]), ``is_initialized`` and, once filled, ``device``; the cache holds its layers and a
    few settings (``layer_class_to_replicate``, ``offloading``), kept in the context as they are."""

    _LAYER_STATE = frozenset({"keys", "values", "is_initialized", "device"})

    def __init__(self, cache_utils: Any) -> None:
        self.cls = cache_utils.DynamicCache
        self.layer = cache_utils.DynamicLayer

    def flatten(self, cache: Any) -> tuple[list[Any], Hashable, Sequence[Any]]:
        state = cache.__dict__
        if state.get("offloading"):
            return refuse(cache, "offloading layers to the CPU")
        layer_cls, children, layout = self.layer, [], []
        for layer in state["layers"]:
            if type(layer) is not layer_cls:
                return refuse(cache, f"{type(layer).__name__} layers; supported: {layer_cls.__name__}")
            own = layer.__dict__
            if own.keys() - self._LAYER_STATE:
                return refuse(cache, f"a {layer_cls.__name__} with unknown state {sorted(own.keys() - self._LAYER_STATE)}")
            if own["is_initialized"]:
                children.append((own["keys"], own["values"]))
                layout.append((True, own.get("device")))
            else:
                children.append(())
                layout.append((False, own.get("device")))
        settings = tuple((k, v) for k, v in state.items() if k != "layers")
        try:
            hash(settings)
        except TypeError:
            return refuse(cache, f"settings {[k for k, _ in settings]} that cannot key a capture")
        return children, (settings, tuple(layout)), range(len(children))

    def unflatten(self, context: Any, children: Sequence[Any]) -> Any:
        settings, layout = context
        layer_cls, layers = self.layer, []
        for (filled, device), pair in zip(layout, children):
            layer = layer_cls.__new__(layer_cls)
            if filled:
                layer.__dict__.update(keys=pair[0], values=pair[1], is_initialized=True)
            else:
                layer.__dict__.update(keys=None, values=None, is_initialized=False)
            if device is not None:
                layer.device = device
            layers.append(layer)
        cache = self.cls.__new__(self.cls)
        cache.__dict__["layers"] = layers
        cache.__dict__.update(settings)
        return cache

    def adopt(self, target: Any, made: Any) -> None:
        layers = target.layers
        for i, new in enumerate(made.layers):
            if i < len(layers):
                layers[i].__dict__.update(new.__dict__)
            else:  # a cache that grows its layers on first use (layer_class_to_replicate)
                layers.append(new)


class EncoderDecoderCacheAdapter(CacheAdapter):
    """``transformers.EncoderDecoderCache`` of two ``DynamicCache``s (T5, BART, Whisper... by
    default): ``self_attention_cache`` grows each decoder step, ``cross_attention_cache`` is filled
    from the encoder output by the first step and only read after it; ``is_updated`` (layer ->
    whether its cross-attention cache is filled) tells the attention which. A layer flattens to
    ``(self key, self value, cross key, cross value)`` (HuggingFace's legacy per-layer tuple) or
    ``()`` while both are empty; ``is_updated``, both caches' layouts and any settings beside them
    are the context, so a first step (empty) and a step with past (filled) are different keys: two
    graphs."""

    _PART_NAMES = ("self_attention_cache", "cross_attention_cache")
    _STATE = frozenset({*_PART_NAMES, "is_updated"})
    _PARTS = (DECODER, DECODER, ENCODER, ENCODER)

    def __init__(self, cache_utils: Any, dynamic: DynamicCacheAdapter) -> None:
        self.cls = cache_utils.EncoderDecoderCache
        self.dynamic = dynamic

    def flatten(self, cache: Any) -> tuple[list[Any], Hashable, Sequence[Any]]:
        state = cache.__dict__
        if self._STATE - state.keys():
            return refuse(cache, f"no {sorted(self._STATE - state.keys())}")
        # Settings beside the parts (``_is_user_defined``: generate marks a cache it was given) are
        # kept in the context as they are, as DynamicCache's are.
        settings = tuple((k, v) for k, v in state.items() if k not in self._STATE)
        try:
            hash(settings)
        except TypeError:
            return refuse(cache, f"settings {[k for k, _ in settings]} that cannot key a capture")
        parts = [state[name] for name in self._PART_NAMES]
        kinds = {type(part) for part in parts} - {self.dynamic.cls}
        if kinds:
            return refuse(cache, f"of {', '.join(sorted(k.__name__ for k in kinds))} caches; supported: DynamicCache parts")
        (own, own_context, _), (cross, cross_context, _) = flat = [self.dynamic.flatten(part) for part in parts]
        for field, (_, context, _) in zip(self._PART_NAMES, flat):
            if context[0] == "refused":  # ("refused", class name, why)
                return refuse(cache, f"its {field}: a {context[1]} with {context[2]}")
        if len(own) != len(cross) or any(bool(a) != bool(b) for a, b in zip(own, cross)):
            return refuse(cache, "layers whose self- and cross-attention caches are not filled together")
        updated = state["is_updated"]
        children = [(*a, *b) for a, b in zip(own, cross)]
        return children, (own_context, cross_context, tuple(updated.items()), settings), range(len(children))

    def unflatten(self, context: Any, children: Sequence[Any]) -> Any:
        own_context, cross_context, updated, settings = context
        cache = self.cls.__new__(self.cls)
        cache.__dict__.update(
            self_attention_cache=self.dynamic.unflatten(own_context, [layer[:2] for layer in children]),
            cross_attention_cache=self.dynamic.unflatten(cross_context, [layer[2:] for layer in children]),
            is_updated=dict(updated),
        )
        cache.__dict__.update(settings)
        return cache

    def adopt(self, target: Any, made: Any) -> None:
        self.dynamic.adopt(target.self_attention_cache, made.self_attention_cache)
        self.dynamic.adopt(target.cross_attention_cache, made.cross_attention_cache)
        target.is_updated.update(made.is_updated)

    def slot(self, layer: int, index: int) -> Slot:
        return Slot(layer, self._PARTS[index], index % 2)


# Adapters by the class they serve, made once ``transformers.cache_utils`` is imported.
_ADAPTERS: dict[type, CacheAdapter] = {}
_seen: set[type] = set()
_registering = threading.Lock()  # misses of different functions may register at once


def _adapters_for(cache_utils: Any) -> list[CacheAdapter]:
    """The supported cache classes of this ``transformers`` (add new adapters here)."""
    dynamic = DynamicCacheAdapter(cache_utils)
    return [dynamic, EncoderDecoderCacheAdapter(cache_utils, dynamic)]


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers KV cache (registered: supported or refused); what a
    call writes into one is the adapter's to replay (``writeback``), or the call runs eagerly."""
    return type(value) in _seen


def adapting() -> bool:
    """Whether any KV-cache class flattens through an adapter (transformers is imported)."""
    return bool(_ADAPTERS)


def register() -> None:
    """Register the cache classes of an imported ``transformers`` in our pytree namespace (cheap
    when nothing is new; called on every miss, before the call is flattened)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    base = getattr(cache_utils, "Cache", None)
    if not isinstance(base, type):
        return
    new = [cls for cls in _subclasses(base) if cls not in _seen]
    if not new:
        return
    with _registering:
        if not _ADAPTERS:
            for adapter in _adapters_for(cache_utils):
                trees.own(adapter.cls, adapter.flatten, _unless_refused(adapter.unflatten))
                _seen.add(adapter.cls)
                _ADAPTERS[adapter.cls] = adapter
        for cls in new:
            if cls not in _seen:  # caches no adapter serves: refused with the reason
                trees.own(cls, _refused_flatten, _refused_unflatten)
                _seen.add(cls)


def _subclasses(base: type) -> Iterable[type]:
    yield base
    for sub in base.__subclasses__():
        yield from _subclasses(sub)


def _refused_flatten(cache: Any) -> tuple[list[Any], Hashable, Sequence[Any]]:
    return refuse(cache, "not a cache type clika_runtime supports; supported: "
                  + (", ".join(sorted(c.__name__ for c in _ADAPTERS)) or "none"))


def _refused_unflatten(context: Any, children: Sequence[Any]) -> Any:
    return children[0]  # never served: keying the Refused leaf raises first


def _unless_refused(unflatten: Callable[[Any, Sequence[Any]], Any]) -> Callable[[Any, Sequence[Any]], Any]:
    """An adapter's ``unflatten`` that gives back the ``Refused`` leaf of a cache it refused (a
    call is rebuilt before it is keyed, to say why it serves eagerly)."""

    def rebuild(context: Any, children: Sequence[Any]) -> Any:
        if context[0] == "refused":
            return children[0]
        return unflatten(context, children)

    return rebuild


def _is_cache(value: Any) -> bool:
    return type(value) in _ADAPTERS


# ---------------------------------------------------------------------------------------------- names


def cache_leaves(structure: optree.PyTreeSpec) -> dict[int, Slot]:
    """Leaf index -> its ``Slot`` (layer, part, key or value) for every leaf a supported cache holds
    in a tree of this structure. Read from the structure, never from the tree: by the time a
    capture reads it, the eager call has updated the caches the call holds."""
    if not _ADAPTERS:
        return {}
    accessors = structure.accessors()
    found = {}
    for i, accessor in enumerate(accessors):
        for depth, entry in enumerate(accessor):
            if entry.type in _ADAPTERS and depth + 1 < len(accessor):
                found[i] = _ADAPTERS[entry.type].slot(int(entry.entry), int(accessor[depth + 1].entry))
                break
    return found


def renamed(structure: optree.PyTreeSpec, names: Sequence[str], prefix: str) -> list[str]:
    """``names`` (one per leaf of a tree of this structure, in flattening order) with the leaves of
    caches named ``{prefix}.{layer}.key`` / ``.value`` (``PAST`` for a call, ``PRESENT`` for an
    output; ``{prefix}.{layer}.decoder.key`` / ``.encoder.key`` in an encoder-decoder cache)."""
    names = list(names)
    for i, slot in cache_leaves(structure).items():
        names[i] = slot.name(prefix)
    return names


# ------------------------------------------------------------------------------------------ write-back


def writeback(call_tree: Any, eager_out: Any) -> Callable[[Any, tuple, dict], Any] | None:
    """How a served call updates the caller's cache, when eager returned a cache it was passed:
    ``finish(out, args, kwargs)`` writes the graph's present tensors (in ``out``) into the cache the
    canonical call ``(args, kwargs)`` holds and returns ``out`` holding that very object. ``None``
    when eager returned no cache it was passed (nothing to write back).

    Raises ``ValueError`` when the returned cache sits where an output cannot be rebuilt around it.
    """
    if not _ADAPTERS:
        return None
    inputs = _cache_paths(call_tree)
    pairs = []
    for out_path, made in _cache_paths(eager_out):
        source = next((path for path, given in inputs if given is made), None)
        if source is not None:
            _check_writable(eager_out, out_path)
            pairs.append((source, out_path, _ADAPTERS[type(made)].adopt))
    if not pairs:
        return None

    def finish(out: Any, args: tuple, kwargs: dict) -> Any:
        call = (args, kwargs)
        for source, out_path, adopt in pairs:
            mine = source(call)
            adopt(mine, out_path(out))
            out = trees.put(out, tuple(out_path), mine)
        return out

    return finish


def _cache_paths(tree: Any) -> list[tuple[Any, Any]]:
    """(accessor, cache) for every supported cache object in ``tree``."""
    accessors, leaves, _ = optree.tree_flatten_with_accessor(
        tree, is_leaf=_is_cache, none_is_leaf=True, namespace=trees.NAMESPACE
    )
    return [(a, leaf) for a, leaf in zip(accessors, leaves) if _is_cache(leaf)]


def _check_writable(tree: Any, path: Sequence[Any]) -> None:
    blocking = trees.blocking(tree, path)
    if blocking is not None:
        raise ValueError(f"a cache returned inside a {blocking}, which the adapter cannot rebuild")


# ------------------------------------------------------------------------------------------ shipping


def shipped(description: Mapping[str, Any]) -> dict[str, Any]:
    """A tree description (``treedesc.describe``) with every supported cache node described as a
    tuple of per-layer ``(key, value)`` pairs: what ``cr.load`` takes and returns for a cache."""
    names = {type_name(cls) for cls in _ADAPTERS}

    def walk(node: Mapping[str, Any]) -> dict[str, Any]:
        node = dict(node)
        if "children" in node:
            node["children"] = [walk(child) for child in node["children"]]
            if node.get("kind") == "custom" and node.get("type") in names:
                node.update(kind="tuple", type="builtins:tuple", cache=node["type"])
        return node

    return walk(description) if names else dict(description)
