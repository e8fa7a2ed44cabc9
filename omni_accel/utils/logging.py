"""The package logger, the way Diffusers users know it (``diffusers.utils.logging``).

Every module logs through ``get_logger(__name__)``, a child of the ``omni_accel`` logger, which writes
to stderr at NOTICE unless told otherwise: warnings, and the one line per pipeline that zero-code
acceleration (which the user's script does not name) accelerated. ``set_verbosity_info()`` (or
``OMNI_ACCEL_VERBOSITY=info`` in the environment) adds the one-line summary of each ``accelerate``;
``debug`` adds every attention decision; ``warning`` silences the notices. The library itself never prints.
"""

from __future__ import annotations

import logging
import os
import threading

_ROOT = "omni_accel"
# Between INFO and WARNING: what a user should see by default that is not a problem.
NOTICE = 25
logging.addLevelName(NOTICE, "NOTICE")
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "notice": NOTICE,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
_LOCK = threading.Lock()
_configured = False


def _default_level() -> int:
    name = os.environ.get("OMNI_ACCEL_VERBOSITY", "notice").lower()
    if name not in _LEVELS:
        logging.getLogger(_ROOT).warning(
            "OMNI_ACCEL_VERBOSITY=%r is not one of %s; using 'notice'.", name, ", ".join(_LEVELS)
        )
        return NOTICE
    return _LEVELS[name]


def _root() -> logging.Logger:
    global _configured
    root = logging.getLogger(_ROOT)
    with _LOCK:
        if not _configured:
            _configured = True
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[omni_accel] %(levelname)s %(message)s"))
            root.addHandler(handler)
            root.setLevel(_default_level())
            root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger of a module of this package (``name`` is its ``__name__``)."""
    _root()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def get_verbosity() -> int:
    return _root().getEffectiveLevel()


def set_verbosity(level: int | str) -> None:
    """A ``logging`` level or one of debug, info, notice, warning, error, critical."""
    _root().setLevel(_LEVELS[level.lower()] if isinstance(level, str) else level)


def set_verbosity_debug() -> None:
    set_verbosity(logging.DEBUG)


def set_verbosity_info() -> None:
    set_verbosity(logging.INFO)


def set_verbosity_warning() -> None:
    set_verbosity(logging.WARNING)


def set_verbosity_error() -> None:
    set_verbosity(logging.ERROR)
