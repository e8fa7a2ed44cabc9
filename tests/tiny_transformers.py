"""Tiny random instances of every transformer class the installed Diffusers exports, for the coverage test
and ``benchmarks/coverage_table.py``.

The classes are listed by introspection (``exported_transformers``), so a Diffusers upgrade that adds a
family shows up here without a code change. Each is built from its own ``__init__`` defaults scaled down by
generic rules (one layer, two heads of 16 channels, every width 32), with per-class overrides only where a
rule cannot work, and fed inputs derived from its ``forward`` signature (per-class recipes where the
generic ones cannot be right). A class that cannot be built says why in ``NOT_BUILT``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import re
import traceback
import types
from collections.abc import Callable
from typing import Any

import diffusers
import diffusers.models
import torch
from diffusers import DiffusionPipeline, ModelMixin
from diffusers.models.embeddings import (
    get_1d_rotary_pos_embed,
    get_2d_rotary_pos_embed,
    get_2d_rotary_pos_embed_lumina,
)
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMRefinerKVCache
from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline
from diffusers.pipelines.ideogram4.pipeline_ideogram4 import Ideogram4Pipeline
from diffusers.pipelines.omnigen.processor_omnigen import OmniGenCollator
from diffusers.pipelines.sana_wm.cam_utils import prepare_camera
from torch import nn

import omni_accel
from omni_accel.models.generic import repeated_blocks
from omni_accel.models.registry import spec_for
from omni_accel.parallel.diffusers_plan import tensor_plan

TOLERANCE = 1e-5
BATCH = 2
TEXT_TOKENS = 5
WIDTH = 32  # every hidden, text and conditioning width
HEADS = 2
HEAD_DIM = 16  # HEADS * HEAD_DIM == WIDTH
FFN = 64
_TRANSFORMERS = "diffusers.models.transformers."


def exported_transformers() -> dict[str, type[ModelMixin]]:
    """Every ``ModelMixin`` class exported by ``diffusers`` or ``diffusers.models`` whose home is
    ``diffusers.models.transformers.*``, by name."""
    found: dict[str, type[ModelMixin]] = {}
    for namespace in (diffusers, diffusers.models):
        for name in dir(namespace):
            try:
                obj = getattr(namespace, name)
            except Exception:  # an optional dependency missing behind a lazy import
                continue
            if (
                inspect.isclass(obj)
                and issubclass(obj, ModelMixin)
                and obj.__module__.startswith(_TRANSFORMERS)
            ):
                found[obj.__name__] = obj
    return dict(sorted(found.items()))


# ---------------------------------------------------------------------------------------------------------
# Config: generic rules on the names of ``__init__`` parameters (first match wins; None keeps the default).


def _rope_axes(default: Any) -> Any:
    """RoPE axis splits sum to the head dim: 16 split over the same number of axes, each even."""
    if not isinstance(default, (tuple, list)) or not default:
        return None
    n = len(default)
    if HEAD_DIM % (2 * n):
        parts = [HEAD_DIM // n // 2 * 2] * n
        parts[0] += HEAD_DIM - sum(parts)
    else:
        parts = [HEAD_DIM // n] * n
    return type(default)(parts)


def _scalar(value: int) -> Callable[[Any], int | None]:
    """A rule for integer parameters only (a tuple default, e.g. a list of layer indices, is kept)."""
    return lambda default: value if isinstance(default, int) else None


_RULES: list[tuple[str, Callable[[Any], Any]]] = [
    (r".*(head_dim|dim_head|d_kv)", _scalar(HEAD_DIM)),
    (r".*heads", _scalar(HEADS)),
    (r"(num_|n_|n)?(.*_)?(layers|depth|blocks)", _scalar(1)),
    (r"(axes_dims?(_rope|_a)?|axes_dim_rope|rope_axes_dim|rope_dim_list|rope_dim|mrope_section)", _rope_axes),
    (r".*(ffn|ff|intermediate|mlp)_?(dim|size|hidden_size|inner_dim|hidden_dim)|d_ff", _scalar(FFN)),
    (
        r"(hidden_size|dim|model_dim|embed_dim|dit_dim|token_dim|d_model|.*_dim(_\d)?|.*_channels_?\w*"
        r"|.*_embed_dim|.*_feat_dim|.*_size)",
        _scalar(WIDTH),
    ),
]
# Parameters the width rule must leave alone: input/output channels, sizes of inputs and tables.
_KEEP = re.compile(
    r"(in_channels|out_channels|in_dim|out_dim|in_visual_dim|out_visual_dim|latent_dim|latent_channel"
    r"|io_channels|patch_size|patch_size_t|sample_size|pos_embed_max_size|vocab_size|.*_vocab_size"
    r"|max_position_embeddings|.*codebook_size|.*patch_latent_dim|input_dims|audio_in_channels"
    r"|audio_out_channels|audio_patch_size.*|vace_in_channels|.*batch_size|.*window.*|tile_sizes"
    r"|compressed_patch_size|image_size|chunk_size|.*_lens?|text_len.*|.*_max_pos|audio_hop_length)"
)


def tiny_config(cls: type[ModelMixin], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``cls``'s ``__init__`` defaults, scaled down by the generic rules, then ``overrides``."""
    config: dict[str, Any] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        default = param.default
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if default is inspect.Parameter.empty or default is None or isinstance(default, (bool, str, float)):
            continue
        if _KEEP.fullmatch(name):
            continue
        for pattern, rule in _RULES:
            if re.fullmatch(pattern, name):
                value = rule(default)
                if value is not None:
                    config[name] = value
                break
    config.update(overrides or {})
    return config


# ---------------------------------------------------------------------------------------------------------
# Inputs: generic recipes by forward argument name; ``hidden_states`` is tried in several layouts.


@dataclasses.dataclass
class Shapes:
    """The sizes a recipe draws from; ``layout`` is how ``hidden_states`` is laid out."""

    layout: str  # "image" [B, C, H, W], "video" [B, C, F, H, W] or "tokens" [B, N, C]
    height: int = 4
    width: int = 4
    frames: int = 2
    text: int = TEXT_TOKENS


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _channels(config: Any) -> int:
    for key in ("in_channels", "in_dim", "in_visual_dim", "io_channels", "latent_channel", "latent_dim"):
        value = config.get(key)
        if isinstance(value, int):
            return value
    return 4


def _patch(config: Any) -> tuple[int, int]:
    """(temporal, spatial) patch size."""
    p = config.get("patch_size", 1) or 1
    if isinstance(p, (tuple, list)):
        return (p[0], p[-1]) if len(p) == 3 else (1, p[-1])
    return (config.get("patch_size_t") or 1, p)


def _positions(tokens: int, grid_h: int, grid_w: int, axes: int = 3) -> torch.Tensor:
    """FLUX-style [tokens, axes] ids: (0..., row, column) of each token."""
    h, w = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    ids = torch.zeros(grid_h * grid_w, axes)
    ids[:, -2], ids[:, -1] = h.flatten(), w.flatten()
    return ids[:tokens]


