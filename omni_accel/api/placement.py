"""Where a transformer computes (dtype and device, found as Diffusers finds them under offload,
quantization and layerwise casting) and which attention provider serves each of its attention sites.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import torch
from diffusers.models.modeling_utils import get_parameter_dtype
from torch import nn

from ..attention.base import AttentionProviderError, AttentionRequest
from ..attention.selection import (
    CATEGORIES,
    AttentionConfig,
    AttentionSelector,
    resolve,
    sites_listing,
    unknown_roles,
)
from ..models.registry import ModelSpec
from ..utils.logging import get_logger

logger = get_logger(__name__)


def native_sites(module: nn.Module, model, ring: bool = False) -> list[tuple[str, str, int, bool]]:
    """(role, category, head size, whether its calls need the log-sum-exp) of every attention site of the
    native blocks, once per role; under a ``ring`` layout a site that merges K/V blocks needs it
    (``AttentionSite.ring_merges``)."""
    rows = {}
    for list_name, native_cls in model.blocks.items():
        for block in module.get_submodule(list_name):
            for site in native_cls.sites:
                row = (site.role, site.category, native_cls.head_dim(block), ring and site.ring_merges)
                rows.setdefault(site.role, row)
    return list(rows.values())


def routed_sites(module: nn.Module, spec: ModelSpec) -> list[tuple[str, str, int | None, bool]]:
    """(role, category, head size if the module says, False) of every routed attention module, once per role
    (whether a call needs the log-sum-exp is known at the call: see ``parallel.routed_attention``)."""
    rows = {}
    for name, child in module.named_modules():
        if hasattr(child, "processor"):
            role, category = role_of(spec, name, child)
            head_dim = getattr(child, "head_dim", None)
            if head_dim is None and hasattr(child, "inner_dim") and getattr(child, "heads", 0):
                head_dim = child.inner_dim // child.heads
            rows.setdefault(role, (role, category, head_dim, False))
    return list(rows.values())


def check_attention(name: str, module: nn.Module, sites, selector: AttentionSelector) -> None:
    """Records the model's roles on ``selector`` (``check_roles`` checks the ``per_role`` keys against those
    of every component) and checks that every explicit choice can serve the model's compute dtype, device and
    head size, and the log-sum-exp where a ring layout merges with it: at accelerate, not at the first call
    (which it waits for where the dtype or device is not known before it)."""
    selector.know_sites(
        f"pipe.{name} ({type(module).__name__})", (site[0] for site in sites), (site[1] for site in sites)
    )
    placement = placement_of(module)
    try:
        resolve_rows([site for site in sites if site[2] is not None], placement, selector, strict=True)
    except AttentionProviderError as exc:
        merging = [site[0] for site in sites if site[3]]
        if not merging:
            raise
        raise AttentionProviderError(
            f"{exc} (Under a ring layout the calls of {', '.join(merging)} merge the K/V blocks of the ranks "
            "through the log-sum-exp, which their provider must return.)"
        ) from None
    if placement.unknown is not None:
        logger.info("pipe.%s: attention providers are checked at the first call: %s", name, placement.unknown)


def check_roles(pipe: object, config: AttentionConfig, selectors: list[AttentionSelector]) -> None:
    """Every ``per_role`` key names a role or category of an attention site of the pipeline's components
    (``selectors``: theirs): a typo would otherwise change nothing. A role of any component is valid, as
    one config serves them all; a component without that role is not affected by it."""
    unknown = unknown_roles(config.per_role, selectors)
    if unknown:
        raise ValueError(
            f"AttentionConfig.per_role names {unknown}, which no transformer of {type(pipe).__name__} has, so "
            f"it would change nothing. Its attention sites: {sites_listing(selectors)}. Use one of those roles "
            f"or categories (the categories {sorted(CATEGORIES)} fit every model), or leave the key out."
        )


@dataclass(frozen=True)
class _Placement:
    """The dtype and device a transformer computes its attention in, found as Diffusers finds them; None
    where they cannot be known before the first call (``unknown`` says why)."""

    dtype: torch.dtype | None
    device: torch.device | None
    unknown: str | None = None


_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def placement_of(module: nn.Module) -> _Placement:
    """Not the first parameter's dtype and device: under layerwise casting, GGUF or other quantization the
    weights are stored in another dtype than the one the model computes in, and under offload (sequential,
    group, ``device_map``) they sit on the CPU or on ``meta`` while the model runs on its execution device."""
    dtype = compute_dtype(module)
    device = _execution_device(module)
    reasons = []
    if dtype is None:
        stored = str(get_parameter_dtype(module)).removeprefix("torch.")
        reasons.append(
            f"its weights are stored in {stored} and neither layerwise casting nor a quantization config says "
            "which dtype it computes in"
        )
    if device is None:
        reasons.append(
            "its weights are on the meta device and no offload hook names the device it runs on (not an "
            "attention matter: load the weights, e.g. load_state_dict(..., assign=True), or enable an offload "
            "before the first call)"
        )
    return _Placement(dtype, device, "; ".join(reasons) or None)


def compute_dtype(module: nn.Module) -> torch.dtype | None:
    """The quantizer's compute dtype (GGUF and the like dequantize to it), else Diffusers' ``model.dtype``:
    layerwise casting's compute dtype, else the first floating-point weight's outside the fp32-kept modules."""
    quantizer = getattr(module, "hf_quantizer", None)
    dtype = getattr(quantizer, "compute_dtype", None) or get_parameter_dtype(module)
    return dtype if dtype in _COMPUTE_DTYPES else None


def _execution_device(module: nn.Module) -> torch.device | None:
    """Where ``module`` runs, as a Diffusers pipeline's ``_execution_device`` finds it: a group-offload hook's
    onload device, an accelerate hook's execution device (model or sequential CPU offload, ``device_map``),
    else where its weights are; None when they are all on ``meta`` with nothing to load them."""
    for submodule in module.modules():
        registry = submodule.__dict__.get("_diffusers_hook")
        group = registry.get_hook("group_offloading") if registry is not None else None
        if group is not None:
            return torch.device(group.group.onload_device)
        hook = submodule.__dict__.get("_hf_hook")
        for part in getattr(hook, "hooks", (hook,)) if hook is not None else ():
            device = getattr(part, "execution_device", None)
            if device is not None:
                return torch.device(device)
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if not tensor.is_meta:
            return tensor.device
    return None


def resolve_rows(
    sites, placement: _Placement, selector: AttentionSelector, strict: bool
) -> list[tuple[str, str, str, str]]:
    """(role, request, provider, reason) per site; an error row (or, ``strict``, the error) where a choice
    cannot serve, and a deferred row where the placement is not known before the first call."""
    if placement.unknown is not None:
        return [(site[0], "known at the first call", "deferred", placement.unknown) for site in sites]
    device = placement.device
    on_gpu = device.type == "cuda" and torch.cuda.is_available()  # a hook may name CUDA before it exists here
    capability = torch.cuda.get_device_capability(device) if on_gpu else None
    rows = []
    for role, category, head_dim, needs_lse in sites:
        request = AttentionRequest(
            placement.dtype, device.type, head_dim, needs_lse=needs_lse, compute_capability=capability
        )
        try:
            found = resolve(selector.config, role, category, request)
            rows.append((role, request.describe(), found.name, found.reason))
        except AttentionProviderError as exc:
            if strict:
                raise
            rows.append((role, request.describe(), "error", str(exc)))
    return rows


def role_of(spec: ModelSpec, module_name: str, module: nn.Module) -> tuple[str, str]:
    for pattern, role in spec.attention_roles.items():
        if re.fullmatch(pattern, module_name):
            return role
    category = "cross" if getattr(module, "is_cross_attention", False) is True else "self"
    return f"{spec.family}.{module_name.rpartition('.')[2]}", category
