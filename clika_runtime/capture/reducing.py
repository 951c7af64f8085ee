"""A capture's reduced-precision graph, written beside the graph it is made from.

int8 is made from the portable graph (``GraphFolder.model``), whose attention is plain MatMuls
that run in int8 too (onnxruntime's fused ``MultiHeadAttention`` runs fp32 only: BERT-base at
(1, 512) served 27% faster from the portable graph), so the int8 graph is standard ONNX; fp16
from the file the capture would serve at fp32 (``GraphFolder.opened``: the fused graph where
fusions apply). Either is made before any session opens. Whether it serves is decided by its
agreement with eager (``assembly``): below the agreement asked for, the fp32 graph serves and the
capture says why.
"""

from __future__ import annotations

import logging
import time

from clika_runtime.base import memory
from clika_runtime.base.errors import first_line
from clika_runtime.base.precision import FP16, INT8
from clika_runtime.shipped.folder import GraphFolder
from serving import quantize

logger = logging.getLogger("clika_runtime")


def reduce(folder: GraphFolder, precision: str) -> str | None:
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
        return ("the graph has no MatMul over a constant float32 weight to quantize (a float16, bfloat16 or "
                "float64 model quantizes after model.float())") if precision == INT8 else \
            "the graph has no float32 weights to convert"
    logger.debug("%s graph: %d ops converted in %.2f s", precision, count, time.perf_counter() - started)
    return None
