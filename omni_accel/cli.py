"""``omni-accel`` (also ``python -m omni_accel``): ``run`` a script accelerated, or check the machine with
``doctor``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"run": "omni_accel.run", "doctor": "omni_accel.doctor"}
    if not argv or argv[0] not in commands:
        sys.stderr.write("usage: omni-accel {run,doctor} ...   (omni-accel <command> --help for more)\n")
        return 2
    import importlib

    result = importlib.import_module(commands[argv[0]]).main(argv[1:])
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
