"""What torch's eager fast paths compute that a trace of the same module does not.

``nn.TransformerEncoder`` in eval (without grad, no autocast, batched, with a key padding mask
and no attention mask) runs a padded batch as nested tensors and pads it back with zeros, before
its final norm: the padded positions come out as 0 (or the norm of a zero row). Under
torch.export it takes its other path (its mask check cannot run there), which computes those
positions like any other: a graph served them non-zero. Its check only takes the nested path
where every row's padding is at its end (``mask_check``, on by default).

While an export runs, each such encoder of the exported module answers, in the exporting thread,
as its eager fast path would: its traced output with the padded positions set to what that path
leaves there, where the mask is aligned as its check requires (computed in the graph, per call).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch


@contextlib.contextmanager
def encoders_as_in_eager(owner: torch.nn.Module | None) -> Iterator[None]:
    """While the block runs, the ``nn.TransformerEncoder`` modules of ``owner`` answer the
    exporting thread as their eager fast path does (the module docstring)."""
    encoders = [m for m in owner.modules() if isinstance(m, torch.nn.TransformerEncoder)] if owner is not None else []
    own = [(m, vars(m)["forward"]) if "forward" in vars(m) else (m, None) for m in encoders]
    here = threading.get_ident()
    for encoder, _ in own:
        encoder.forward = _as_in_eager(encoder, encoder.forward, here)
    try:
        yield
    finally:
        for encoder, patched in own:
            if patched is None:
                del encoder.forward
            else:
                encoder.forward = patched


def _as_in_eager(encoder: torch.nn.TransformerEncoder, forward: Callable[..., Any], here: int) -> Callable[..., Any]:
    def answered(src: torch.Tensor, mask: Any = None, src_key_padding_mask: Any = None, is_causal: Any = None) -> Any:
        out = forward(src, mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        if threading.get_ident() != here or not _nested_in_eager(encoder, src, mask, src_key_padding_mask):
            return out
        kept = src_key_padding_mask.logical_not()
        aligned = (kept[:, 1:] <= kept[:, :-1]).all() if getattr(encoder, "mask_check", True) else True
        zero = torch.zeros_like(src[:1, :1])
        fill = encoder.norm(zero) if encoder.norm is not None else zero
        return torch.where((kept.logical_not() & aligned)[..., None], fill, out)

    return answered


def _nested_in_eager(encoder: torch.nn.TransformerEncoder, src: torch.Tensor, mask: Any, padding: Any) -> bool:
    """The conditions of ``TransformerEncoder.forward``'s nested path that do not depend on
    values (torch 2.13; grad and autocast: a served call has neither)."""
    return bool(torch.backends.mha.get_fastpath_enabled() and getattr(encoder, "use_nested_tensor", False)
                and not encoder.layers[0].training and src.dim() == 3 and padding is not None and mask is None
                and src.device.type in ("cpu", "cuda"))
