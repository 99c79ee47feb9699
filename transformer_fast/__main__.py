"""Command line: ``python -m transformer_fast {info,verify,train-demo}``."""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch


def _device_name(device: str) -> str:
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs)"
    return f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


# The (major, minor) versions the test suite has run on (the README's "Supported:" paragraph).
TESTED = {"python": ((3, 11), (3, 12)), "torch": ((2, 11), (2, 14)), "triton": ((3, 6), (3, 8))}


def untested_version_note(name: str, version: str) -> str | None:
    """A line saying that `version` of python / torch / triton is outside the tested range, or None."""
    try:
        minor = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    low, high = TESTED[name]
    if low <= minor <= high:
        return None
    return (f"note       {name} {version} is outside the versions transformer_fast is tested with "
            f"({name} {low[0]}.{low[1]}-{high[0]}.{high[1]})")


def cmd_info(args) -> int:
    from . import __version__, backends

    print(f"transformer_fast {__version__}")
    print(f"python     {platform.python_version()}")
    print(f"torch      {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    notes = [untested_version_note("python", platform.python_version()),
             untested_version_note("torch", torch.__version__)]
    ok, why = backends.triton_status()
    version = why.removeprefix("triton ") if ok else why
    print(f"triton     {version}{' [TRITON_INTERPRET=1]' if backends.triton_interpreting() else ''}")
    if ok:
        notes.append(untested_version_note("triton", version))
    for note in filter(None, notes):
        print(note)
    ok, why = backends.extension_status()
    print(f"_C         {why}")
    if ok:
        print(f"           {backends.extension_cuda_status()[1]}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        print(f"device     {device}: {_device_name(device)}")
        for name in backends.BACKENDS:
            ok, why = backends.available(name, device)
            print(f"  {name:<10} {'available' if ok else 'unavailable: ' + why}")
    if not torch.cuda.is_available():
        print("device     cuda: not available (no CUDA device visible to torch)")
    return 0


def cmd_verify(args) -> int:
    from . import verify

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("verify: --device cuda: no CUDA device visible to torch here", file=sys.stderr)
        return 2
    dtypes = [getattr(torch, d) for d in args.dtype] if args.dtype else verify.DTYPES
    # Fresh draws every run unless --seed replays one (torch's own start-up seed is fixed).
    seed = args.seed if args.seed is not None else torch.seed() % 2**31
    torch.manual_seed(seed)
    print(f"verify on {device}: {_device_name(device)} (--seed {seed} replays these draws)")
    jobs = args.jobs or (min(os.cpu_count() or 1, 16) if device == "cuda" else 1)
    rows = verify.verify(device, ops=args.op, dtypes=dtypes, backend_names=args.backend, jobs=jobs, seed=seed)
    table = verify.markdown_table(rows)
    print()
    print(table)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            f.write(f"# verify on {_device_name(device)}\n\n")
            f.write(f"torch {torch.__version__}, CUDA {torch.version.cuda}, --seed {seed}\n\n{table}\n")
    failed = [r for r in rows if r.status == "FAIL"]
    ran = [r for r in rows if r.status == "PASS"]
    peer = [r for r in rows if r.status == "PEER-OUTSIDE"]
    skipped = [r for r in rows if r.status == "SKIP"]
    print(f"\n{len(ran)} passed, {len(failed)} failed, {len(skipped)} skipped, "
          f"{len(peer)} peer rows outside the bound (informational)")
    if not ran and not failed and not peer:
        print("nothing was verified", file=sys.stderr)
        return 2
    return 1 if failed else 0


def cmd_train_demo(args, parser) -> int:
    from .models import demo

    if args.device == "cuda" and not torch.cuda.is_available():
        print("train-demo: --device cuda: no CUDA device visible to torch here", file=sys.stderr)
        return 2
    try:
        demo.check_args(args)
    except ValueError as exc:
        parser.error(str(exc))  # exit status 2, as argparse's own errors
    return demo.main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformer_fast")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, device, and which backends are available and why")
    p = verify_parser = sub.add_parser("verify", help="check every op x backend x dtype against the float64 oracle")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present")
    from . import backends, verify
    from .models import demo

    p.add_argument("--op", action="append", choices=list(verify.CASES), help="only this op (repeatable)")
    p.add_argument("--backend", action="append", choices=list(backends.BACKENDS),
                   help="only this backend (repeatable)")
    p.add_argument("--dtype", action="append", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--output", help="also write the table as markdown to this file")
    p.add_argument("--seed", type=int, help="seed of the random inputs (default: a fresh one, printed)")
    p.add_argument("--jobs", type=demo.int_at_least(0), default=0,
                   help="run the cases in this many processes (default: one per CPU core, at most "
                   "16, on CUDA, where compiling the Triton kernels dominates; 1 on the CPU)")
    demo_parser = sub.add_parser("train-demo", help="train a small Seq2SeqTransformer on copy/reverse/sort "
                                 "and report held-out exact-match accuracy", formatter_class=demo.HelpFormatter)
    demo.add_arguments(demo_parser)
    args = parser.parse_args(argv)
    try:
        backends.requested_backend()  # a bad TRANSFORMER_FAST_BACKEND: a usage error up front
    except ValueError as e:
        parser.error(str(e))
    if args.command == "verify":
        _check_output_path(verify_parser, args.output, "--output")
    if args.command == "train-demo":
        _check_output_path(demo_parser, args.out, "--out")
        return cmd_train_demo(args, demo_parser)
    commands = {"info": cmd_info, "verify": cmd_verify}
    return commands[args.command](args)


def _check_output_path(parser, path, flag: str) -> None:
    """``flag`` names a file to write: refused before any work if it is a directory or its
    folder cannot be made (a file is in the way)."""
    if not path:
        return
    if os.path.isdir(path):
        parser.error(f"{flag} {path!r} is a directory; expected a file path")
    folder = os.path.dirname(os.path.abspath(path))
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if folder and not os.path.isdir(folder):
        parser.error(f"{flag} {path!r}: {folder!r} is a file, not a folder")


if __name__ == "__main__":
    sys.exit(main())
