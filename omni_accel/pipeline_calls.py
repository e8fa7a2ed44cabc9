"""Running something once, at a pipeline's first call, with that call's arguments.

``parallel="auto"`` decides its layout there: whether a call runs both guidance branches (FLUX's true CFG)
is only known from its arguments. Python looks ``__call__`` up on the type, so the instance gets a subclass
of its own class (same name and module: saved configs are unchanged) whose ``__call__`` puts the class back,
runs the action and then the call. An action that raises leaves the hook in place (the next call tries
again and says the same) and the pipeline as it was.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NoReturn

from .utils.copies import deepcopy_instance


def on_first_call(pipe: Any, action: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """Installs the hook; ``action`` gets the call's arguments by name, defaults included, and ``self`` (the
    pipeline: a rule may read its config, as the CFG pairing rules do). Returns the undo (a no-op once the
    first call has happened)."""
    original = type(pipe)
    signature = inspect.signature(original.__call__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        self.__class__ = original  # first: the action may give the class a patch of its own
        try:
            action(arguments)
        except BaseException:
            self.__class__ = hooked
            raise
        return self(*args, **kwargs)

    hooked = type(
        original.__name__,
        (original,),
        {
            "__call__": __call__,
            "__module__": original.__module__,
            "__deepcopy__": deepcopy_instance,
            "__reduce_ex__": _refuse_pickle,
        },
    )
    pipe.__class__ = hooked
    # A partial, not a closure: the undo a deep copy of the pipeline holds unhooks that copy.
    return functools.partial(_unhook, pipe, hooked, original)


def _refuse_pickle(pipe: Any, protocol: Any) -> NoReturn:
    raise TypeError(
        f"This {type(pipe).__name__} waits for its first call to finish what accelerate deferred (parallel='auto' "
        "chooses its layout from that call's arguments), and cannot be pickled: call omni_accel.restore(pipe) "
        "first, or pickle it before accelerate; within this process copy.deepcopy(pipe) copies it."
    )


def _unhook(pipe: Any, hooked: type, original: type) -> None:
    if type(pipe) is hooked:
        pipe.__class__ = original
