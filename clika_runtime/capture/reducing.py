"""A capture's reduced-precision graph, written beside the graph it is made from.

int8 is made from the portable graph (``GraphFolder.model``), so the int8 graph a capture hands
out is standard ONNX. Where the fp32 capture serves a fused graph, the int8 graph is fused the
same way for serving (``GraphFolder.reduced_fused``): its weights' products stay int8, attention
runs in onnxruntime's ``MultiHeadAttention`` (BERT-base's kernel time at (1, 512), 2 threads:
110-112 ms against 116-123 ms for the int8 graph as exported; within 2% either way at (1, 128)
and (8, 128)). fp16 is made from the file the capture would serve at fp32 (``GraphFolder.opened``:
the fused graph where fusions apply). Each is made before any session opens. Whether it serves
is decided by its agreement with eager (``assembly``): below the agreement asked for, the fp32
graph serves and the capture says why.
"""

from __future__ import annotations

import logging
import time

import exporters
from clika_runtime.base import memory
from clika_runtime.base.errors import first_line
from clika_runtime.base.precision import FP16, INT8
from clika_runtime.shipped import graph as graph_mod
from serving import quantize

logger = logging.getLogger("clika_runtime")


def reduce(folder: graph_mod.GraphFolder, precision: str) -> str | None:
    """Write ``folder``'s graph at ``precision`` (``int8`` or ``fp16``); ``None`` when written,
    else why not, in words (the fp32 graph then serves)."""
    started = time.perf_counter()
    try:
        if precision == INT8:
            count = quantize.quantize_int8(str(folder.model), str(folder.reduced))
        elif precision == FP16:
            count = quantize.to_fp16(str(folder.opened), str(folder.reduced))
        else:
            raise ValueError(f"no reduced precision {precision!r}")
    except Exception as e:  # the quantizer is not on the correctness path: fp32 still serves
        folder.drop_reduced()
        return f"the {precision} conversion failed ({type(e).__name__}: {first_line(e)})"
    finally:
        memory.give_back()  # the converter held the fp32 model in memory (several copies of its weights)
    if not count:
        folder.drop_reduced()
        return "the graph has no MatMul over a constant float32 weight to quantize" if precision == INT8 else \
            "the graph has no float32 weights to convert"
    if precision == INT8 and (folder.path / folder.FUSED).is_file():
        _fuse(folder)
    logger.debug("%s graph: %d ops converted in %.2f s", precision, count, time.perf_counter() - started)
    return None


def _fuse(folder: graph_mod.GraphFolder) -> None:
    """Write the int8 graph with onnxruntime's fused kernels beside it. A speed-up only: any
    failure leaves the int8 graph as exported to serve."""
    try:
        made = exporters.save_fused_copy(str(folder.reduced), str(folder.reduced_fused))
    except Exception as e:  # the rewriter is not on the correctness path
        logger.debug("no fused int8 graph: %s: %s", type(e).__name__, first_line(e))
        folder.drop_reduced_fused()
    else:
        logger.debug("int8 graph fused for onnxruntime: %s", ", ".join(f"{n} x{c}" for n, c in sorted(made.items())))
    finally:
        memory.give_back()
