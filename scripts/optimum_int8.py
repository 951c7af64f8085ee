"""Optimum's int8 of a saved model, for bench_precision.py to time beside ours (a peer, not a dependency).

    <a venv with optimum[onnxruntime] and transformers < 4.58>/bin/python scripts/optimum_int8.py MODEL_DIR OUT_DIR

MODEL_DIR: a model saved with ``save_pretrained`` (``bench_precision.py --save-models DIR`` writes
BERT-base and RoBERTa-base with the weights it measures). Exports it with Optimum
(``ORTModelForFeatureExtraction``, its ONNX export and onnxruntime optimisations at the level
Optimum applies by default) and quantizes it with ``ORTQuantizer`` and the ``avx512_vnni``
dynamic preset (U8S8, QOperator, per-tensor), as its documentation shows. Writes
OUT_DIR/model_quantized.onnx. Optimum needs transformers < 4.58: keep it in a venv of its own.
"""

from __future__ import annotations

import sys


def main() -> int:
    from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    source, out = sys.argv[1], sys.argv[2]
    model = ORTModelForFeatureExtraction.from_pretrained(source, export=True)
    model.save_pretrained(out)
    quantizer = ORTQuantizer.from_pretrained(out)
    quantizer.quantize(save_dir=out, quantization_config=AutoQuantizationConfig.avx512_vnni(is_static=False,
                                                                                           per_channel=False))
    print(f"{out}/model_quantized.onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
