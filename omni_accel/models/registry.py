"""The selection boundary: a Diffusers transformer class -> what omni_accel can do for it.

This is the only place (with the model files) where model names appear. A class that is not listed still
gets attention routing where its module, or the module of an attention processor it holds, calls
Diffusers' ``dispatch_attention_fn`` or (the classic processors) ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diffusers.models._modeling_parallel import ContextParallelInput
from torch import nn

from omni_accel.patches import functional_sdpa

if TYPE_CHECKING:
    from ..parallel.cfg import Pairing


@dataclass(frozen=True)
class ModelSpec:
    """What omni_accel knows about one Diffusers transformer class.

        ``native`` is the ``"module:Class"`` of a native implementation, if one exists. ``attention_routes``
        names the patches (in ``omni_accel.patches``) that route a Diffusers model's attention calls through our
        providers, each with the module it patches. ``attention_roles`` maps the attribute name of an attention
        module's full name (a regex, matched whole) to its ``(role, role_category)``. ``cache_sites`` are the
    full names (regexes) of a Diffusers model's single-input projections whose input repeats, reused through
    the exact projection cache.
    """

    family: str
    native: str | None = None
    # without native blocks: tells from a pipeline call's arguments whether it calls the transformer twice
    # per step (cond, then uncond), as a native model's ``cfg_pairing`` does
    cfg_pairing: Callable[[dict[str, Any]], Pairing] | None = None
    # without native blocks: tells from a pipeline call's arguments whether each transformer call holds both
    # guidance branches in its batch (what cfg=2 halves over the ranks); read by ``parallel="auto"``
    batched_guidance: Callable[[dict[str, Any]], bool] | None = None
    output_class: str = "diffusers.models.modeling_outputs:Transformer2DModelOutput"
    attention_routes: tuple[tuple[str, str], ...] = ()
    attention_roles: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    cache_sites: tuple[str, ...] = ()

    def native_model(self):
        """The model's ``NativeModel`` (see ``models.base``), or None."""
        return _import(self.native) if self.native else None


def _import(target: str):
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


def _qwenimage_true_cfg_pairs(arguments: dict[str, Any]) -> bool:
    """Qwen-Image's rule, imported when asked; a named function, so that a pipeline holding the spec
    pickles."""
    return _import("omni_accel.models.qwenimage:true_cfg_pairs")(arguments)


def _cfg_pairs_per_step(arguments: dict[str, Any]) -> Pairing:
    """Pipelines that call the transformer twice per step (cond, then uncond) while ``guidance_scale > 1``,
    asking their ``do_classifier_free_guidance`` at every step (a step-end callback may turn it off midway):
    CogView4's (and its Control), SkyReels-V2's (text-, image-to-video and diffusion forcing), LongCat-Image's
    (and its edit), Chroma's (text-to-image, img2img, inpaint), ChronoEdit's, Helios's (and its pyramid).
    ``guidance_scale > 1`` first, for ``parallel="auto"``'s verdict at the first call (a per-step verdict is a
    function, always true)."""
    if not arguments.get("guidance_scale", 1.0) > 1:
        return False
    return _import("omni_accel.parallel.cfg:guided_per_step")(arguments["self"])


def _lumina2_cfg_pairs(arguments: dict[str, Any]) -> Pairing:
    """Lumina-Image 2.0 pairs as :func:`_cfg_pairs_per_step` says while it guides every step: past
    ``cfg_trunc_ratio`` of the steps it makes one call a step (a ratio under 1: its calls run whole)."""
    return arguments.get("cfg_trunc_ratio", 1.0) >= 1 and _cfg_pairs_per_step(arguments)


def _hunyuan_video_true_cfg(arguments: dict[str, Any]) -> bool:
    """HunyuanVideo's pipelines (text-to-video, image-to-video, SkyReels image-to-video) call the transformer
    twice per step (cond, then uncond) under true CFG: ``true_cfg_scale > 1`` and a negative prompt or both its
    embeddings, decided once per call (``guidance_scale`` is an input of the guidance-distilled model)."""
    negative = arguments.get("negative_prompt") is not None or (
        arguments.get("negative_prompt_embeds") is not None
        and arguments.get("negative_pooled_prompt_embeds") is not None
    )
    return arguments.get("true_cfg_scale", 1.0) > 1 and negative


def _kandinsky5_cfg_pairs(arguments: dict[str, Any]) -> Pairing:
    """Kandinsky 5's pipelines (text-, image-to-video, text-, image-to-image) call the transformer twice per
    step while ``guidance_scale > 1`` (they encode the negative prompt then), asking ``pipe.guidance_scale``
    at every step (a step-end callback may lower it midway)."""
    if not arguments.get("guidance_scale", 5.0) > 1:
        return False
    return functools.partial(_scale_above_one, arguments["self"])


