"""What the kernel micro-benchmarks of ``benchmarks/kernel_bench.py`` share: their subcommands and options,
where a run happens (a CUDA GPU in bf16, or with ``--tiny`` the CPU in fp32 at small shapes), replays of
CUDA graphs, and how results and skipped measurements are reported.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .timing import graphed, timed, write_json


@dataclass
class Run:
    """One subcommand's run: its device and dtype, whether it is the small CPU smoke run (``tiny``), the
    results so far, and the measurements it could not make here (what -> why)."""

    tiny: bool
    device: str
    dtype: torch.dtype
    results: dict[str, Any]
    skipped: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, tiny: bool) -> Run:
        """The full run needs a CUDA GPU; ``tiny`` runs on the CPU, whatever the machine has."""
        if tiny:
            device, dtype, where = "cpu", torch.float32, {"device": "cpu"}
        elif torch.cuda.is_available():
            device, dtype, where = "cuda", torch.bfloat16, {"gpu": torch.cuda.get_device_name()}
        else:
            raise SystemExit("this benchmark needs a CUDA GPU; --tiny runs it at small shapes on the CPU")
        return cls(tiny, device, dtype, {**where, "torch": torch.__version__, "tiny": tiny})

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def generator(self) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(0)

    def randn(self, *size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=self.device, dtype=self.dtype)

    def skip(self, what: str, why: str) -> None:
        """Records a measurement this run cannot make; ``finish`` prints them all on one line."""
        self.skipped.setdefault(what, why)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def replay(
        self, fn: Callable[[], object], calls: int, capture_error_mode: str = "global"
    ) -> Callable[[], None]:
        """``calls`` back-to-back calls of ``fn`` as one CUDA graph's replay (no launch cost). Without CUDA
        the same calls run eagerly (after the same warm-up call), and the run says so."""
        if self.cuda:
            return graphed(fn, calls, capture_error_mode)
        self.skip("CUDA-graph replays", f"need CUDA: the calls run eagerly on {self.device}")
        fn()

        def eager() -> None:
            for _ in range(calls):
                fn()

        return eager

    def replayed_ms(self, fn: Callable[[], object], calls: int, replays: int) -> float:
        """Milliseconds per call: the median replay of ``calls`` calls (``replay``), divided by ``calls``."""
        replay = self.replay(fn, calls)
        return statistics.median(timed(replay, self.device)[1] / calls for _ in range(replays))

    def finish(self, path: str | None) -> dict[str, Any]:
        """Prints what was skipped (one line) and writes the results as JSON; under torchrun only rank 0."""
        if self.skipped:
            self.results["skipped"] = self.skipped
        if os.environ.get("RANK", "0") != "0":
            return self.results
        if self.skipped:
            by_reason: dict[str, list[str]] = {}
            for what, why in self.skipped.items():
                by_reason.setdefault(why, []).append(what)
            print(
                "skipped: " + "; ".join(f"{', '.join(map(repr, w))} ({why})" for why, w in by_reason.items())
            )
        write_json(self.results, path)
        return self.results


Measure = Callable[[Run, argparse.Namespace], None]


class Commands:
    """The subcommands of ``benchmarks/kernel_bench.py``: each takes ``--tiny`` and ``--out``, and options
    whose default depends on ``--tiny`` (``option``)."""

    def __init__(self, description: str) -> None:
        self.parser = argparse.ArgumentParser(
            description=description, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        self._subcommands = self.parser.add_subparsers(dest="command", required=True)
        self._common = argparse.ArgumentParser(add_help=False)
        self._common.add_argument(
            "--tiny",
            action="store_true",
            help="small shapes on the CPU in fp32, few iterations (a smoke run)",
        )
        self._common.add_argument("--out", help="write the results as JSON here")

    def add(self, name: str, measure: Measure) -> argparse.ArgumentParser:
        """A subcommand running ``measure``: its help is ``measure``'s docstring (the first paragraph in
        the list of subcommands)."""
        doc = inspect.cleandoc(measure.__doc__ or "")
        parser = self._subcommands.add_parser(
            name,
            parents=[self._common],
            help=doc.split("\n\n")[0].replace("\n", " "),
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.set_defaults(measure=measure, tiny_defaults={})
        return parser

    def parse(self, argv: list[str] | None) -> argparse.Namespace:
        """The arguments, each ``option`` left out given its full or its ``--tiny`` default."""
        args = self.parser.parse_args(argv)
        for dest, (full, tiny) in args.tiny_defaults.items():
            if getattr(args, dest) is None:
                setattr(args, dest, tiny if args.tiny else full)
        return args


def option(
    parser: argparse.ArgumentParser,
    flag: str,
    full: Any,
    tiny: Any,
    help: str,
    type: Callable[[str], Any] = int,
    nargs: str | None = None,
) -> None:
    """An option of a subcommand defaulting to ``full``, or to ``tiny`` with ``--tiny``."""
    parser.add_argument(flag, type=type, nargs=nargs, help=f"{help} (default {full}; {tiny} with --tiny)")
    dest = flag.lstrip("-").replace("-", "_")
    parser.set_defaults(tiny_defaults={**parser.get_default("tiny_defaults"), dest: (full, tiny)})
