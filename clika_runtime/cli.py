"""``clika-runtime`` / ``python -m clika_runtime``: inspect, validate, export and serve graphs."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from clika_runtime.base.errors import ClikaError

logger = logging.getLogger("clika_runtime")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (0 only when everything passed)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()  # inside the try: a reader gone (`| head -1`) surfaces here, not at exit
        return code
    except BrokenPipeError:
        # The reader closed the pipe: stop quietly, as a tool killed by SIGPIPE does (exit 141 =
        # 128 + SIGPIPE). stdout goes to devnull so the interpreter's final flush cannot raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    except (ClikaError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clika-runtime", description=__doc__)
    sub = parser.add_subparsers(required=True, metavar="command")

    p = sub.add_parser("inspect", help="inputs, outputs, dims, opset, ops, size and metadata of a graph")
    p.add_argument("model")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_inspect)

    p = sub.add_parser("validate", help="check, load and run a graph at several sizes; exit 1 on failure")
    p.add_argument("model", help="a .onnx file, or a Triton model folder (one holding config.pbtxt)")
    p.add_argument("--reference", help=".npz of arrays named after graph inputs and outputs")
    p.add_argument("--dims", nargs="*", action="extend", default=[], metavar="NAME=1,8,32",
                   help="sizes per dynamic dim (the flag may repeat)")
    p.add_argument("--place", default="cpu")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-digest", action="store_true", help="skip the content digest check (for files verified "
                   "another way)")
    p.set_defaults(run=_validate)

    _export_parser(sub)

    p = sub.add_parser("triton", help="write a graph as a Triton model (config.pbtxt + version folder)")
    p.add_argument("model", help="the .onnx file")
    p.add_argument("--repository", required=True, help="the model repository folder")
    p.add_argument("--name", help="model name (default: from the graph name)")
    p.add_argument("--version", type=int, default=1)
    p.add_argument("--max-batch-size", type=int, default=0, help="> 0 lets Triton batch along dim 0")
    p.add_argument("--dynamic-batching", action="store_true", help="Triton's dynamic batcher (needs --max-batch-size)")
    p.add_argument("--instances", type=int, default=1, help="model instances")
    p.add_argument("--gpu", action="store_true", help="instances on GPUs (KIND_GPU) instead of CPUs")
    p.add_argument("--no-digest", action="store_true", help="read the graph without checking its content digest")
    p.set_defaults(run=_triton)

    _serve_parser(sub)

    p = sub.add_parser("cache", help="show or clear the on-disk capture cache (config.cache_dir)")
    p.add_argument("action", choices=("info", "list", "clear"), nargs="?", default="info")
    p.add_argument("--dir", help="the cache directory (default: as config.cache_dir resolves it)")
    p.set_defaults(run=_cache)
    return parser


def _export_parser(sub: Any) -> None:
    """``export``'s arguments."""
    p = sub.add_parser("export", help="capture a callable once and save its graph")
    p.add_argument("factory", help="package.module:function returning the callable (e.g. a model)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--inputs", help="package.module:function returning example args (a tuple) or (args, kwargs)")
    source.add_argument("--signature", nargs="+", metavar="NAME:DTYPE[d0,d1]",
                        help="tensor inputs, e.g. 'x:float32[batch,8]' (str dims dynamic, ints static)")
    p.add_argument("--out", required=True, help="where to save the .onnx")
    p.add_argument("--dynamic", action="store_true",
                   help="every axis dynamic from the first capture, except axes of size 0 or 1 in the example "
                        "(torch.export specialises them: give examples of size >= 2 there; the output names them)")
    p.add_argument("--precision", choices=("fp32", "int8", "fp16"), default="fp32",
                   help="int8: onnxruntime's dynamic int8 (CPU), saved only when it agrees with eager fp32 by "
                        "clika_runtime.config.agreement (cosine >= 0.999 per float output); fp16 needs --place cuda")
    p.add_argument("--place", default=None, help="where the graph is captured and checked (default: cpu)")
    p.set_defaults(run=_export)


def _serve_parser(sub: Any) -> None:
    """``serve``'s arguments."""
    p = sub.add_parser("serve", help="serve a graph over the KServe v2 HTTP protocol on Ray Serve, with dynamic batching")
    p.add_argument("model")
    p.add_argument("--name", help="model name in URLs (default: the file's stem)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=8, help="rows per graph run when batching (1: no batching)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="longest wait for a batch to fill")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--place", default="cpu", help="where replicas run the graph: cpu, cuda, cuda:1, a provider name")
    p.add_argument("--max-request-mb", type=float, default=64.0, help="larger request bodies are refused unread")
    p.add_argument("--request-timeout-s", type=float, default=60.0,
                   help="a request not answered within this many seconds gets 408 (a replica that cannot restart "
                        "would otherwise hold it forever); 0 waits without limit")
    p.set_defaults(run=_serve)


