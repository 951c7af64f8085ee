"""What atomic saves and the content digest cost, on BERT-base (random init), one process.

    python scripts/bench_integrity.py [--rounds 2] [--out DIR] [--params 600e6]

Captures ``transformers.BertModel(BertConfig())`` with ``cr.compile`` and ``take_graph()`` under
``torch.inference_mode()`` (the on-disk cache off), then times, interleaved in rounds (the
minimum of each is printed): saving it with the weights inline and with external data, as
``onnx.save_model`` wrote it before (in place, no digest) and as ``ModelGraph.save`` does
(beside, renamed, digest, flushed to the disk); and loading each file with ``cr.load`` and
``ModelGraph.load``, with the digest checked and with ``verify_digest=False``. ``--params N``
measures a graph of N float32 weights instead (a chain of 4096x4096 MatMuls, random weights, with
external data: past protobuf's 2 GB when N is 600 million), saved and loaded the same ways.
Figures go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ["CLIKA_RUNTIME_CACHE_DIR"] = ""  # captures from scratch, and nothing written to the user's cache

import onnx  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import clika_runtime as cr  # noqa: E402
from clika_runtime.format import digest, writing  # noqa: E402


def bert_graph() -> cr.ModelGraph:
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval()
    ids, mask = torch.randint(0, 30000, (2, 16)), torch.ones(2, 16, dtype=torch.int64)
    f = cr.compile(model)
    with torch.inference_mode():
        f(input_ids=ids, attention_mask=mask)
        f(input_ids=ids, attention_mask=mask)
        return f.take_graph()


def synthetic_graph(params: float) -> cr.ModelGraph:
    """A chain of 4096x4096 MatMuls holding about ``params`` float32 weights."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    width, rng = 4096, np.random.default_rng(0)
    count = max(1, round(params / width**2))
    weights = [numpy_helper.from_array(rng.standard_normal((width, width), dtype=np.float32) / width, f"w{i}")
               for i in range(count)]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", f"w{i}"], [f"h{i + 1}"]) for i in range(count)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info(f"h{count}", TensorProto.FLOAT, ["batch", width])],
                              initializer=weights)
    return cr.ModelGraph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def synthetic(params: float, out: Path, rounds: int) -> None:
    graph = synthetic_graph(params)
    path = out / "synthetic" / "chain.onnx"
    cases: dict[str, Callable[[], object]] = {
        "save external (ModelGraph.save)": lambda: graph.save(path, external_data=True),
        "cr.load": lambda: cr.load(path),
        "cr.load, verify_digest=False": lambda: cr.load(path, verify_digest=False),
        "ModelGraph.load": lambda: cr.ModelGraph.load(path),
        "ModelGraph.load, verify_digest=False": lambda: cr.ModelGraph.load(path, verify_digest=False),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    size = sum(p.stat().st_size for p in path.parent.iterdir())
    print(f"{params / 1e6:.0f}M weights, {size / 2**30:.2f} GiB with external data, {rounds} rounds (minimum)")
    for name, values in times.items():
        print(f"  {name:<52} {min(values):6.2f} s")


def saved_before(proto: onnx.ModelProto, path: Path, external: bool) -> None:
    """What ``save`` did before: ``onnx.save_model`` in place, the data file deleted first."""
    if external:
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        writing._mark_weights_external(copy, f"{path.name}.data")
        (path.parent / f"{path.name}.data").unlink(missing_ok=True)
        onnx.save_model(copy, str(path))
    else:
        onnx.save_model(proto, str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="folder for the files (default: a temporary one)")
    parser.add_argument("--params", type=float, help="a synthetic graph of this many weights instead of BERT-base")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_integrity_"))
    if args.params:
        return synthetic(args.params, out, args.rounds)
    graph = bert_graph()
    inline, external = out / "inline" / "bert.onnx", out / "external" / "bert.onnx"
    inline.parent.mkdir(parents=True, exist_ok=True)
    external.parent.mkdir(parents=True, exist_ok=True)
    cases: dict[str, Callable[[], object]] = {
        "save inline, before (onnx.save_model)": lambda: saved_before(graph.model_proto, out / "before.onnx", False),
        "save inline (ModelGraph.save)": lambda: graph.save(inline),
        "save external, before": lambda: saved_before(graph.model_proto, out / "before_ext.onnx", True),
        "save external (ModelGraph.save)": lambda: graph.save(external, external_data=True),
    }
    for name, path in (("inline", inline), ("external", external)):
        cases[f"cr.load {name}"] = lambda p=path: cr.load(p)
        cases[f"cr.load {name}, verify_digest=False"] = lambda p=path: cr.load(p, verify_digest=False)
        cases[f"ModelGraph.load {name}"] = lambda p=path: cr.ModelGraph.load(p)
        cases[f"ModelGraph.load {name}, verify_digest=False"] = lambda p=path: cr.ModelGraph.load(p, verify_digest=False)
    cases["digest.compute, inline file's bytes in memory"] = lambda: digest.compute(data, inline.parent, str(inline))
    times: dict[str, list[float]] = {name: [] for name in cases}
    data = b""
    for _ in range(args.rounds):
        for name, run in cases.items():
            if name.startswith("digest.compute"):
                data = inline.read_bytes()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    size = inline.stat().st_size
    print(f"BERT-base, {size / 2**20:.0f} MiB inline, {torch.get_num_threads()} torch threads, "
          f"{args.rounds} rounds (minimum)")
    for name, values in times.items():
        print(f"  {name:<52} {min(values):6.2f} s")


if __name__ == "__main__":
    main()
