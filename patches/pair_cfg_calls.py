"""Marks the pipeline calls in which the transformer is called twice per step (cond, then uncond).

Target: one pipeline instance's ``__call__``. Python looks special methods up on the type, so the instance
gets a subclass of its own class (same name, so saved configs are unchanged) whose ``__call__`` switches
CFG pairing on when the model's rule says this call pairs, and checks that every pair completed. ``revert``
puts the original class back. Checked against diffusers 0.42 (FluxPipeline's true-CFG loop).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

PACKAGE = "diffusers"
CHECKED_VERSIONS = ("0.42.0", "0.43.0")


def apply(pipe: Any, pairs: Callable[[dict[str, Any]], bool], cfgs: list) -> None:
    """``pairs(arguments)`` says, from the bound call arguments, whether this call pairs its calls; ``cfgs``:
    the GuidanceBranches of every transformer the pipeline calls (Wan 2.2 has two experts)."""
    original = type(pipe)
    signature = inspect.signature(original.__call__)

    def __call__(self, *args, **kwargs):
        arguments = signature.bind_partial(self, *args, **kwargs).arguments
        for cfg in cfgs:
            cfg.pairing = pairs(arguments)
        try:
            result = original.__call__(self, *args, **kwargs)
        except BaseException:
            for cfg in cfgs:
                cfg.finish_call(completed=False)
            raise
        for cfg in cfgs:
            cfg.finish_call(completed=True)
        return result

    pipe.__class__ = type(
        original.__name__, (original,), {"__call__": __call__, "__module__": original.__module__}
    )


def revert(pipe: Any) -> None:
    pipe.__class__ = type(pipe).__mro__[1]
