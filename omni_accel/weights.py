"""Strict transfer of weights between a Diffusers module and a native one, in both directions.

A model declares a ``WeightMap``: ordered ``(source_regex, target_template, shard_template)`` triples
mapping Diffusers names to native parameter names and, for packed layers, the shard (both templates may
use the regex groups). Loading fills every native parameter through its own
``weight_loader`` (so the layer applies its TP slicing) and fails with the exact missing and unexpected keys;
exporting runs the same map backwards, so restore and save_pretrained give the Diffusers layout bit for bit.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from .layers.linear import ColumnParallelLinear, default_weight_exporter, default_weight_loader

WeightRule = tuple[str, str, "str | None"]


class WeightLoadError(ValueError):
    """The source and native parameter sets do not match one to one."""


class WeightMap:
    def __init__(self, rules: Sequence[WeightRule]) -> None:
        self._rules = [(re.compile(f"^{pattern}$"), target, shard) for pattern, target, shard in rules]

    def target(self, source_name: str) -> tuple[str, str | None]:
        """The native parameter and shard a Diffusers tensor goes to (identity when no rule matches)."""
        for pattern, template, shard in self._rules:
            match = pattern.match(source_name)
            if match:
                return match.expand(template), match.expand(shard) if shard else None
        return source_name, None


def _expected_shards(native: nn.Module) -> dict[str, set[str | None]]:
    expected = {}
    for module_name, module in native.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            shards = set(module.full_sizes) if isinstance(module, ColumnParallelLinear) else {None}
            expected[full] = shards
    return expected


def _replace_parameter(native: nn.Module, name: str, tensor: torch.Tensor) -> nn.Parameter:
    """Swaps in a parameter holding ``tensor``, keeping the loader/exporter the layer attached."""
    owner, _, leaf = name.rpartition(".")
    module = native.get_submodule(owner)
    old = module._parameters[leaf]
    new = nn.Parameter(tensor, requires_grad=False)
    for attr in ("weight_loader", "weight_exporter"):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    module._parameters[leaf] = new
    return new


def load_weights(native: nn.Module, source: Mapping[str, torch.Tensor], weight_map: WeightMap) -> None:
    """Fills ``native`` from ``source`` (a Diffusers state dict); raises ``WeightLoadError`` on any mismatch."""
    params = dict(native.named_parameters())
    expected = _expected_shards(native)
    filled: dict[str, set[str | None]] = defaultdict(set)
    unexpected, errors = [], []
    for source_name, tensor in source.items():
        target, shard = weight_map.target(source_name)
        param = params.get(target)
        if param is None or shard not in expected[target]:
            unexpected.append(source_name)
            continue
        if shard in filled[target]:
            errors.append(f"{source_name}: {target} shard {shard!r} filled twice")
            continue
        try:
            loaded = getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
        except (ValueError, TypeError) as exc:
            errors.append(f"{source_name} -> {target}: {exc}")
            continue
        if loaded is not param.data:
            params[target] = _replace_parameter(native, target, loaded)
        filled[target].add(shard)
    missing = sorted(
        f"{name}" + (f"[{shard}]" if shard else "")
        for name, shards in expected.items()
        for shard in shards - filled[name]
    )
    if missing or unexpected or errors:
        lines = [f"Cannot load {type(native).__name__} strictly from the Diffusers weights."]
        if missing:
            lines.append(f"Missing native parameters ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"Unexpected source tensors ({len(unexpected)}): {', '.join(sorted(unexpected))}")
        lines.extend(errors)
        raise WeightLoadError("\n".join(lines))


def export_weights(
    native: nn.Module, source_names: Iterable[str], weight_map: WeightMap
) -> dict[str, torch.Tensor]:
    """The Diffusers-layout tensors for ``source_names``, rebuilt from the native parameters."""
    params = dict(native.named_parameters())
    exported = {}
    for source_name in source_names:
        target, shard = weight_map.target(source_name)
        param = params[target]
        exported[source_name] = getattr(param, "weight_exporter", default_weight_exporter)(param, shard)
    return exported