def _scale_above_one(pipe: Any) -> bool:
    return pipe.guidance_scale > 1


def _krea2_cfg_pairs(arguments: dict[str, Any]) -> Pairing:
    """Krea 2's pipeline calls the transformer twice per step while ``guidance_scale > 0`` (its
    ``do_classifier_free_guidance``: a scale of 1 still guides), asked at every step."""
    if not arguments.get("guidance_scale", 4.5) > 0:
        return False
    return _import("omni_accel.parallel.cfg:guided_per_step")(arguments["self"])


def _guidance_scale_above_one(arguments: dict[str, Any]) -> bool:
    """The Stable Diffusion 3 pipelines (text-to-image, img2img, inpaint, ControlNet, PAG) batch both guidance
    branches in each transformer call while ``guidance_scale > 1`` (their ``do_classifier_free_guidance``), as
    do PixArt-Alpha's and PixArt-Sigma's (and its PAG; a PAG call's batch, not one of samples, runs whole on
    each rank: ``models.generic``), HunyuanDiT's (and its ControlNet, PAG), CogVideoX's (text-, image-,
    video-to-video, Fun Control), LTX-Video's (text-, image-to-video, condition), Allegro's, Mochi's, Latte's,
    EasyAnimate's (and its control, inpaint), AuraFlow's and Lumina-Next's; Ovis-Image's and
    NucleusMoE-Image's call the transformer twice per step then, decided once per call."""
    return arguments.get("guidance_scale", 7.0) > 1


def _sana_batched_guidance(arguments: dict[str, Any]) -> bool:
    """Sana's pipelines (text-to-image, ControlNet, PAG) batch both branches while ``guidance_scale > 1`` (their
    ``do_classifier_free_guidance``); Sana Sprint's, on the same transformer, define no such thing and never
    guide: their ``guidance_scale`` is an input of the guidance-distilled model."""
    guides = hasattr(type(arguments["self"]), "do_classifier_free_guidance")
    return guides and _guidance_scale_above_one(arguments)


_TRANSFORMERS = "diffusers.models.transformers"

# Wan and Wan VACE share their attention (Diffusers' WanAttnProcessor) and their cache sites.
_WAN_ROUTES = dict(
    attention_routes=(("dispatch_attention", f"{_TRANSFORMERS}.transformer_wan"),),
    attention_roles={r".*\.attn1": ("wan.self", "self"), r".*\.attn2": ("wan.cross", "cross")},
    cache_sites=(
        r"(vace_)?blocks\.\d+\.attn2\.to_[kv]",  # text K/V: the same at every step of a request
        r"condition_embedder\.time_embedder",  # timestep MLP: shared by both CFG branches
        r"condition_embedder\.time_proj",
        r"condition_embedder\.text_embedder",
    ),
)

_SPECS: dict[str, ModelSpec] = {
    "FluxTransformer2DModel": ModelSpec(
        family="flux",
        native="omni_accel.models.flux:FLUX",
        attention_routes=(("dispatch_attention", f"{_TRANSFORMERS}.transformer_flux"),),
        attention_roles={
            r"transformer_blocks\.\d+\.attn": ("flux.joint", "self"),
            r"single_transformer_blocks\.\d+\.attn": ("flux.single", "self"),
        },
    ),
    "Flux2Transformer2DModel": ModelSpec(
        family="flux2",
        native="omni_accel.models.flux2:FLUX2",
        output_class=f"{_TRANSFORMERS}.transformer_flux2:Flux2Transformer2DModelOutput",
        attention_routes=(("dispatch_attention", f"{_TRANSFORMERS}.transformer_flux2"),),
        attention_roles={
            r"transformer_blocks\.\d+\.attn": ("flux2.joint", "self"),
            r"single_transformer_blocks\.\d+\.attn": ("flux2.single", "self"),
        },
    ),
    "WanTransformer3DModel": ModelSpec(family="wan", native="omni_accel.models.wan:WAN", **_WAN_ROUTES),
    "WanVACETransformer3DModel": ModelSpec(
        family="wan", native="omni_accel.models.wan:WAN_VACE", **_WAN_ROUTES
    ),
    "QwenImageTransformer2DModel": ModelSpec(
        family="qwenimage",
        native="omni_accel.models.qwenimage:QWEN_IMAGE",
        # with native=False (the generic tier) the same rule as the native model's
        cfg_pairing=_qwenimage_true_cfg_pairs,
        attention_routes=(("dispatch_attention", f"{_TRANSFORMERS}.transformer_qwenimage"),),
        attention_roles={r".*\.attn": ("qwenimage.joint", "self")},
    ),
    "ZImageTransformer2DModel": ModelSpec(
        family="zimage",
        native="omni_accel.models.zimage:ZIMAGE",
        attention_routes=(("dispatch_attention", f"{_TRANSFORMERS}.transformer_z_image"),),
        attention_roles={r".*\.attention": ("zimage.self", "self")},
    ),
    "MiniMaxH3Transformer3DModel": ModelSpec(
        family="minimax_h3",
        native="omni_accel.models.minimax_h3:MINIMAX_H3",
        output_class=f"{_TRANSFORMERS}.transformer_minimax_h3:MiniMaxH3TransformerOutput",
        attention_routes=(("dispatch_attention", f"{_TRANSFORMERS}.transformer_minimax_h3"),),
        attention_roles={
            r"token_refiner\.refiner_blocks\.\d+\.attn": ("minimax_h3.refiner", "self"),
            r"transformer_blocks\.\d+\.attn": ("minimax_h3.self", "self"),
        },
    ),
    "SD3Transformer2DModel": ModelSpec(
        family="sd3",
        batched_guidance=_guidance_scale_above_one,
        attention_routes=(("functional_sdpa", "diffusers.models.attention_processor"),),
        attention_roles={r".*\.attn": ("sd3.joint", "self"), r".*\.attn2": ("sd3.self", "self")},
    ),
}