def generic_inputs(model: nn.Module, shapes: Shapes, seed: int = 1, strict: bool = True) -> dict[str, Any]:
    """Inputs for ``model.forward``'s required arguments (and the optional ones whose name says what they
    are and that the model would otherwise lack), from its config; ``strict=False`` leaves out a required
    argument no generic recipe knows (a per-class recipe adds it)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    params = inspect.signature(model.forward).parameters
    b, c = BATCH, _channels(cfg)
    pt, ps = _patch(cfg)
    h, w, f = shapes.height * ps, shapes.width * ps, shapes.frames * pt
    tokens = shapes.height * shapes.width
    if shapes.layout == "image":
        hidden = _randn(g, b, c, h, w)
    elif shapes.layout == "video":
        hidden = _randn(g, b, c, f, h, w)
    else:
        hidden = _randn(g, b, tokens, c)
    text_dim = WIDTH
    for key in (
        "joint_attention_dim",
        "text_dim",
        "text_embed_dim",
        "cross_attention_dim",
        "caption_channels",
    ):
        if isinstance(cfg.get(key), int):
            text_dim = cfg[key]
            break
    rope = cfg.get("axes_dims_rope")
    axes = len(rope) if isinstance(rope, (tuple, list)) else 3
    recipes: dict[str, Callable[[], Any]] = {
        "hidden_states": lambda: hidden,
        "x": lambda: hidden,
        "encoder_hidden_states": lambda: _randn(g, b, shapes.text, text_dim),
        "timestep": lambda: torch.rand(b, generator=g) * 1000,
        "timesteps": lambda: torch.rand(b, generator=g) * 1000,
        "t": lambda: torch.rand(b, generator=g),
        "pooled_projections": lambda: _randn(g, b, cfg.get("pooled_projection_dim") or WIDTH),
        "encoder_attention_mask": lambda: torch.ones(b, shapes.text, dtype=torch.long),
        "timestep_r": lambda: torch.rand(b, generator=g) * 1000,
        "r_timestep": lambda: torch.rand(b, generator=g) * 1000,
        "img_ids": lambda: _positions(tokens, shapes.height, shapes.width, axes),
        "txt_ids": lambda: torch.zeros(shapes.text, axes),
        "guidance": lambda: torch.full((b,), 3.5),
        "class_labels": lambda: torch.randint(0, 10, (b,), generator=g),
    }
    inputs: dict[str, Any] = {}
    for name, param in params.items():
        if name in ("self", "return_dict") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        wanted = param.default is inspect.Parameter.empty or (
            name in ("encoder_hidden_states", "timestep", "pooled_projections", "img_ids", "txt_ids")
        )
        if name == "guidance" and cfg.get("guidance_embeds"):
            wanted = True
        if name == "class_labels" and cfg.get("num_embeds_ada_norm"):
            wanted = True
        if wanted:
            if name not in recipes:
                if not strict:
                    continue
                raise KeyError(f"no generic input for forward argument {name!r}")
            inputs[name] = recipes[name]()
    return inputs


# ---------------------------------------------------------------------------------------------------------
# Per-class overrides (config) and recipes (inputs); only what the generic rules get wrong.


def _with(
    model: nn.Module, layout: str, shapes: dict[str, int] | None = None, **extra: Any
) -> dict[str, Any]:
    """The generic inputs for ``layout``, with ``extra`` added or replacing (a callable is given the inputs
    so far and a generator)."""
    inputs = generic_inputs(model, Shapes(layout, **(shapes or {})), strict=False)
    g = torch.Generator().manual_seed(2)
    for key, value in extra.items():
        inputs[key] = value(inputs, g) if callable(value) else value
    return inputs


def _text(dim: int, tokens: int = TEXT_TOKENS) -> Callable[[dict, torch.Generator], torch.Tensor]:
    return lambda inputs, g: _randn(g, BATCH, tokens, dim)


def _qwen_image(model: nn.Module) -> dict[str, Any]:
    return _with(
        model,
        "tokens",
        encoder_hidden_states_mask=torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long),
        img_shapes=[[(1, 4, 4)]] * BATCH,
    )


def _hunyuan_dit(model: nn.Module) -> dict[str, Any]:
    cfg = model.config
    crops = ((0, 0), (4, 4))
    rope = get_2d_rotary_pos_embed(model.inner_dim // model.num_heads, crops, (4, 4), output_type="pt")
    return _with(
        model,
        "image",
        encoder_hidden_states=_text(cfg.cross_attention_dim, cfg.text_len),
        text_embedding_mask=torch.ones(BATCH, cfg.text_len, dtype=torch.long),
        encoder_hidden_states_t5=_text(cfg.cross_attention_dim_t5, cfg.text_len_t5),
        text_embedding_mask_t5=torch.ones(BATCH, cfg.text_len_t5, dtype=torch.long),
        image_meta_size=torch.tensor([[32.0, 32, 32, 32, 0, 0]] * BATCH),
        style=torch.zeros(BATCH, dtype=torch.long),
        image_rotary_emb=rope,
    )


def _z_image(model: nn.Module) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    c = model.config.in_channels
    return dict(
        x=[_randn(g, c, 1, 8, 8) for _ in range(BATCH)],
        t=torch.rand(BATCH, generator=g),
        cap_feats=[_randn(g, TEXT_TOKENS + i, model.config.cap_feat_dim) for i in range(BATCH)],
    )


def _hidream(model: nn.Module) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    layers = len(model.config.llama_layers)
    return dict(
        hidden_states=_randn(g, BATCH, model.config.in_channels, 8, 8),
        timesteps=torch.rand(BATCH, generator=g) * 1000,
        encoder_hidden_states_t5=_randn(g, BATCH, TEXT_TOKENS, WIDTH),
        encoder_hidden_states_llama3=_randn(g, layers, BATCH, TEXT_TOKENS, WIDTH),
        pooled_embeds=_randn(g, BATCH, WIDTH),
    )


def _kandinsky5(model: nn.Module) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    return dict(
        hidden_states=_randn(g, BATCH, 2, 8, 8, cfg.in_visual_dim),
        encoder_hidden_states=_randn(g, BATCH, TEXT_TOKENS, cfg.in_text_dim),
        timestep=torch.rand(BATCH, generator=g) * 1000,
        pooled_projections=_randn(g, BATCH, cfg.in_text_dim2),
        visual_rope_pos=[torch.arange(2), torch.arange(4), torch.arange(4)],
        text_rope_pos=torch.arange(TEXT_TOKENS),
    )


def _ltx(model: nn.Module) -> dict[str, Any]:
    return _with(
        model,
        "tokens",
        {"frames": 2},
        hidden_states=lambda i, g: _randn(g, BATCH, 2 * 16, model.config.in_channels),
        encoder_attention_mask=torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long),
        num_frames=2,
        height=4,
        width=4,
    )


def _ltx2(model: nn.Module) -> dict[str, Any]:
    cfg = model.config
    return _with(
        model,
        "tokens",
        hidden_states=lambda i, g: _randn(g, BATCH, 2 * 16, cfg.in_channels),
        audio_hidden_states=lambda i, g: _randn(g, BATCH, 3, cfg.audio_in_channels),
        audio_encoder_hidden_states=_text(WIDTH),
        audio_encoder_attention_mask=torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long),
        encoder_attention_mask=torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long),
        num_frames=2,
        height=4,
        width=4,
        audio_num_frames=3,
    )


def _prior(model: nn.Module) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    return dict(
        hidden_states=_randn(g, BATCH, cfg.embedding_dim),
        timestep=torch.rand(BATCH, generator=g) * 1000,
        proj_embedding=_randn(g, BATCH, cfg.embedding_dim),
        encoder_hidden_states=_randn(g, BATCH, cfg.num_embeddings, cfg.embedding_dim),
    )


def _cogvideox(model: nn.Module) -> dict[str, Any]:
    return _with(model, "video", hidden_states=lambda i, g: i["hidden_states"].transpose(1, 2).contiguous())


def _minimax_h3(model: nn.Module) -> dict[str, Any]:
    """One packed sequence of text, video and audio rows (the video's first rows conditioning ones at
    another noise level), each modality's rows placed by its index tensor, as its modular pipeline packs
    them."""
    config, g = model.config, torch.Generator().manual_seed(2)
    text, video, audio = TEXT_TOKENS, 12, 4
    rows = text + video + audio
    patch = config.in_channels * math.prod(config.patch_size)
    order = torch.randperm(rows, generator=g)  # the modalities interleaved in the packed sequence
    tags = torch.tensor([1] * text + [0] * video + [2] * audio)[order]
    conditioning = torch.zeros(rows, dtype=torch.long)
    conditioning[order[text : text + video // 3]] = 1  # a third of the video rows: the other noise level
    position = torch.arange(rows)
    return dict(
        hidden_states=_randn(g, BATCH, video, patch),
        audio_hidden_states=_randn(g, BATCH, audio, config.audio_in_channels),
        encoder_hidden_states=_randn(g, BATCH, text, config.text_dim),
        timestep=torch.tensor([0.7, 0.05]),
        timestep_indices=conditioning,
        token_tags=tags,
        position_ids=torch.stack([position // 8, position // 4 % 2, position % 4], dim=-1),
        text_indices=(tags == 1).nonzero().squeeze(1),
        video_indices=(tags == 0).nonzero().squeeze(1),
        audio_indices=(tags == 2).nonzero().squeeze(1),
        return_dict=False,
    )


def _krea2(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's inputs: packed latents, a stack of tapped text-encoder states per token, and the
    (t, h, w) positions of the joint [text, image] sequence (text rows all zero); the last prompt padded."""
    config, g = model.config, torch.Generator().manual_seed(2)
    height, width = 4, 4
    positions = torch.zeros(TEXT_TOKENS + height * width, 3, dtype=torch.long)
    positions[TEXT_TOKENS:, 1] = torch.arange(height).repeat_interleave(width)
    positions[TEXT_TOKENS:, 2] = torch.arange(width).repeat(height)
    mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.bool)
    mask[-1, -2:] = False
    return dict(
        hidden_states=_randn(g, BATCH, height * width, config.in_channels),
        encoder_hidden_states=_randn(g, BATCH, TEXT_TOKENS, config.num_text_layers, config.text_hidden_dim),
        timestep=torch.tensor([0.7] * BATCH),
        position_ids=positions,
        encoder_attention_mask=mask,
        return_dict=False,
    )


