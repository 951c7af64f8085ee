"""What atomic saves and the content digest cost, on BERT-base (random init), one process.

    python scripts/bench_integrity.py [--rounds 2] [--out DIR]

Captures ``transformers.BertModel(BertConfig())`` with ``cr.compile`` and ``take_graph()`` under
``torch.inference_mode()`` (the on-disk cache off), then times, interleaved in rounds (the
minimum of each is printed): saving it with the weights inline and with external data, as
``onnx.save_model`` wrote it before (in place, no digest) and as ``ModelGraph.save`` does
(beside, renamed, digest, flushed to the disk); and loading each file with ``cr.load`` and
``ModelGraph.load``, with the digest checked and with ``verify_digest=False``. Figures go to
docs/BENCHMARKS.md.
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
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_integrity_"))
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