# Models of the generic tier (no spec above: their attention routes found as for any model) whose pipelines
# guidance rule is known: ``cfg_pairing`` where they call the model twice per step (cond, then uncond),
# ``batched_guidance`` where each call holds both branches (as ``ModelSpec``'s).
_GENERIC_GUIDANCE: dict[str, dict[str, Callable[[dict[str, Any]], Pairing]]] = {
    "CogView4Transformer2DModel": {"cfg_pairing": _cfg_pairs_per_step},
    "SkyReelsV2Transformer3DModel": {"cfg_pairing": _cfg_pairs_per_step},
    "LongCatImageTransformer2DModel": {"cfg_pairing": _cfg_pairs_per_step},
    "ChromaTransformer2DModel": {"cfg_pairing": _cfg_pairs_per_step},
    "ChronoEditTransformer3DModel": {"cfg_pairing": _cfg_pairs_per_step},
    "HeliosTransformer3DModel": {"cfg_pairing": _cfg_pairs_per_step},
    "OvisImageTransformer2DModel": {"cfg_pairing": _guidance_scale_above_one},
    "Lumina2Transformer2DModel": {"cfg_pairing": _lumina2_cfg_pairs},
    "HunyuanVideoTransformer3DModel": {"cfg_pairing": _hunyuan_video_true_cfg},
    "Kandinsky5Transformer3DModel": {"cfg_pairing": _kandinsky5_cfg_pairs},
    "Krea2Transformer2DModel": {"cfg_pairing": _krea2_cfg_pairs},
    "NucleusMoEImageTransformer2DModel": {"cfg_pairing": _guidance_scale_above_one},
    "PixArtTransformer2DModel": {"batched_guidance": _guidance_scale_above_one},
    "SanaTransformer2DModel": {"batched_guidance": _sana_batched_guidance},
    "HunyuanDiT2DModel": {"batched_guidance": _guidance_scale_above_one},
    "CogVideoXTransformer3DModel": {"batched_guidance": _guidance_scale_above_one},
    "LTXVideoTransformer3DModel": {"batched_guidance": _guidance_scale_above_one},
    "AllegroTransformer3DModel": {"batched_guidance": _guidance_scale_above_one},
    "MochiTransformer3DModel": {"batched_guidance": _guidance_scale_above_one},
    "LatteTransformer3DModel": {"batched_guidance": _guidance_scale_above_one},
    "EasyAnimateTransformer3DModel": {"batched_guidance": _guidance_scale_above_one},
    "AuraFlowTransformer2DModel": {"batched_guidance": _guidance_scale_above_one},
    "LuminaNextDiT2DModel": {"batched_guidance": _guidance_scale_above_one},
}


# ControlNet residuals a forward adds to its image tokens: split as they are (by the same sizes, being as long).
_RESIDUALS = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)

# What Diffusers' `_cp_plan` of a class lacks, in its own form, merged over it (``cp_plan``).
_CP_PLAN_ADDITIONS: dict[str, dict[str, Any]] = {
    # Their plans split the image tokens but not the ControlNet residuals added to them, whole beside a slice.
    "FluxTransformer2DModel": {
        "": {"controlnet_block_samples": _RESIDUALS, "controlnet_single_block_samples": _RESIDUALS},
    },
    "QwenImageTransformer2DModel": {"": {"controlnet_block_samples": _RESIDUALS}},
    # LTX-2's plan splits the video RoPE but not the one its audio<->video cross-attentions rotate the
    # video tokens with (`cross_attn_rope`), so those calls meet a whole table beside split tokens.
    "LTX2VideoTransformer3DModel": {
        "cross_attn_rope": {
            0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True),
            1: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True),
        },
    },
}