def _inspect(args: argparse.Namespace) -> int:
    from clika_runtime.shipped.inspection import format_inspection, inspect_graph

    info = inspect_graph(args.model)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from clika_runtime.shipped.validation import validate_graph

    report = validate_graph(
        args.model, reference=args.reference, dims=_parse_dims(args.dims), place=args.place,
        rtol=args.rtol, atol=args.atol, verify_digest=not args.no_digest,
    )
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.table())
    return 0 if report.passed else 1


def _triton(args: argparse.Namespace) -> int:
    from clika_runtime.shipped.graph import ModelGraph

    graph = ModelGraph.load(args.model, verify_digest=not args.no_digest)
    _check_writable("--repository", args.repository, folder=True)
    folder = _written("--repository", args.repository, lambda: graph.to_triton(
        args.repository, args.name, version=args.version, max_batch_size=args.max_batch_size,
        dynamic_batching=args.dynamic_batching, instances=args.instances, kind="gpu" if args.gpu else "cpu",
    ))
    # Triton takes a local repository by its absolute path.
    print(f"wrote {folder} (version {args.version}); serve it with: "
          f"tritonserver --model-repository {Path(args.repository).resolve()}")
    return 0


def _cache(args: argparse.Namespace) -> int:
    from clika_runtime.base.config import config
    from clika_runtime.cache import diskcache

    if args.dir is not None:
        if not args.dir.strip():  # taken as unset, it would have meant the default cache: cleared
            raise ValueError("--dir: an empty path; give the cache folder, or leave --dir out for the default one")
        config.cache_dir = args.dir
    root = config.cache_path()
    if root is not None and not root.exists():  # reading a cache makes none
        print(f"{root}: no capture cache there (nothing was captured with it yet)")
        return 0
    cache = diskcache.active()
    if cache is None:
        print("the capture cache is off (config.cache_dir is None, or CLIKA_RUNTIME_CACHE_DIR is empty)")
        return 0
    if args.action == "clear":
        cache.clear()
        print(f"cleared {cache.root}")
    elif args.action == "list":
        for entry in cache.entries():
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used))
            print(f"{entry.key[:16]}  {entry.bytes / 2**20:8.1f} MiB  {used}  {entry.graph_name}({', '.join(entry.inputs)})")
    else:
        entries = cache.entries()
        print(f"{cache.root}: {len(entries)} entries, {cache.size() / 2**20:.1f} MiB of {cache.max_bytes / 2**20:.0f} MiB")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from clika_runtime.kserve.stopping import Stop  # no Ray: loads at once

    stop = Stop()
    stop.install()  # before Ray's imports, seconds long: a stop meanwhile ends the command cleanly
    try:
        try:
            from clika_runtime.kserve import deployment
        except ImportError as e:
            raise ValueError(f"serve needs Ray Serve: pip install 'clika-runtime[serve]' ({e})") from e
        deployment.run(
            args.model, name=args.name, host=args.host, port=args.port, place=args.place,
            max_batch_size=args.max_batch_size, batch_wait_ms=args.batch_wait_ms, replicas=args.replicas,
            max_request_mb=args.max_request_mb, request_timeout_s=args.request_timeout_s or None,
        )
    except KeyboardInterrupt:
        pass  # stopped before ``run`` started Ray (``run`` handles a stop from there on): nothing to stop
    finally:
        stop.restore()
    return 0


def _parse_dims(items: Sequence[str]) -> dict[str, list[int]]:
    dims: dict[str, list[int]] = {}
    for item in items:
        name, _, values = item.partition("=")
        try:
            sizes = [int(v) for v in values.split(",") if v]
        except ValueError:
            raise ValueError(f"--dims {item!r}: expected NAME=1,8,32") from None
        if not name or not sizes:
            raise ValueError(f"--dims {item!r}: expected NAME=1,8,32")
        if min(sizes) < 0:  # 0 is a size: the graph's guard decides whether it runs (a failed row if not)
            raise ValueError(f"--dims {item!r}: expected sizes >= 0, got {min(sizes)}")
        if name in dims:
            raise ValueError(f"--dims: {name} given twice ({','.join(map(str, dims[name]))} and {values}); "
                             f"give its sizes once: {name}=1,8,32")
        dims[name] = sizes
    return dims


def _load_object(spec: str) -> Any:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{spec!r}: expected package.module:function")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{spec!r}: cannot import {module}: {e}") from e
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec!r}: {module} has no attribute {name}")
        obj = getattr(obj, part)
    return obj


_SIGNATURE = re.compile(r"^(\w+):(\w+)\[(.*)\]$")


def parse_signature(items: Sequence[str]) -> list[Any]:
    """``['x:float32[batch,8]']`` -> ``[TensorSpec(('batch', 8), torch.float32, 'x')]``."""
    import torch

    from clika_runtime.base.specs import TensorSpec

    specs = []
    for item in items:
        match = _SIGNATURE.match(item.replace(" ", ""))
        if not match or match.group(2) not in _DTYPES:
            raise ValueError(f"--signature {item!r}: expected NAME:DTYPE[d0,d1,...] with DTYPE one of {_DTYPES}")
        name, dtype, dims = match.groups()
        shape = [int(d) if d.isdigit() else d for d in dims.split(",") if d]
        specs.append(TensorSpec(shape, getattr(torch, dtype), name))
    return specs