def _cogview(model: nn.Module) -> dict[str, Any]:
    size = torch.tensor([[32.0, 32.0]] * BATCH)
    return _with(model, "image", original_size=size, target_size=size, crop_coords=torch.zeros(BATCH, 2))


def _stable_audio(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's inputs: [B, C, L] audio latents, the text-and-duration states it cross-attends to, the
    duration states prepended as one global row, and the 1-D RoPE over both (rotating half a head)."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    length = 16
    return dict(
        hidden_states=_randn(g, BATCH, cfg.in_channels, length),
        timestep=torch.rand(BATCH, generator=g) * 1000,
        encoder_hidden_states=_randn(g, BATCH, TEXT_TOKENS, cfg.cross_attention_input_dim),
        global_hidden_states=_randn(g, BATCH, 1, cfg.global_states_input_dim),
        rotary_embedding=get_1d_rotary_pos_embed(
            cfg.attention_head_dim // 2, length + 1, use_real=True, repeat_interleave_real=False
        ),
    )


def _lumina_next(model: nn.Module) -> dict[str, Any]:
    """The generic image inputs, the prompt's padding mask (the last prompt padded) and the 2-D RoPE table
    its pipeline precomputes (cropped to the patch grid by the model)."""
    mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long)
    mask[-1, -2:] = 0
    return _with(
        model,
        "image",
        encoder_mask=mask,
        image_rotary_emb=get_2d_rotary_pos_embed_lumina(model.head_dim, 8, 8),
        cross_attention_kwargs={},  # its blocks unpack it; its pipeline passes a dict
    )


def _temporal(model: nn.Module) -> dict[str, Any]:
    """A UNet's temporal layer: [B * F, C, H, W] feature maps, frames attending to frames per pixel."""
    g, frames = torch.Generator().manual_seed(1), 3
    return dict(
        hidden_states=_randn(g, BATCH * frames, model.config.in_channels, 4, 4),
        num_frames=frames,
    )