# Arguments of a forward without a batch dimension that ``batch_dim_arguments`` cannot tell from a call: a
# tuple of RoPE tables, as long as the sequence, beside a batch of two looks like a list of one tensor per
# sample, and the call would run whole on every rank under cfg=2.
_UNBATCHED_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "HunyuanDiT2DModel": ("image_rotary_emb",),
    "CogVideoXTransformer3DModel": ("image_rotary_emb",),
    "AllegroTransformer3DModel": ("image_rotary_emb",),
}


def unbatched_arguments(transformer: nn.Module) -> tuple[str, ...]:
    """The forward arguments of ``transformer``'s class (or the closest listed class in its MRO) that hold no
    batch dimension although a call cannot tell (``_UNBATCHED_ARGUMENTS``)."""
    for cls in type(transformer).__mro__:
        if cls.__name__ in _UNBATCHED_ARGUMENTS and cls.__module__.startswith("diffusers."):
            return _UNBATCHED_ARGUMENTS[cls.__name__]
    return ()


# Models without native blocks whose Diffusers code defeats our kernels in one place: the ``module:function``
# that replaces that place, ``function(transformer) -> (what describe says, undos)``.
_GENERIC_ADAPTATIONS: dict[str, str] = {
    # a dense [S, S] mask expanded from the text padding in every block
    "HunyuanVideo15Transformer3DModel": "omni_accel.models.hunyuan_video15:adapt",
}


def generic_adaptation(
    transformer: nn.Module,
) -> Callable[[nn.Module], tuple[str, list[Callable[[], None]]]] | None:
    """The adaptation of ``transformer``'s class (or the closest class in its MRO), or None."""
    for cls in type(transformer).__mro__:
        if cls.__name__ in _GENERIC_ADAPTATIONS and cls.__module__.startswith("diffusers."):
            return _import(_GENERIC_ADAPTATIONS[cls.__name__])
    return None


def cp_plan(transformer: nn.Module) -> dict[str, Any] | None:
    """The context-parallel plan ``transformer``'s class declares (``_cp_plan``) with our additions where it
    lacks something, or None where it declares none."""
    declared = getattr(type(transformer), "_cp_plan", None)
    if not declared:
        return None
    plan = dict(declared)
    for cls in type(transformer).__mro__:
        for path, entry in _CP_PLAN_ADDITIONS.get(cls.__name__, {}).items():
            plan[path] = {**plan.get(path, {}), **entry}
    return plan


def registered_spec(transformer: nn.Module) -> ModelSpec | None:
    """The spec of the closest registered class in ``transformer``'s MRO, or None."""
    for cls in type(transformer).__mro__:
        if cls.__name__ in _SPECS and cls.__module__.startswith("diffusers."):
            return _SPECS[cls.__name__]
    return None


def spec_for(transformer: nn.Module) -> ModelSpec | None:
    """The registered spec, or a generic one routing the attention call sites of the model's module and of
    its attention processors' modules (with its pipelines' guidance rule, where known), or None."""
    registered = registered_spec(transformer)
    if registered is not None:
        return registered
    routes = tuple(route for name in sorted(_attention_modules(transformer)) for route in _routes_of(name))
    if not routes:
        return None
    guidance = next(
        (
            _GENERIC_GUIDANCE[cls.__name__]
            for cls in type(transformer).__mro__
            if cls.__name__ in _GENERIC_GUIDANCE and cls.__module__.startswith("diffusers.")
        ),
        {},
    )
    return ModelSpec(family="generic", attention_routes=routes, **guidance)


def _attention_modules(transformer: nn.Module) -> set[str]:
    """The module of the model's class and of each attention processor it holds now."""
    names = {type(transformer).__module__}
    if "_modules" in vars(
        transformer
    ):  # an instance whose __init__ ran (the registry is also asked of bare ones)
        for module in transformer.modules():
            processor = module.__dict__.get("processor")
            if processor is not None:
                names.add(type(processor).__module__)
    return names


def _routes_of(module_name: str) -> list[tuple[str, str]]:
    """The patches that route a Diffusers module's attention calls: its ``dispatch_attention_fn``, and its
    ``F.scaled_dot_product_attention`` where it binds ``F`` (the classic processors and some models' own)."""
    module = sys.modules.get(module_name)
    if module is None or not module_name.startswith("diffusers."):
        return []
    routes = []
    if hasattr(module, "dispatch_attention_fn"):
        routes.append(("dispatch_attention", module_name))
    if functional_sdpa.binds_functional(module):
        routes.append(("functional_sdpa", module_name))
    return routes


def registered_natives() -> list[str]:
    """Diffusers classes with a native implementation."""
    return sorted(name for name, spec in _SPECS.items() if spec.native)


def output_class(spec: ModelSpec) -> type:
    return _import(spec.output_class)
