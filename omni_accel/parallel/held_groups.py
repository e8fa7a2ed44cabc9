"""What becomes of a layout's process groups when what holds them is copied.

A process group is this process's connection to the other ranks. A deep copy stays in the process: it
shares the groups (the copy runs its collectives on them, one call after the other with the original's, as
two pipelines of one layout would). A pickle may be loaded in another process, which the groups cannot
reach: it is refused, with what to do instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

import torch.distributed as dist

from ..utils.copies import deepcopy_instance


def groups_among(values: Iterable[Any]) -> list[dist.ProcessGroup]:
    """The process groups among ``values`` and in the dicts, lists and tuples among them."""
    found = []
    for value in values:
        if isinstance(value, dist.ProcessGroup):
            found.append(value)
        elif isinstance(value, dict):
            found += groups_among(value.values())
        elif isinstance(value, list | tuple):
            found += groups_among(value)
    return found


def share_groups(values: Iterable[Any], memo: dict) -> None:
    """Makes the deep copy in progress (``memo``) keep the process groups among ``values`` as they are."""
    for group in groups_among(values):
        memo[id(group)] = group


def refuse_pickle(what: str) -> NoReturn:
    raise TypeError(
        f"{what} cannot be pickled: it holds process groups of a parallel layout, which connect this process "
        "to the other ranks and cannot be carried to another process. Call omni_accel.restore(pipe) first and "
        "pickle the Diffusers pipeline (accelerate it again where it is loaded), or pickle it before "
        "accelerate; within this process copy.deepcopy(pipe) copies it, sharing the groups."
    )


class HoldsGroups:
    """Mixin for an object holding process groups in its attributes: a deep copy shares them; pickling
    refuses while it holds any (one holding none pickles as usual)."""

    def __deepcopy__(self, memo: dict) -> Any:
        share_groups(vars(self).values(), memo)
        return deepcopy_instance(self, memo)

    def __copy__(self) -> Any:  # not by __reduce_ex__, which refuses
        twin = object.__new__(type(self))
        vars(twin).update(vars(self))
        return twin

    def __reduce_ex__(self, protocol: Any) -> Any:
        if groups_among(vars(self).values()):
            refuse_pickle(f"{type(self).__name__} (of an accelerated pipeline's layout)")
        return super().__reduce_ex__(protocol)
