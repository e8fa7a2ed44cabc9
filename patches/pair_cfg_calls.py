"""Marks the pipeline calls in which the transformer is called twice per step (cond, then uncond).

Target: one pipeline instance's ``__call__``. Python looks special methods up on the type, so the instance
gets a subclass of its own class (same name, so saved configs are unchanged) whose ``__call__`` switches
CFG pairing on when the model's rule says this call pairs, and checks that every pair completed. The rule
and the GuidanceBranches live on the instance, so a deep copy of the pipeline (of its own subclass) pairs
over its own copies of them. Pickling is refused with the reason: the branches pair over a layout's process
groups, which cannot go to another process (pickle would otherwise refuse the subclass, found by its base's
name, as "not the same object"). ``revert`` puts the original class back. Checked against diffusers 0.42
(FluxPipeline's true-CFG loop).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NoReturn

from ..utils.copies import deepcopy_instance

PACKAGE = "diffusers"
CHECKED_VERSIONS = ("0.42.0", "0.43.0")

_STATE = "_omni_cfg_pairing"  # on the instance: (the rule, the GuidanceBranches)


def apply(pipe: Any, pairs: Callable[[dict[str, Any]], bool], cfgs: list) -> None:
    """``pairs(arguments)`` says, from the bound call arguments, whether this call pairs its calls; ``cfgs``:
    the GuidanceBranches of every transformer the pipeline calls (Wan 2.2 has two experts)."""
    original = type(pipe)
    signature = inspect.signature(original.__call__)

    def __call__(self, *args, **kwargs):
        state = vars(self).get(_STATE)
        if state is None:  # made from this class by Diffusers (type(pipe).from_pipe(pipe)): a plain call
            return original.__call__(self, *args, **kwargs)
        rule, branches = state
        # with the call's defaults: a rule judging a call that leaves one out by a default of its own would
        # misjudge it (Qwen-Image's true_cfg_scale is 4.0 in its signature)
        bound = signature.bind_partial(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        for cfg in branches:
            cfg.pairing = rule(arguments)
        try:
            result = original.__call__(self, *args, **kwargs)
        except BaseException:
            for cfg in branches:
                cfg.finish_call(completed=False)
            raise
        for cfg in branches:
            cfg.finish_call(completed=True)
        return result

    namespace = {
        "__call__": __call__,
        "__module__": original.__module__,
        "__deepcopy__": deepcopy_instance,
        "__reduce_ex__": _refuse_pickle,
    }
    object.__setattr__(pipe, _STATE, (pairs, cfgs))
    pipe.__class__ = type(original.__name__, (original,), namespace)


def revert(pipe: Any) -> None:
    pipe.__class__ = type(pipe).__mro__[1]
    vars(pipe).pop(_STATE, None)


def _refuse_pickle(pipe: Any, protocol: Any) -> NoReturn:
    raise TypeError(
        f"This {type(pipe).__name__} pairs its guidance calls over a parallel layout's ranks and cannot be "
        "pickled: the layout's process groups cannot be carried to another process. Call "
        "omni_accel.restore(pipe) first and pickle the Diffusers pipeline, or pickle it before accelerate; "
        "within this process copy.deepcopy(pipe) copies it."
    )