def _omnigen(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's multimodal sequence, built by its collator: left-padded prompt tokens (the first
    prompt holding an input image's four latent patches), the time token and the target's patches, with
    causal attention over text and bidirectional within each image."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    lengths = (9, 6)  # tokens per prompt; the first holds the input image at [2, 6)
    features = [
        {
            "input_ids": torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist(),
            "pixel_values": [torch.zeros(3, 32, 32)] if i == 0 else None,  # stands for the latents below
            "image_sizes": [[2, 6]],
        }
        for i, n in enumerate(lengths)
    ]
    collator = OmniGenCollator(pad_token_id=cfg.pad_token_id, hidden_size=cfg.hidden_size)
    ids, positions, mask, _, _, sizes = collator.process_mllm_input(features, [(64, 64)] * BATCH)
    return dict(
        hidden_states=_randn(g, BATCH, cfg.in_channels, 8, 8),  # 64 x 64 pixels: 16 patches
        timestep=torch.rand(BATCH, generator=g),
        input_ids=ids,
        input_img_latents=[_randn(g, 1, cfg.in_channels, 4, 4)],  # 4 patches
        input_image_sizes=sizes,
        attention_mask=mask,
        position_ids=positions,
    )


def _bria_fibo(model: nn.Module) -> dict[str, Any]:
    """The FLUX-style token inputs and, per block (double then single), the text encoder layer whose
    projection replaces half of the prompt's channels there."""
    cfg = model.config
    blocks = cfg.num_layers + cfg.num_single_layers
    return _with(
        model,
        "tokens",
        text_encoder_layers=lambda i, g: [
            _randn(g, BATCH, TEXT_TOKENS, cfg.text_encoder_dim) for _ in range(blocks)
        ],
    )


def _glm_image(model: nn.Module) -> dict[str, Any]:
    """The generic image inputs, the autoregressive stage's VQ token per latent patch (some dropped, as
    for the unconditional pass) and the target size / crop conditions."""
    cfg, g = model.config, torch.Generator().manual_seed(2)
    patches = 16  # the 4 x 4 patch grid of the generic 8 x 8 latents
    size = torch.tensor([[64.0, 64.0]] * BATCH)
    return _with(
        model,
        "image",
        prior_token_id=torch.randint(0, cfg.prior_vq_quantizer_codebook_size, (BATCH, patches), generator=g),
        prior_token_drop=torch.rand(BATCH, patches, generator=g) < 0.25,
        target_size=size,
        crop_coords=torch.zeros(BATCH, 2),
    )


def _ace_step(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's inputs: [B, T, C] acoustic latents (an odd length: the model pads to its patch), the
    condition encoder's states, and the context latents (source latents and chunk mask, concatenated to
    the latents' channels); t and r equal, as its pipeline passes them."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    frames, acoustic = 11, cfg.audio_acoustic_hidden_dim
    t = torch.rand(BATCH, generator=g)
    return dict(
        hidden_states=_randn(g, BATCH, frames, acoustic),
        timestep=t,
        timestep_r=t,
        encoder_hidden_states=_randn(g, BATCH, TEXT_TOKENS, cfg.hidden_size),
        context_latents=_randn(g, BATCH, frames, cfg.in_channels - acoustic),
    )


def _ideogram4(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's packed [left pad][text][image] rows, ids from its own ``_prepare_ids``: text features
    on text rows, latent patches on image rows (the second prompt shorter, so its row starts padded)."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    rows = TEXT_TOKENS + 16
    position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids(
        [TEXT_TOKENS, TEXT_TOKENS - 2], 4, 4, TEXT_TOKENS, torch.device("cpu")
    )
    return dict(
        hidden_states=_randn(g, BATCH, rows, cfg.in_channels),
        timestep=torch.rand(BATCH, generator=g),
        encoder_hidden_states=_randn(g, BATCH, rows, cfg.llm_features_dim),
        position_ids=position_ids,
        segment_ids=segment_ids,
        indicator=indicator,
    )


def _framepack(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's vanilla section: the noisy window after the clean prefix frame and a history of 4
    (4x-compressed), 2 (2x) and 1 (1x, with the prefix) latent frames, each with its frame indices as the
    pipeline splits them, SigLIP image states and the padded prompt's mask."""
    cfg, g = model.config, torch.Generator().manual_seed(2)
    c, window, history = cfg.in_channels, 2, (4, 2, 1)
    prefix, four, two, one, latents = torch.arange(1 + sum(history) + window).split([1, *history, window])
    mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long)
    mask[-1, -2:] = 0

    def frames(n: int) -> torch.Tensor:
        return _randn(g, BATCH, c, n, 8, 8)

    return dict(
        hidden_states=frames(window),
        timestep=torch.rand(BATCH, generator=g) * 1000,
        encoder_hidden_states=_randn(g, BATCH, TEXT_TOKENS, cfg.text_embed_dim),
        encoder_attention_mask=mask,
        pooled_projections=_randn(g, BATCH, cfg.pooled_projection_dim),
        image_embeds=_randn(g, BATCH, 3, cfg.image_proj_dim),
        indices_latents=latents,
        guidance=torch.full((BATCH,), 3500.0),
        latents_clean=frames(2),
        indices_latents_clean=torch.cat([prefix, one]),
        latents_history_2x=frames(2),
        indices_latents_history_2x=two,
        latents_history_4x=frames(4),
        indices_latents_history_4x=four,
    )


def _kandinsky6(model: nn.Module) -> dict[str, Any]:
    """Its image-to-video-and-audio pipeline's inputs: [B, T, H, W, C] latents with their conditioning
    channels ([latent | condition | mask]) and the reference frame appended as a tail frame (token type 1,
    reusing the first frame's rotary position), audio latents, and the padded prompt with its pooled state."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    frames, (_, ph, pw) = 2, cfg.patch_size
    mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.bool)
    mask[-1, -2:] = False
    token_types = torch.zeros(BATCH, frames + 1, dtype=torch.long)
    token_types[:, -1] = 1
    return dict(
        hidden_states=_randn(g, BATCH, frames + 1, 4 * ph, 4 * pw, 2 * cfg.in_visual_dim + 1),
        audio_hidden_states=_randn(g, BATCH, 6, cfg.in_audio_dim),
        encoder_hidden_states=_randn(g, BATCH, TEXT_TOKENS, cfg.in_text_dim),
        pooled_projections=_randn(g, BATCH, cfg.in_text_dim2),
        timestep=torch.rand(BATCH, generator=g) * 1000,
        visual_rope_pos=(torch.tensor([*range(frames), 0]), torch.arange(4), torch.arange(4)),
        encoder_attention_mask=mask,
        visual_token_type_ids=token_types,
    )


def _kandinsky6_sr(model: nn.Module) -> dict[str, Any]:
    """Its super-resolution pipeline's tile: [B, T, H, W, C] latents with the (zero) anchor latent and
    anchor mask concatenated, on the smallest token grid its NABLA attention takes (8 x 8 blocks)."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    latents = _randn(g, BATCH, 2, 8, 8, cfg.in_visual_dim)
    anchor = torch.zeros(*latents.shape[:-1], cfg.in_visual_dim + 1)
    return dict(
        hidden_states=torch.cat([latents, anchor], dim=-1), timestep=torch.rand(BATCH, generator=g) * 1000
    )


def _sana_wm(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's stage-1 inputs: [B, C, T, H, W] latents (the first frame the clean anchor, its
    per-frame timestep 0), the prompt as [B, 1, L, D] with its padding mask, and the camera raymap and
    chunked Pluecker rays its ``prepare_camera`` derives from a small forward camera move."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    time_stride = cfg.chunk_plucker_channels // 6  # the VAE's temporal stride: 6 Pluecker channels per frame
    frames, size = 2, 4
    poses = torch.eye(4).repeat((frames - 1) * time_stride + 1, 1, 1)
    poses[:, 2, 3] = torch.linspace(0, 0.5, len(poses))
    intrinsics = torch.tensor([[40.0, 40.0, 16.0, 16.0]]).repeat(len(poses), 1)
    camera = prepare_camera(
        poses.numpy(), intrinsics.numpy(), target_size=(8 * size, 8 * size), vae_stride=(time_stride, 8, 8)
    )
    mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long)
    mask[-1, -2:] = 0
    timestep = torch.rand(BATCH, 1, frames, generator=g) * 1000
    timestep[..., 0] = 0
    return dict(
        hidden_states=_randn(g, BATCH, cfg.in_channels, frames, size, size),
        timestep=timestep,
        encoder_hidden_states=_randn(g, BATCH, 1, TEXT_TOKENS, cfg.caption_channels),
        mask=mask,
        camera_conditions=camera["raymap"].expand(BATCH, -1, -1),
        chunk_plucker=camera["chunk_plucker"].expand(BATCH, -1, -1, -1, -1),
    )


def _sana_wm_refiner(model: nn.Module) -> dict[str, Any]:
    """Its refiner's block call: the block's packed latent tokens at one sigma, the prompt with its padding
    mask, and the video RoPE of the block's absolute frames, from the model's own builder; the sink and
    history K/V it reads are captured, as the refiner does, from a clean first frame (``inject`` mode)."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    size, fps = 4, 24.0
    mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long)
    mask[-1, -2:] = 0
    prompt = _randn(g, BATCH, TEXT_TOKENS, cfg.caption_channels)

    def call(frames: list[int], latents: torch.Tensor, timestep: float) -> dict[str, Any]:
        tokens = latents.permute(0, 2, 3, 4, 1).flatten(1, 3)  # patch 1: one token per latent pixel
        rope = model.build_rotary_emb_for_absolute_positions(
            BATCH, frames, size, size, torch.device("cpu"), fps
        )
        return dict(
            hidden_states=tokens,
            encoder_hidden_states=prompt,
            timestep=torch.full(tokens.shape[:2], timestep),
            video_rotary_emb=rope,
            encoder_attention_mask=mask,
        )

    cache = SanaWMRefinerKVCache(cfg.num_layers)
    with torch.no_grad():
        model(
            **call([0], _randn(g, BATCH, cfg.in_channels, 1, size, size), 0.0),
            kv_cache=cache,
            kv_cache_mode="capture_pre_rope",
        )
    for layer in range(cfg.num_layers):
        cache.get(layer).store_sink(*cache.get(layer).get_captured_pre_rope())
    cache.sink_pe = model.build_rotary_emb_for_absolute_positions(
        BATCH, [0], size, size, torch.device("cpu"), fps
    )
    inputs = call([1, 2], _randn(g, BATCH, cfg.in_channels, 2, size, size), 900.0)
    return dict(inputs, kv_cache=cache, kv_cache_mode="inject")


def _wan_animate(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's segment: [B, 2C + 4, T + 1, H, W] latents (noise, reference and conditioning
    channels; the first frame the reference), the pose video's T latent frames, CLIP image states, and the
    face crops in pixels (4 (T - 1) + 1 frames at the motion encoder's size)."""
    cfg = model.config
    frames, size = 2, cfg.motion_encoder_size
    return _with(
        model,
        "video",
        {"frames": frames + 1},
        encoder_hidden_states_image=_text(cfg.image_dim, 3),
        pose_hidden_states=lambda i, g: _randn(g, BATCH, cfg.latent_channels, frames, 8, 8),
        face_pixel_values=lambda i, g: (
            torch.rand(BATCH, 3, 4 * (frames - 1) + 1, size, size, generator=g) * 2 - 1
        ),
    )


def _wan_animate2(model: nn.Module) -> dict[str, Any]:
    """Its modular pipeline's denoising call (one sample, lists of [C, T, H, W] latents): the noisy latents
    with the reference image's extra frame and their condition channels, against the reference K/V that a
    plain ``extract`` pass over the driving-video segment (5 frames, 64 x 64 pixels) wrote to the cache."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    c, frames, size = cfg.out_dim, 2, 8  # latent channels, latent frames of the segment, latent side
    grid = torch.tensor([[frames, size // 2, size // 2]])
    tokens = frames * (size // 2) ** 2
    prompt = [_randn(g, TEXT_TOKENS, cfg.text_dim)]
    clip = _randn(g, 1, 3, 1280)  # the CLIP image states its img_emb projects (a fixed 1280 wide)
    cache = WanAnimate2KVCache(cfg.num_layers)
    with torch.no_grad():
        model(
            [_randn(g, c, frames, size, size)],
            timestep=torch.tensor([900.0]),
            encoder_hidden_states=prompt,
            encoder_hidden_states_image=clip,
            condition_latents=[_randn(g, cfg.in_dim - c, frames, size, size)],
            kv_cache=cache,
            kv_cache_mode="extract",
            seq_len=tokens,
            offset_grid_sizes=grid,
        )
    return dict(
        hidden_states=[_randn(g, c, frames + 1, size, size)],
        timestep=torch.tensor([900.0]),
        encoder_hidden_states=prompt,
        encoder_hidden_states_image=clip,
        condition_latents=[_randn(g, cfg.in_dim - c, frames + 1, size, size)],
        kv_cache=cache,
        kv_cache_mode="cached",
        seq_len=tokens + (size // 2) ** 2,
        reference_grid_sizes=grid,
        origin_len=4 * (frames - 1) + 1,
        origin_area=[8 * size, 8 * size],
    )


def _anyflow(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's inputs: per-frame [B, F, C, H, W] latents with per-frame source and target flow-map
    timesteps [B, F] (the first frame a clean context frame, at 0)."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    frames, (_, ph, pw) = 3, cfg.patch_size
    t = torch.full((BATCH, frames), 900.0)
    t[:, 0] = 0
    return dict(
        hidden_states=_randn(g, BATCH, frames, cfg.in_channels, 4 * ph, 4 * pw),
        timestep=t,
        r_timestep=t * 0.5,
        encoder_hidden_states=_randn(g, BATCH, TEXT_TOKENS, cfg.text_dim),
    )


def _anyflow_far(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's last chunk of a (1, 1, 1)-frame partition: the chunk's [B, F, C, H, W] latents and
    per-frame timesteps, attending to the KV cache (allocated as its pipeline sizes it) that plain cache
    steps wrote for the clean chunks before it (the oldest compressed: the config keeps 2 chunks full)."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    partition, size = [1, 1, 1], 8
    (_, ph, pw), (_, cph, cpw) = cfg.patch_size, cfg.compressed_patch_size
    full, compressed = (size // ph) * (size // pw), (size // cph) * (size // cpw)
    heads, dim, frames = cfg.num_attention_heads, cfg.attention_head_dim, max(partition)
    cache = {
        layer: {
            "full_cache": torch.zeros(2, BATCH, heads, cfg.full_chunk_limit * frames * full, dim),
            "compressed_cache": torch.zeros(
                2, BATCH, heads, (len(partition) - cfg.full_chunk_limit + 1) * frames * compressed, dim
            ),
        }
        for layer in range(cfg.num_layers)
    }
    prompt = _randn(g, BATCH, TEXT_TOKENS, cfg.text_dim)
    clean = _randn(g, BATCH, sum(partition[:-1]), cfg.in_channels, size, size)
    for cached in range(1, len(partition)):  # its encode_kv_cache after each chunk
        seen = partition[:cached]
        with torch.no_grad():
            model(
                hidden_states=clean[:, : sum(seen)],
                timestep=torch.zeros(BATCH, sum(seen)),
                r_timestep=torch.zeros(BATCH, sum(seen)),
                encoder_hidden_states=prompt,
                chunk_partition=seen,
                attention_mask=model.build_attention_mask(
                    chunk_partition=seen, height=size, width=size, device=torch.device("cpu"), mode="cache"
                ),
                kv_cache=cache,
                kv_cache_flag={"num_cached_chunks": cached - 1, "is_cache_step": True},
            )
    t = torch.full((BATCH, partition[-1]), 900.0)
    return dict(
        hidden_states=_randn(g, BATCH, partition[-1], cfg.in_channels, size, size),
        timestep=t,
        r_timestep=t * 0.5,
        encoder_hidden_states=prompt,
        chunk_partition=partition,
        kv_cache=cache,
        kv_cache_flag={"num_cached_chunks": len(partition) - 1, "is_cache_step": False},
    )


def _bria_fibo2(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's edit inputs: [B, C, H, W] latents, the text encoder's bundles (the Perceiver's first,
    then one per injection block) with the padding mask of the shorter prompt (so the two prompts get
    different gist counts, padded), and one image to edit of its own size as clean context latents."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    p = cfg.patch_size
    mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.bool)
    mask[-1, -3:] = False
    return dict(
        hidden_states=_randn(g, BATCH, cfg.in_channels, 4 * p, 4 * p),
        timestep=torch.rand(BATCH, generator=g),
        encoder_hidden_states=_randn(
            g, BATCH, 1 + len(cfg.injection_layer_ids), TEXT_TOKENS, cfg.cap_feat_dim
        ),
        encoder_attention_mask=mask,
        context_latents=[_randn(g, BATCH, cfg.in_channels, 2 * p, 3 * p)],
    )


def _minimax_music3(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's inputs: [B, C, L] Flow-VAE latents and the condition encoder's frame-aligned
    [B, L, D] states (one row per latent frame), flow time in [0, 1]."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    length = 12
    return dict(
        hidden_states=_randn(g, BATCH, cfg.in_channels, length),
        timestep=torch.rand(BATCH, generator=g),
        encoder_hidden_states=_randn(g, BATCH, length, cfg.condition_dim),
    )


def _qwen_image21(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's first edit step: packed latents (a 4 x 4 condition image, then the 4 x 4 target), the
    VLM sequence (text around the condition image's slots, one per 2 x 2 latents) with the target's slots
    appended in ``img_mask``, the last prompt padded, prefilling a fresh prefix KV cache (``extract``; a
    cache captured beforehand would not fit a head-split run, so the step fills its own)."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    slots = torch.tensor([False, False, True, True, True, True, False, False, False])  # 2 text, image, 3 text
    text_mask = torch.ones(BATCH, len(slots), dtype=torch.bool)
    text_mask[-1, -1] = False
    return dict(
        hidden_states=_randn(g, BATCH, 16 + 16, cfg.in_channels),
        encoder_hidden_states=_randn(g, BATCH, len(slots), cfg.context_in_dim),
        timestep=torch.full((BATCH,), 1.0),
        img_shapes=[[(1, 4, 4), (1, 4, 4)]] * BATCH,
        img_mask=torch.cat([slots, torch.ones(4, dtype=torch.bool)]).expand(
            BATCH, -1
        ),  # + the target's slots
        encoder_hidden_states_mask=text_mask,
        kv_cache=QwenImage21KVCache(len(model.transformer_blocks)),
        kv_cache_mode="extract",
    )


def _joyimage_edit_plus(model: nn.Module) -> dict[str, Any]:
    """Its pipeline's packed inputs: per sample the target's patches then its reference image's, each
    patch a [C, pt, ph, pw] block, padded to the longest sample (the second's reference smaller), with
    each component's (t, h, w) in ``shape_list`` and the last prompt padded."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    pt, ph, pw = cfg.patch_size
    shapes = [[(1, 4, 4), (1, 2, 4)], [(1, 4, 4), (1, 2, 2)]]
    patches = max(sum(math.prod(s) for s in sample) for sample in shapes)
    mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long)
    mask[-1, -2:] = 0
    return dict(
        hidden_states=_randn(g, BATCH, patches, cfg.in_channels, pt, ph, pw),
        timestep=torch.rand(BATCH, generator=g) * 1000,
        encoder_hidden_states=_randn(g, BATCH, TEXT_TOKENS, cfg.text_dim),
        encoder_hidden_states_mask=mask,
        shape_list=shapes,
    )


def _cosmos3_omni(model: nn.Module) -> dict[str, Any]:
    """Its omni pipeline's packed text-to-video sequence (one sample, no batch axis), built by the
    pipeline's own segment helpers: the prompt's token ids, then a [1, C, T, H, W] latent video whose
    first frame is the clean image condition, with their joint 3-D mRoPE ids and the noisy frames'
    token indexes and timesteps."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    owner = types.SimpleNamespace(transformer=model, vae_scale_factor_temporal=4)  # what the helpers read
    cpu = torch.device("cpu")
    text = Cosmos3OmniPipeline._prepare_text_segment(
        owner, torch.randint(0, cfg.vocab_size, (TEXT_TOKENS,), generator=g).tolist(), cpu
    )
    latents = _randn(g, 1, cfg.latent_channel, 2, 4, 4)
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        owner, latents, True, text["vision_start_temporal_offset"], 24.0, text["und_len"], cpu
    )
    return dict(
        input_ids=text["input_ids"],
        text_indexes=text["text_indexes"],
        position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
        und_len=text["und_len"],
        sequence_length=text["und_len"] + vision["num_vision_tokens"],
        vision_tokens=[latents],
        vision_token_shapes=vision["vision_token_shapes"],
        vision_sequence_indexes=vision["vision_sequence_indexes"],
        vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
        vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), 900.0),
        vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"],
    )


def _t5_film(model: nn.Module) -> dict[str, Any]:
    """Its spectrogram-diffusion pipeline's inputs: the note encoder's and the context encoder's
    (encoding, mask) pairs it cross-attends to (some note tokens padded), the noisy [B, frames, mel]
    spectrogram and the noise time in [0, 1)."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    notes = torch.ones(BATCH, 6, dtype=torch.bool)
    notes[-1, -2:] = False
    return dict(
        encodings_and_masks=[
            (_randn(g, BATCH, 6, cfg.d_model), notes),
            (_randn(g, BATCH, 4, cfg.d_model), torch.ones(BATCH, 4, dtype=torch.bool)),
        ],
        decoder_input_tokens=_randn(g, BATCH, 8, cfg.input_dims),
        decoder_noise_time=torch.rand(BATCH, generator=g),
    )


def _rfd4_proteina(model: nn.Module) -> dict[str, Any]:
    """Its sampler's prepared tensors for a small protein: noisy C-alpha coordinates (nm) and local latents
    per residue with their two times, the padding mask (the second chain shorter), residue token types,
    no in-context residue and local latents on every residue; the optional topology conditioning left out (unconditioned, as the model allows)."""
    cfg, g = model.config, torch.Generator().manual_seed(1)
    residues = 8
    mask = torch.ones(BATCH, residues, dtype=torch.bool)
    mask[-1, -2:] = False
    return dict(
        bb_ca=_randn(g, BATCH, residues, 3),
        local_latents=_randn(g, BATCH, residues, cfg.latent_dim),
        bb_ca_time=torch.rand(BATCH, generator=g),
        local_latents_time=torch.rand(BATCH, generator=g),
        padding_mask=mask,
        token_type=torch.zeros(BATCH, residues, dtype=torch.long),
        conditioning={
            "is_in_context_conditioning": torch.zeros(BATCH, residues, dtype=torch.bool),
            "supports_local_latent": torch.ones(BATCH, residues, dtype=torch.bool),
        },
    )


# Config overrides: only what the generic rules get wrong for a class.
OVERRIDES: dict[str, dict[str, Any]] = {
    "MiniMaxH3Transformer3DModel": dict(rope_freq_dim=2),  # its RoPE rotates 6 x rope_freq_dim channels
    "WanVACETransformer3DModel": dict(num_layers=2, vace_layers=[0, 1], vace_in_channels=8),
    "HiDreamImageTransformer2DModel": dict(
        patch_size=2,
        caption_channels=[WIDTH, WIDTH],
        llama_layers=[0, 1],
        text_emb_dim=WIDTH,
        axes_dims_rope=(8, 4, 4),
    ),
    "CosmosTransformer3DModel": dict(concat_padding_mask=False),
    "CogVideoXTransformer3DModel": dict(
        max_text_seq_length=TEXT_TOKENS, sample_frames=5, sample_height=8, sample_width=8
    ),
    "ConsisIDTransformer3DModel": dict(
        max_text_seq_length=TEXT_TOKENS, sample_frames=5, sample_height=8, sample_width=8
    ),
    "HunyuanDiT2DModel": dict(patch_size=2, in_channels=4, text_len=TEXT_TOKENS, text_len_t5=TEXT_TOKENS + 2),
    "PixArtTransformer2DModel": dict(use_additional_conditions=False),
    "DreamLiteTransformer2DModel": dict(in_channels=8, norm_num_groups=2),
    "Transformer2DModel": dict(in_channels=8, norm_num_groups=2),
    "LatteTransformer3DModel": dict(
        in_channels=4,
        patch_size=2,
        sample_size=8,
        video_length=2,
        caption_channels=WIDTH,
        cross_attention_dim=WIDTH,
    ),
    "EasyAnimateTransformer3DModel": dict(in_channels=4, out_channels=4, patch_size=2),
    "CogView4Transformer2DModel": dict(rope_axes_dim=(16, 16)),
    "PRXTransformer2DModel": dict(axes_dim=[8, 8]),
    "StableAudioDiTModel": dict(in_channels=8, out_channels=8),
    "AceStepTransformer1DModel": dict(  # a sliding-window layer and a full one; latents + context = in
        num_hidden_layers=2, audio_acoustic_hidden_dim=8, in_channels=24, sliding_window=2
    ),
    "GlmImageTransformer2DModel": dict(prior_vq_quantizer_codebook_size=64),
    "HunyuanVideoFramepackTransformer3DModel": dict(has_image_proj=True, has_clean_x_embedder=True),
    "Kandinsky6Transformer3DModel": dict(
        in_visual_dim=4, out_visual_dim=4, in_text_dim2=WIDTH, visual_token_type_num_embeddings=2
    ),
    "Kandinsky6SRTransformer3DModel": dict(in_visual_dim=4, out_visual_dim=4),
    "SanaWMTransformer3DModel": dict(  # a linear-attention block and a softmax one; kernels kept
        in_channels=8,
        num_layers=2,
        softmax_every_n=2,
        chunk_plucker_post_attn_blocks=2,
        t_kernel_size=3,
        conv_kernel_size=4,
        chunk_plucker_channels=12,  # 6 Pluecker channels x a temporal stride of 2
    ),
    "SanaWMLTX2RefinerTransformer3DModel": dict(in_channels=8, out_channels=8),
    "WanAnimateTransformer3DModel": dict(  # in = 2 x latent + 4; an 8 x 8 face crop, 8-channel encoder
        in_channels=12,
        latent_channels=4,
        out_channels=4,
        motion_encoder_size=8,
        motion_encoder_channel_sizes={"8": 8, "4": 8},
    ),
    "WanAnimate2Transformer3DModel": dict(in_dim=12, out_dim=4),  # latents + (4 mask + 4 latent) condition
    "AnyFlowFARTransformer3DModel": dict(full_chunk_limit=2),  # so a 3-chunk video compresses its oldest
    "BriaFibo2Transformer2DModel": dict(  # its one block takes the injected text; 2 to 4 gist tokens
        in_channels=8,
        injection_layer_ids=(0,),
        min_num_gist_tokens=2,
        max_num_gist_tokens=4,
        gist_step=2,
        gist_min_text_len=2,
        gist_max_text_len=TEXT_TOKENS,
    ),
    "MiniMaxMusic3Transformer1DModel": dict(in_channels=8, rotary_dim=8),  # RoPE on half of a 16-wide head
    "QwenImage21Transformer2DModel": dict(in_channels=16, out_channels=16),
    "Cosmos3OmniTransformer": dict(  # 2 x 2 patches of 4 channels; its mRoPE sections sum to half a head
        latent_channel=4, latent_patch_size=2, patch_latent_dim=16, vocab_size=64, rope_axes_dim=(4, 2, 2)
    ),
    "T5FilmDecoder": dict(input_dims=8),
    "RFD4ProteinaTransformer": dict(  # the features its tiny inputs carry (no atom-level annotations)
        dim_cond=WIDTH,
        tri_mult_c=16,
        recycle_conditioning_dim=1,
        feats_seq=("xt_bb_ca", "xt_local_latents", "token_type"),
        feats_pair_repr=("xt_bb_ca_pair_dists",),
    ),
    "Ideogram4Transformer2DModel": dict(in_channels=16, mrope_section=(2, 2, 2)),  # 3 x section <= 8 freqs
    "LuminaNextDiT2DModel": dict(num_kv_heads=HEADS),  # its default (None) breaks its own qk-norm
    "TransformerTemporalModel": dict(in_channels=8, norm_num_groups=2),
    "OmniGenTransformer2DModel": dict(
        vocab_size=64,
        pad_token_id=0,
        pos_embed_max_size=16,
        rope_scaling={"short_factor": [1.0] * (HEAD_DIM // 2), "long_factor": [1.0] * (HEAD_DIM // 2)},
    ),
}
# Input recipes: classes whose forward takes what the generic recipes cannot derive.
RECIPES: dict[str, Callable[[nn.Module], dict[str, Any]]] = {
    "QwenImageTransformer2DModel": _qwen_image,
    "ZImageTransformer2DModel": _z_image,
    "HiDreamImageTransformer2DModel": _hidream,
    "Kandinsky5Transformer3DModel": _kandinsky5,
    "LTXVideoTransformer3DModel": _ltx,
    "CogVideoXTransformer3DModel": _cogvideox,
    "ConsisIDTransformer3DModel": _cogvideox,
    "CogView3PlusTransformer2DModel": _cogview,
    "CogView4Transformer2DModel": _cogview,
    "HunyuanDiT2DModel": _hunyuan_dit,
    "LTX2VideoTransformer3DModel": _ltx2,
    "NucleusMoEImageTransformer2DModel": lambda m: _with(m, "tokens", img_shapes=[(1, 4, 4)] * BATCH),
    "WanVACETransformer3DModel": lambda m: _with(
        m, "video", control_hidden_states=lambda i, g: _randn(g, BATCH, m.config.vace_in_channels, 2, 8, 8)
    ),
    "MiniMaxH3Transformer3DModel": _minimax_h3,
    "Krea2Transformer2DModel": _krea2,
    "HunyuanVideo15Transformer3DModel": lambda m: _with(
        m,
        "video",
        image_embeds=lambda i, g: _randn(g, BATCH, 4, m.config.image_embed_dim),
        encoder_hidden_states_2=_text(m.config.text_embed_2_dim, 3),
        encoder_attention_mask_2=torch.ones(BATCH, 3, dtype=torch.long),
    ),
    "ErnieImageTransformer2DModel": lambda m: _with(
        m,
        "image",
        text_bth=_text(m.config.text_in_dim),
        text_lens=torch.tensor([TEXT_TOKENS, TEXT_TOKENS - 2]),
    ),
    "MiniMaxMusic3RVQDepthDecoder": lambda m: dict(
        inputs_embeds=_randn(torch.Generator().manual_seed(1), BATCH, 4, m.config.hidden_size)
    ),
    "PriorTransformer": _prior,
    "StableAudio3DiTModel": lambda m: _with(
        m,
        "tokens",
        hidden_states=lambda i, g: _randn(g, BATCH, m.config.io_channels, 16),
        global_hidden_states=lambda i, g: _randn(g, BATCH, m.config.global_cond_dim),
    ),
    "Lumina2Transformer2DModel": lambda m: _with(
        m, "image", encoder_attention_mask=torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long)
    ),
    "StableAudioDiTModel": _stable_audio,
    "LuminaNextDiT2DModel": _lumina_next,
    "TransformerTemporalModel": _temporal,
    "OmniGenTransformer2DModel": _omnigen,
    "BriaFiboTransformer2DModel": _bria_fibo,
    "GlmImageTransformer2DModel": _glm_image,
    "AceStepTransformer1DModel": _ace_step,
    "Ideogram4Transformer2DModel": _ideogram4,
    "HunyuanVideoFramepackTransformer3DModel": _framepack,
    "Kandinsky6Transformer3DModel": _kandinsky6,
    "Kandinsky6SRTransformer3DModel": _kandinsky6_sr,
    "SanaWMTransformer3DModel": _sana_wm,
    "SanaWMLTX2RefinerTransformer3DModel": _sana_wm_refiner,
    "WanAnimateTransformer3DModel": _wan_animate,
    "WanAnimate2Transformer3DModel": _wan_animate2,
    "AnyFlowTransformer3DModel": _anyflow,
    "AnyFlowFARTransformer3DModel": _anyflow_far,
    "BriaFibo2Transformer2DModel": _bria_fibo2,
    "MiniMaxMusic3Transformer1DModel": _minimax_music3,
    "QwenImage21Transformer2DModel": _qwen_image21,
    "JoyImageEditPlusTransformer3DModel": _joyimage_edit_plus,
    "Cosmos3OmniTransformer": _cosmos3_omni,
    "T5FilmDecoder": _t5_film,
    "RFD4ProteinaTransformer": _rfd4_proteina,
}
# Classes we do not build, each with why (checked by the coverage test: an unexplained failure fails).
NOT_BUILT: dict[str, str] = {}


def _layouts(cls: type) -> list[str]:
    """``hidden_states`` layouts to try, the likeliest first."""
    params = inspect.signature(cls.forward).parameters
    if "img_ids" in params or "img_shapes" in params:
        return ["tokens", "image", "video"]
    if "3D" in cls.__name__ or "Video" in cls.__name__:
        return ["video", "image", "tokens"]
    return ["image", "video", "tokens"]


def randomized(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter drawn from N(0, 0.1), so nothing is a zero-init no-op."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    return model.eval()


def outputs(model: nn.Module, inputs: dict[str, Any]) -> list[torch.Tensor]:
    """Every floating tensor the forward returns (nested tuples and output dataclasses flattened)."""
    kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in inputs.items()}
    if "return_dict" in inspect.signature(model.forward).parameters:
        kwargs["return_dict"] = False
    with torch.no_grad():
        result = model(**kwargs)
    found: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found.append(value)
        elif isinstance(value, (tuple, list)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif dataclasses.is_dataclass(value):
            for item in dataclasses.fields(value):
                walk(getattr(value, item.name))

    walk(result)
    if not found:
        raise RuntimeError(f"{type(model).__name__}'s forward returned no floating tensor")
    return found


def build(name: str) -> tuple[nn.Module, dict[str, Any]] | str:
    """A tiny random ``name`` and inputs its plain Diffusers forward runs on, or why it is not built.

    A family the generic rules cannot build and no recorded reason explains (a Diffusers upgrade adds one)
    comes back with the generic rules' first error as its reason: it shows up in the table without a code
    change, and a recipe or a recorded reason can follow."""
    if name in NOT_BUILT:
        return NOT_BUILT[name]
    cls = exported_transformers()[name]
    torch.manual_seed(0)
    try:
        model = randomized(cls(**tiny_config(cls, OVERRIDES.get(name))))
    except Exception as error:
        return _unexplained("its generic tiny config", error)
    if name in RECIPES:
        inputs = RECIPES[name](model)
        outputs(model, inputs)
        return model, inputs
    errors = []
    for layout in _layouts(cls):
        try:
            inputs = generic_inputs(model, Shapes(layout))
            outputs(model, inputs)
            return model, inputs
        except Exception as error:  # the next layout may be the one this model takes
            errors.append(error)
    return _unexplained("every generic input layout", errors[0] if errors else LookupError("none derived"))


def _unexplained(what: str, error: Exception) -> str:
    first_line = str(error).splitlines()[0][:120] if str(error) else ""
    return f"no recipe yet: plain Diffusers refused {what} ({type(error).__name__}: {first_line})"


# ---------------------------------------------------------------------------------------------------------
# Measurement: plain Diffusers against omni_accel.accelerate through a minimal pipeline.


class Holder(DiffusionPipeline):
    """The smallest pipeline around a transformer, so the public accelerate() can take a bare module."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.register_modules(transformer=transformer)


@dataclasses.dataclass
class Coverage:
    """One class's row: the tier it gets, its parity, or why it is not measured."""

    name: str
    tier: str
    layouts: str
    repeated_blocks: str
    compiled: str = "-"  # the generic tier's compiled blocks: parity and graphs, or why not
    parity: float | None = None
    reason: str | None = None  # not built (recorded) or failed when accelerated (a defect)
    defect: str | None = None

    @property
    def status(self) -> str:
        if self.defect is not None:
            return f"DEFECT: {self.defect.splitlines()[-1]}"
        if self.reason is not None:
            return f"not built: {self.reason}"
        assert self.parity is not None
        return "tested, bitwise equal" if self.parity == 0 else f"tested, rel err < 1e-{_decade(self.parity)}"


def _decade(err: float) -> int:
    return max(1, math.floor(-math.log10(err)))


def _generic_layouts(cls: type, tested: bool) -> str:
    """The generic tier's layouts for ``cls`` (tests/test_generic_parallel.py runs them on gloo): tp by a
    Diffusers ``_tp_plan``, ulysses and ring by its ``_cp_plan``, cfg for any."""
    kinds = []
    try:
        tensor_plan(cls.__name__, getattr(cls, "_tp_plan", None))
        kinds.append("tp: Diffusers' _tp_plan")
    except ValueError:
        pass
    if getattr(cls, "_cp_plan", None):
        kinds.append("ulysses, ring: Diffusers' _cp_plan" + ("" if tested else " (not built tiny: untested)"))
    return "; ".join([*kinds, "cfg"])


def _layouts_of(module: nn.Module) -> str:
    spec = spec_for(module)
    native = spec.native_model() if spec is not None else None
    if native is not None:
        plan = native.parallel
        kinds = (["tp"] if plan.tensor else []) + (["ulysses", "ring"] if plan.sequence else [])
        return ", ".join([*kinds, "cfg"] if plan.batched_inputs else kinds) or "-"
    return _generic_layouts(type(module), tested=True)


def _planned_tier(cls: type[ModelMixin]) -> str:
    """The tier the registry plans for ``cls`` (for a class not built, so not accelerated here): the
    registry looks only at the module's type, so an instance without ``__init__`` run is enough."""
    spec = spec_for(cls.__new__(cls))
    if spec is None:
        return "untouched"
    return "native" if spec.native else "routed"


@functools.cache
def measure(name: str) -> Coverage:
    """Plain vs accelerated on the same weights and inputs (fp32, CPU); cached so that the parametrized
    test and the table share one run."""
    cls = exported_transformers()[name]
    repeated = "yes" if getattr(cls, "_repeated_blocks", None) else "no"
    built = build(name)
    if isinstance(built, str):
        layouts = "-" if _planned_tier(cls) == "native" else _generic_layouts(cls, tested=False)
        return Coverage(name, _planned_tier(cls), layouts, repeated, reason=built)
    model, inputs = built
    plain = outputs(model, inputs)
    layouts = _layouts_of(model)
    try:
        holder = omni_accel.accelerate(Holder(model))
        fast = outputs(holder.transformer, inputs)
        report = next(c for c in omni_accel.describe(holder).components if c.name == "transformer")
        tier = report.mode
        if tier == "routed" and not report.selector.decisions():  # routed in name only: say why
            left = sorted({reason for _, reason in report.selector.unrouted})
            tier = f"routed (every attention call left to Diffusers: {', '.join(left) or 'none made'})"
        if len(fast) != len(plain) or any(a.shape != b.shape for a, b in zip(fast, plain, strict=True)):
            raise AssertionError("accelerated outputs differ in number or shape from plain Diffusers'")
        err = max(
            (
                ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for a, b in zip(fast, plain, strict=True)
                if b.numel()  # an empty output (a cache of no chunks yet) has nothing to differ in
            ),
            default=0.0,
        )
        omni_accel.restore(holder)
    except Exception:
        return Coverage(name, "?", layouts, repeated, defect=traceback.format_exc(limit=-3))
    if not err <= TOLERANCE:
        return Coverage(name, tier, layouts, repeated, parity=err, defect=f"rel err {err:.2e} > {TOLERANCE}")
    compiled = _compiled(model, inputs, plain) if tier != "native" else "- (native blocks)"
    if compiled.startswith("DEFECT"):
        return Coverage(name, tier, layouts, repeated, compiled, parity=err, defect=compiled)
    return Coverage(name, tier, layouts, repeated, compiled, parity=err)


class _CountGraphs:
    """A torch.compile backend that runs each graph as traced, counting graphs and our attention ops."""

    def __init__(self) -> None:
        self.graphs = self.ops = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.ops += sum(
            n.op == "call_function" and "diffusers_attention" in str(n.target) for n in gm.graph.nodes
        )
        return gm.forward


def _compiled(model: nn.Module, inputs: dict[str, Any], plain: list[torch.Tensor]) -> str:
    """The generic tier with its blocks compiled (what a GPU user gets; traced here with Dynamo's
    CPU-cheap backend, whole blocks, no graph break): its parity, graphs and routed attention ops, or why
    it does not compile (then its blocks run eagerly, as the report says)."""
    blocks = repeated_blocks(model)
    if not blocks:
        return "- (no repeated blocks)"
    torch._dynamo.reset()
    backend = _CountGraphs()
    holder = None
    try:
        holder = omni_accel.accelerate(
            Holder(model), compile={"backend": backend}, compile_in_background=False, cuda_graphs=False
        )
        fast = outputs(holder.transformer, inputs)
        err = max(
            (
                ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for a, b in zip(fast, plain, strict=True)
                if b.numel()  # an empty output (a cache of no chunks yet) has nothing to differ in
            ),
            default=0.0,
        )
    except Exception as error:
        first_line = str(error).strip().splitlines()[0][:100] if str(error).strip() else ""
        return f"does not compile whole (runs eagerly): {type(error).__name__}: {first_line}"
    finally:
        if holder is not None:
            omni_accel.restore(holder)
    if not err <= TOLERANCE:
        return f"DEFECT: compiled rel err {err:.2e} > {TOLERANCE}"
    parity = "bitwise equal" if err == 0 else f"rel err < 1e-{_decade(err)}"
    return f"{parity}, {backend.graphs} graphs, {backend.ops} attention ops routed"


def coverage_table() -> str:
    """docs/COVERAGE.md as the builders and omni_accel make it now (one row per exported class)."""
    rows = [measure(name) for name in exported_transformers()]
    tested = sum(row.parity is not None and row.defect is None for row in rows)
    defects = sum(row.defect is not None for row in rows)
    lines = [
        "# Transformer coverage",
        "",
        f"Every transformer class Diffusers {diffusers.__version__} exports, built tiny with random weights "
        "(`tests/tiny_transformers.py`) and run on CPU in fp32, plain and through `omni_accel.accelerate`; "
        f"parity is max abs diff / max abs of plain (must be <= {TOLERANCE:g}). Generated by "
        "`.venv/bin/python benchmarks/coverage_table.py`; `tests/test_transformer_coverage.py` fails when "
        "this page differs from what the builders give now. The tier is what this CPU run gets; on a CUDA "
        "device a model without native blocks gets the generic tier: its repeated blocks compiled (the last "
        "column: the same tiny model with `compile=` Dynamo's eager backend on CPU, each block traced whole, "
        "its parity, graphs and the attention calls our op routes inside them) and its steps replayed from "
        "CUDA graphs. Parallel layouts of a model without native blocks (`tests/test_generic_parallel.py`, two "
        "and four gloo ranks): ulysses and ring by its `_cp_plan`, checked for every such family built tiny; tp by its "
        "`_tp_plan`, checked for every such family built tiny; cfg for any, its batch halved by the arguments "
        "whose first dimension is the batch, checked on the SD3 and Qwen-Image (true CFG) pipelines.",
        "",
        f"{len(rows)} classes: {tested} tested, {len(rows) - tested - defects} not built, {defects} defects.",
        "",
        "| class | Diffusers module | tier | parallel layouts | `_repeated_blocks` | status | compiled blocks |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        module = exported_transformers()[row.name].__module__.removeprefix(_TRANSFORMERS)
        cells = [
            f"`{row.name}`",
            f"`{module}`",
            row.tier,
            row.layouts,
            row.repeated_blocks,
            row.status,
            row.compiled,
        ]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"
