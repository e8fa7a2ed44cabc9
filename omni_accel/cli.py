"""``omni-accel`` (also ``python -m omni_accel``): ``run`` a script accelerated, or check the machine with
``doctor``.

The top level parses its own arguments before anything imports torch, so ``--help`` and ``--version``
answer at once; a command's module (and torch with it) is imported only to run that command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

_COMMANDS = {
    "run": ("omni_accel.run", "run an unmodified Diffusers script with every pipeline it builds accelerated"),
    "doctor": ("omni_accel.doctor", "say what can run on this machine (providers, compile, backends)"),
}


def _parser() -> argparse.ArgumentParser:
    commands = "\n".join(f"  {name:<8}{summary}" for name, (_, summary) in _COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="omni-accel",
        description="Diffusers pipelines made faster, with the same outputs and the same API.",
        epilog=f"commands:\n{commands}\n\n`omni-accel <command> --help` lists a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"omni-accel {__version__}")
    parser.add_argument("command", choices=list(_COMMANDS), help="what to do (see below)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _COMMANDS:
        command, rest = argv[0], argv[1:]
    else:
        try:  # --help / --version exit 0; a missing or unknown command exits 2
            command, rest = _parser().parse_args(argv).command, []
        except SystemExit as done:
            return int(done.code or 0)
    module = importlib.import_module(_COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
