"""CI graph validation on a small zoo: capture each workload at two sizes, check the graph matches
eager (clika_runtime.testing), save it, validate the file as `clika-runtime validate` does, and
write it as a Triton model (batching along dim 0 where the graph allows it) checked against
Triton's schema and rules (`clika_runtime.triton.checker.check_repository`).

Exit code 0 only when every graph passed. Run by the test suite (tests/test_zoo.py).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import build  # noqa: E402

from clika_runtime.base.errors import DeployError
from clika_runtime.testing import assert_graph_matches_eager  # noqa: E402
from clika_runtime.triton.checker import check_repository
from clika_runtime.shipped.validation import validate_graph


def main() -> int:
    torch.set_num_threads(1)
    failed = []
    with tempfile.TemporaryDirectory() as folder:
        for workload in build():
            examples = [workload.inputs(size) for size in workload.sizes]
            try:
                f = assert_graph_matches_eager(workload.model, examples, rtol=1e-4, atol=1e-4)
            except AssertionError as e:
                print(f"{workload.name}: graph does not match eager: {e}")
                failed.append(workload.name)
                continue
            graph = f.take_graph()
            path = graph.save(Path(folder) / f"{workload.name}.onnx")
            report = validate_graph(path)
            print(report.table().replace(str(path), workload.name))
            try:
                model = graph.to_triton(Path(folder) / "triton", workload.name, max_batch_size=8)
            except DeployError as refused:  # no dynamic batch axis: Triton takes it without batching
                print(f"triton: no batching ({refused})")
                model = graph.to_triton(Path(folder) / "triton", workload.name)
            problems = check_repository(model)
            print(f"triton model {model.name}: " + ("config.pbtxt agrees with the graph" if not problems
                                                   else "; ".join(problems)), end="\n\n")
            if not report.passed or problems:
                failed.append(workload.name)
    print("zoo:", "all graphs valid" if not failed else f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
