"""Our sequence plan from the context-parallel plan a Diffusers model declares (``_cp_plan``), and our
tensor plan from its tensor-parallel one (``_tp_plan``).

Diffusers names, per submodule path (``""``: the model's forward; ``"blocks.*"``: every block of a list),
the arguments to split (``ContextParallelInput``), the outputs to split (the same with ``split_output``,
keyed by output index) and the outputs to gather (``ContextParallelOutput``). Taken as it is, the plan runs
through our hooks, exchanges and providers: Diffusers splits only lengths the ranks divide, we split any
length (uneven shares, exact), and its tensors' ``expected_dims`` become our ``Split.ndim`` (a tensor of
another rank passes unsplit, as in Diffusers). The plan names no streams, so each split tensor is its own
stream and attention finds its tokens' spread by their length (``SequenceState.layout_of``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .sequence_hooks import SequencePlan, Split
from .tensor import Colwise, Rowwise, TensorPlan


def sequence_plan(module: nn.Module, cp_plan: Mapping[str, Any] | None) -> SequencePlan | None:
    """The SequencePlan of ``cp_plan`` (in Diffusers' form, for ``module``), or None for no plan."""
    if not cp_plan:
        return None
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    inputs: dict[str, Split] = {}
    submodule_inputs: dict[str, dict[str, Split]] = {}
    submodule_outputs: dict[str, dict[int, Split]] = {}
    gathers: dict[str, Split] = {}
    for pattern, entry in cp_plan.items():
        for path in _paths(module, pattern):
            if isinstance(entry, ContextParallelOutput | list | tuple):
                gathers[path] = _gather(entry, ContextParallelOutput, pattern)
                continue
            for key, value in entry.items():
                split = _split(value, ContextParallelInput, f"{pattern}:{key}" if pattern else key)
                if _value_of(value).split_output:
                    submodule_outputs.setdefault(path, {})[int(key)] = split
                elif path == "":
                    inputs[key] = split
                else:
                    submodule_inputs.setdefault(path, {})[key] = split
    if not gathers:
        raise ValueError(f"{type(module).__name__}'s _cp_plan gathers no output; it cannot run split.")
    first = next(iter(gathers))
    return SequencePlan(
        output=(first, gathers.pop(first)),
        inputs=inputs,
        submodule_inputs=submodule_inputs,
        submodule_outputs=submodule_outputs,
        gathers=gathers,
        empty_shares=False,
    )


def _value_of(value: Any) -> Any:
    """The one entry of a plan value given as a list (Diffusers' form for a list argument)."""
    return value[0] if isinstance(value, list | tuple) else value


def _split(value: Any, input_cls: type, stream: str) -> Split:
    entry = _value_of(value)
    if not isinstance(entry, input_cls) or (
        isinstance(value, list | tuple) and len({(v.split_dim, v.expected_dims) for v in value}) > 1
    ):
        raise ValueError(f"_cp_plan entry {stream!r}: {value!r} is not a split we know how to take.")
    return Split(stream, entry.split_dim, entry.expected_dims)


def _gather(value: Any, output_cls: type, path: str) -> Split:
    entry = _value_of(value)
    if not isinstance(entry, output_cls) or (isinstance(value, list | tuple) and len(value) > 1):
        raise ValueError(
            f"_cp_plan gathers {path!r} as {value!r}: one gathered output per submodule is supported."
        )
    return Split("", entry.gather_dim, entry.expected_dims)


def _paths(module: nn.Module, pattern: str) -> list[str]:
    """The submodule paths a plan key names: ``*`` stands for every index of a ModuleList."""
    paths = [""]
    for part in pattern.split(".") if pattern else []:
        if part != "*":
            paths = [f"{p}.{part}" if p else part for p in paths]
            continue
        expanded = []
        for p in paths:
            children = module.get_submodule(p)
            expanded += [f"{p}.{i}" if p else str(i) for i in range(len(children))]
        paths = expanded
    return [p for p in paths if p == "" or _has(module, p)]


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def tensor_plan(
    name: str, tp_plan: Mapping[str, Any] | None, instead: str = "ulysses, ring or cfg"
) -> dict[str, TensorPlan]:
    """Block list -> our TensorPlan of Diffusers' ``_tp_plan`` (``"<list>.*.<path>": "colwise" |
    "rowwise"``, or a packed projection: ``PackedColwiseParallel`` / ``PackedRowwiseParallel``), for a
    model whose processors Diffusers made indifferent to how many heads a rank holds (they take the head
    size from the module, the head count from the tensors). Another style raises, naming the entry and
    ``instead``: the layouts the model can take (without a _cp_plan, cfg alone)."""
    if not tp_plan:
        raise ValueError(
            f"tp splits the projections of native blocks or of a Diffusers _tp_plan, and {name} has neither; "
            f"use {instead} for it."
        )
    plans: dict[str, dict[str, Colwise | Rowwise]] = {}
    for pattern, style in tp_plan.items():
        list_name, star, path = pattern.partition(".*.")
        ours = _tensor_style(style)
        if not star or ours is None:
            raise ValueError(
                f"{name}'s _tp_plan entry {pattern!r}: {style!r} is not a split the generic tier takes yet "
                f"(only colwise / rowwise linears of repeated blocks, packed or not); use {instead}."
            )
        plans.setdefault(list_name, {})[path] = ours
    return plans


def _tensor_style(style: Any) -> Colwise | Rowwise | None:
    """Ours for one of Diffusers' tensor-parallel styles, or None."""
    if style == "colwise":
        return Colwise()
    if style == "rowwise":
        return Rowwise()
    kind = type(style).__name__
    blocks = tuple(getattr(style, "blocks", None) or ())
    if kind == "PackedColwiseParallel":
        return Colwise(ratios=blocks, ratios_attr="" if blocks else "_tp_packed_col_blocks")
    if kind == "PackedRowwiseParallel":
        return Rowwise(ratios=blocks, ratios_attr="" if blocks else "_tp_packed_row_blocks")
    return None
