"""Run an unmodified Diffusers script with every pipeline it builds accelerated.

    python -m omni_accel.run [options] my_script.py [script args]
    omni-accel run [options] my_script.py [script args]
    torchrun --nproc-per-node 2 -m omni_accel.run --ulysses 2 my_script.py [script args]

Options come from the flags below, or from the environment (OMNI_ACCEL_ATTENTION, OMNI_ACCEL_COMPILE,
OMNI_ACCEL_CUDA_GRAPHS, OMNI_ACCEL_PARALLEL, OMNI_ACCEL_PROJECTION_CACHE_BYTES, OMNI_ACCEL_QUANTIZE); flags win. Under torchrun
every rank runs the whole script: a script that saves files should save on one rank (``omni_accel.is_main_process()``), or
every rank writes the same file.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import zipfile
from typing import Any

from . import auto
from .attention import provider_names
from .parallel.config import ParallelConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-accel run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--attention", choices=["auto", *provider_names()])
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="compile the repeated blocks (default: the generic tier's on CUDA)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="replay each step as a CUDA graph (default: on for one CUDA device)",
    )
    parser.add_argument("--projection-cache-bytes", type=int)
    parser.add_argument("--quantize", choices=["fp8"], help="lossy FP8 projections (docs/quantization.md)")
    for degree in ("tp", "ulysses", "ring", "cfg"):
        parser.add_argument(f"--{degree}", type=int, help="parallel degree (launch with torchrun)")
    parser.add_argument(
        "--auto-parallel", action="store_true", help="a layout chosen for the model and the ranks started"
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    options = auto.options_from_env()
    if args.attention:
        options["attention"] = args.attention
    if args.compile is not None:
        options["compile"] = args.compile
    if args.cuda_graphs is not None:
        options["cuda_graphs"] = args.cuda_graphs
    if args.projection_cache_bytes is not None:
        options["projection_cache_bytes"] = args.projection_cache_bytes
    if args.quantize:
        options["quantize"] = args.quantize
    # ``is not None``: a degree of 0 is ParallelConfig's to refuse, not to drop.
    degrees = {d: getattr(args, d) for d in ("tp", "ulysses", "ring", "cfg") if getattr(args, d) is not None}
    if degrees and args.auto_parallel:
        raise ValueError("give --auto-parallel or parallel degrees, not both")
    if degrees:
        options["parallel"] = ParallelConfig(**degrees)
    elif args.auto_parallel:
        options["parallel"] = "auto"
    return options


def script_args(argv: list[str], args: argparse.Namespace) -> list[str]:
    """The script's arguments as given: argparse drops a ``--`` right after the script's name (taking it for
    the end of our options), which ``python script.py -- ...`` hands to the script."""
    tail = len(argv) - len(args.args)
    if tail >= 2 and argv[tail - 1] == "--" and argv[tail - 2] == args.script:
        return argv[tail - 1 :]
    return args.args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if not os.path.exists(args.script):  # a file, or a folder or zip with a __main__.py (as python runs)
        parser.error(f"no script at {args.script!r}")
    try:  # a wrong option (flag or OMNI_ACCEL_*) is a usage error: its message, exit status 2, no traceback
        auto.enable(**options_from_args(args))
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [args.script, *script_args(argv, args)]
    if os.path.isfile(args.script) and not zipfile.is_zipfile(args.script):
        # As `python script.py` does: the script imports the modules beside it (runpy puts a folder or zip
        # on the path itself, not a file's folder).
        sys.path.insert(0, os.path.dirname(os.path.realpath(args.script)))
    # Absolute, as Python makes a script's __file__ and the folder or zip it puts on the path (runpy makes
    # sys.argv[0] the path it runs, so that is absolute too, where Python keeps it as given).
    try:
        runpy.run_path(os.path.abspath(args.script), run_name="__main__")
    finally:
        auto.disable()
        sys.argv, sys.path[:] = saved_argv, saved_path


if __name__ == "__main__":
    main()