def _example(spec: Any) -> Any:
    import torch

    shape = [d if isinstance(d, int) else 3 for d in spec.shape]
    if spec.dtype.is_floating_point:
        return torch.randn(shape, dtype=spec.dtype)
    if spec.dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randint(0, 2, shape, dtype=spec.dtype)


def _export(args: argparse.Namespace) -> int:
    import torch

    from clika_runtime.base.errors import first_line
    from clika_runtime.function.compiled import CompiledFunction

    _check_writable("--out", args.out, folder=False)  # before the capture, which can take minutes
    target = _called(args.factory, _load_object(args.factory))
    if not callable(target):
        raise ValueError(f"{args.factory}: expected it to return a callable (a model or function), "
                         f"got {type(target).__name__}")
    options: dict[str, Any] = {"fullgraph": True, "dynamic": True if args.dynamic else None,
                               "precision": args.precision, "place": args.place}
    if args.signature:
        specs = parse_signature(args.signature)
        options["signature"] = specs
        call_args, call_kwargs = tuple(_example(s) for s in specs), {}
    else:
        example = _load_object(args.inputs)
        example = _called(args.inputs, example) if callable(example) else example  # a function, or the examples
        call_args, call_kwargs = example if _is_args_kwargs(example) else _as_args(example)
    f = CompiledFunction(target, **options)
    try:
        with torch.no_grad():
            f(*call_args, **call_kwargs)
    except ClikaError:
        raise
    except Exception as e:  # the model's own error on the examples: what it said, not its frames
        logger.debug("%s on the examples", args.factory, exc_info=e)
        source = args.inputs or "--signature"
        raise ValueError(f"{args.factory} raised {type(e).__name__} on the examples from {source} "
                         f"({_shapes(call_args, call_kwargs)}): {first_line(e)}; give examples the model takes") from None
    precision = f.captures[-1].precision  # the measured agreement, or why the precision asked for does not serve
    graph = f.take_graph()
    if args.precision != "fp32" and "clika_runtime.precision" not in graph.metadata:
        print(f"nothing saved: {precision}; keep --precision fp32, or quantize with a looser "
              f"clika_runtime.Agreement in Python (ModelGraph.quantized)", file=sys.stderr)
        return 1
    path = _written("--out", args.out, lambda: graph.save(args.out))
    print(f"saved {path} (inputs {f.input_names})" + (f"; {precision}" if args.precision != "fp32" else ""))
    for note in f.capture_notes:
        print(f"note: {note}")
    return 0


def _check_writable(flag: str, given: str, *, folder: bool) -> None:
    """``ValueError`` (one line, exit 2) when what is on disk shows that ``given`` cannot be written
    as a folder (``folder``) or a file: a regular file where a folder must be, a folder or a device
    where the file would go."""
    from clika_runtime.format.graphfile import kind

    if not folder and given.endswith(("/", os.sep)):  # Path() drops the '/' that says "a folder"
        raise ValueError(f"{flag} {given}: expected a file path, got one ending in '/'")
    path = Path(given)
    if path.exists() and not (path.is_dir() if folder else path.is_file()):
        raise ValueError(f"{flag} {given}: expected {'a folder' if folder else 'a file path'}, found {kind(path)}")
    above = next((p for p in path.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ValueError(f"{flag} {given}: expected a folder at {above}, found {kind(above)}")


def _written(flag: str, given: str, write: Callable[[], Any]) -> Any:
    """``write()``; an ``OSError`` as one line naming ``flag`` (exit 2), the traceback at DEBUG: what
    no look beforehand shows (/proc, /sys, a read-only mount, a full disk) shows only when writing."""
    try:
        return write()
    except OSError as e:
        logger.debug("writing %s %s", flag, given, exc_info=e)
        raise ValueError(f"{flag} {given}: expected a folder it can write in, got {e.strerror or e}") from None


def _called(spec: str, fn: Any) -> Any:
    """``fn()``; an error of its own as one line naming ``spec`` (the traceback at DEBUG)."""
    from clika_runtime.base.errors import first_line

    try:
        return fn()
    except Exception as e:
        logger.debug("calling %s", spec, exc_info=e)
        raise ValueError(f"{spec}: calling it raised {type(e).__name__}: {first_line(e)}") from None


def _shapes(call_args: tuple, call_kwargs: dict) -> str:
    """``shapes [3, 5], mask=[3]``: the examples as the error names them."""
    def shown(value: Any) -> str:
        return str(list(value.shape)) if hasattr(value, "shape") else type(value).__name__

    return "shapes " + ", ".join([shown(v) for v in call_args] + [f"{k}={shown(v)}" for k, v in call_kwargs.items()])


def _as_args(example: Any) -> tuple[tuple, dict]:
    return (tuple(example) if isinstance(example, (tuple, list)) else (example,)), {}


def _is_args_kwargs(example: Any) -> bool:
    return isinstance(example, tuple) and len(example) == 2 and isinstance(example[0], tuple) and isinstance(example[1], dict)
