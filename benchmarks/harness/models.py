"""The models the benchmarks run: each Diffusers family at its published widths (fewer layers where
several copies would not fit one H200), with the inputs of one forward at its pipeline's default size, and
a tiny config of the same class for smoke runs on CPU. Weights are random (no hub), the same seed in every
copy, so every variant of a run holds the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import (
    DiffusionPipeline,
    Flux2Transformer2DModel,
    FluxTransformer2DModel,
    HunyuanVideo15Transformer3DModel,
    LTX2VideoTransformer3DModel,
    MiniMaxH3Transformer3DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
    ZImageTransformer2DModel,
)

from omni_accel.models.random_pipelines import FLUX_DEV_TRANSFORMER

SD35_LARGE = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=38,
    attention_head_dim=64,
    num_attention_heads=38,
    joint_attention_dim=4096,
    caption_projection_dim=2432,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=192,
    qk_norm="rms_norm",
)

WAN_14B = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40)
WAN_1_3B = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30)


def randomized(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights in ``dtype``, keeping in float32 what Diffusers' from_pretrained keeps there."""
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model.to(dtype)
    for name, module in model.named_modules():
        if any(keep in name.split(".") for keep in model._keep_in_fp32_modules or ()):
            module.float()
    return model.eval()


def rel_err(got: torch.Tensor, reference: torch.Tensor) -> float:
    """Max abs difference over max abs value, in float32."""
    reference = reference.float()
    return ((got.float() - reference).abs().max() / reference.abs().max()).item()


Inputs = Callable[[str, torch.dtype], dict[str, Any]]


@dataclass(frozen=True)
class Spec:
    """One model to measure: its class and config, its forward's arguments (built for a device and a
    dtype), which of its layers run and what the inputs stand for."""

    cls: type
    config: dict[str, Any]
    inputs: Inputs
    layers: str
    shapes: str


def _randn(g: torch.Generator, *shape: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=device, dtype=dtype)


def _padding_mask(tokens: int, valid: int, device: str) -> torch.Tensor:
    mask = torch.zeros(1, tokens, device=device, dtype=torch.long)
    mask[:, :valid] = 1
    return mask


def flux_inputs(
    batch: int, image_tokens: int, text_tokens: int, device: str, dtype: torch.dtype, text_dim: int = 4096
) -> dict[str, Any]:
    """One FLUX.1 transformer call's arguments, square grid of image tokens."""
    g = torch.Generator(device).manual_seed(1)
    side = int(image_tokens**0.5)
    img_ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(side).float(), torch.arange(side).float(), indexing="ij"),
        -1,
    ).reshape(-1, 3)
    return dict(
        hidden_states=_randn(g, batch, image_tokens, 64, device=device, dtype=dtype),
        encoder_hidden_states=_randn(g, batch, text_tokens, text_dim, device=device, dtype=dtype),
        pooled_projections=_randn(g, batch, 768, device=device, dtype=dtype),
        timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
        guidance=torch.full((batch,), 3.5, device=device, dtype=dtype),
        img_ids=img_ids.to(device),
        txt_ids=torch.zeros(text_tokens, 3, device=device),
        return_dict=False,
    )


def _flux(tiny: bool, blocks: tuple[int, int] = (19, 38)) -> Spec:
    """FLUX.1-dev (12B), all 19 double and 38 single blocks (or ``blocks``); 1024x1024 (4096 image tokens),
    512 text."""
    config = dict(FLUX_DEV_TRANSFORMER, num_layers=blocks[0], num_single_layers=blocks[1])
    image, text = 4096, 512
    if tiny:
        config.update(num_layers=1, num_single_layers=1, num_attention_heads=2, joint_attention_dim=32)
        image, text = 16, 8

    def inputs(device: str, dtype: torch.dtype) -> dict[str, Any]:
        return flux_inputs(1, image, text, device, dtype, config["joint_attention_dim"])

    layers = f"{config['num_layers']} of 19 double, {config['num_single_layers']} of 38 single blocks"
    return Spec(FluxTransformer2DModel, config, inputs, layers, f"{image} image tokens, {text} text tokens")


def wan_inputs(frames: int, height: int, width: int, device: str, dtype: torch.dtype, text_dim: int = 4096):
    """One Wan 2.1 text-to-video transformer call for a ``frames`` x ``height`` x ``width`` video (its VAE:
    4x in time after the first frame, 8x in space), a 512-token prompt."""
    g = torch.Generator(device).manual_seed(1)
    shape = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    return dict(
        hidden_states=_randn(g, *shape, device=device, dtype=dtype),
        timestep=torch.full((1,), 500.0, device=device),
        encoder_hidden_states=_randn(g, 1, 512, text_dim, device=device, dtype=dtype),
        return_dict=False,
    )


def _wan(config: dict[str, Any], name: str) -> Callable[[bool], Spec]:
    def spec(tiny: bool) -> Spec:
        """Wan 2.1, every layer; 480x832, 81 frames (32760 tokens)."""
        full, video = dict(config), (81, 480, 832)
        if tiny:
            full = dict(num_attention_heads=2, attention_head_dim=32, ffn_dim=64, num_layers=2, text_dim=32)
            video = (5, 32, 32)

        def inputs(device: str, dtype: torch.dtype) -> dict[str, Any]:
            return wan_inputs(*video, device, dtype, full.get("text_dim", 4096))

        frames, height, width = video
        tokens = ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)
        return Spec(
            WanTransformer3DModel,
            full,
            inputs,
            f"{full['num_layers']} layers ({name})",
            f"{width}x{height}, {frames} frames: {tokens} tokens, 512 text tokens",
        )

    return spec


def _qwenimage(tiny: bool) -> Spec:
    """Qwen-Image: the class defaults are the 20B model's; 30 of its 60 layers."""
    config: dict[str, Any] = dict(num_layers=30)
    side, text, valid, text_dim = 64, 256, 200, 3584  # 1024 px: 128x128 latents in 2x2 patches
    if tiny:
        config = dict(
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        )
        side, text, valid, text_dim = 4, 8, 6, 32

    def inputs(device: str, dtype: torch.dtype) -> dict[str, Any]:
        g = torch.Generator(device).manual_seed(1)
        return dict(
            hidden_states=_randn(g, 1, side * side, 64, device=device, dtype=dtype),
            encoder_hidden_states=_randn(g, 1, text, text_dim, device=device, dtype=dtype),
            encoder_hidden_states_mask=_padding_mask(text, valid, device),
            timestep=torch.full((1,), 0.5, device=device, dtype=dtype),
            img_shapes=[(1, side, side)],
            return_dict=False,
        )

    return Spec(
        QwenImageTransformer2DModel,
        config,
        inputs,
        f"{config['num_layers']} of 60 transformer_blocks",
        f"{side * side} image tokens (1024x1024 at full size), {text} text tokens of which {valid} valid",
    )


def _sd3(tiny: bool) -> Spec:
    """SD3.5-large (8B), all 38 layers."""
    config = dict(SD35_LARGE)
    side, text, text_dim, pooled_dim = 128, 333, 4096, 2048
    if tiny:
        config.update(
            sample_size=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            caption_projection_dim=32,
            pooled_projection_dim=32,
            pos_embed_max_size=16,
        )
        side, text, text_dim, pooled_dim = 16, 7, 32, 32

    def inputs(device: str, dtype: torch.dtype) -> dict[str, Any]:
        g = torch.Generator(device).manual_seed(1)
        return dict(
            hidden_states=_randn(g, 1, 16, side, side, device=device, dtype=dtype),
            encoder_hidden_states=_randn(g, 1, text, text_dim, device=device, dtype=dtype),
            pooled_projections=_randn(g, 1, pooled_dim, device=device, dtype=dtype),
            timestep=torch.full((1,), 500.0, device=device, dtype=dtype),
            return_dict=False,
        )

    return Spec(
        SD3Transformer2DModel,
        config,
        inputs,
        f"{config['num_layers']} of 38 transformer_blocks",
        f"latents [1, 16, {side}, {side}] (1024x1024 at full size), {text} text tokens",
    )


def _flux2(tiny: bool) -> Spec:
    """FLUX.2-dev. The class defaults are the published FLUX.2-dev transformer config (hidden 6144 = 48
    heads x 128, joint_attention_dim 15360 = 3 stacked Mistral-3 layers of 5120, in_channels 128, mlp_ratio
    3, RoPE axes (32, 32, 32, 32), theta 2000, guidance embedding on); 2 of 8 double and 12 of 48 single
    blocks."""
    config: dict[str, Any] = dict(num_layers=2, num_single_layers=12)
    side, text, text_dim, channels = 64, 512, 15360, 128  # 1024 px: 8x VAE, 2x2 patchified latents
    if tiny:
        config = dict(
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 4, 4, 4),
        )
        side, text, text_dim = 4, 8, 32

    def inputs(device: str, dtype: torch.dtype) -> dict[str, Any]:
        g = torch.Generator(device).manual_seed(1)
        one = torch.arange(1)
        # (T, H, W, L) positions as Flux2Pipeline._prepare_latent_ids / _prepare_text_ids make them.
        img_ids = torch.cartesian_prod(one, torch.arange(side), torch.arange(side), one)
        txt_ids = torch.cartesian_prod(one, one, one, torch.arange(text))
        return dict(
            hidden_states=_randn(g, 1, side * side, channels, device=device, dtype=dtype),
            encoder_hidden_states=_randn(g, 1, text, text_dim, device=device, dtype=dtype),
            timestep=torch.full((1,), 0.5, device=device, dtype=dtype),  # the pipeline passes t / 1000
            img_ids=img_ids.unsqueeze(0).to(device),
            txt_ids=txt_ids.unsqueeze(0).to(device),
            guidance=torch.full((1,), 4.0, device=device, dtype=dtype),
            return_dict=False,
        )

    return Spec(
        Flux2Transformer2DModel,
        config,
        inputs,
        f"{config['num_layers']} of 8 transformer_blocks, {config['num_single_layers']} of 48 "
        "single_transformer_blocks",
        f"{side * side} image tokens (1024x1024 at full size), {text} text tokens",
    )


def _zimage(tiny: bool) -> Spec:
    """Z-Image: the class defaults are the 6B model's; all 30 layers (and its 2 + 2 refiner blocks)."""
    config: dict[str, Any] = {}
    side, text, cap_dim = 128, 256, 2560  # 1024 px: 128x128 latents of 16 channels, 2x2 patches
    if tiny:
        config = dict(
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=32,
            axes_dims=[4, 6, 6],
        )
        side, text, cap_dim = 8, 8, 32

    def inputs(device: str, dtype: torch.dtype) -> dict[str, Any]:
        g = torch.Generator(device).manual_seed(1)
        # Lists of per-sample tensors, as ZImagePipeline passes them: latents [C, F=1, H, W] and the valid
        # caption tokens only.
        return dict(
            x=[_randn(g, 16, 1, side, side, device=device, dtype=dtype)],
            t=torch.full((1,), 0.5, device=device, dtype=dtype),
            cap_feats=[_randn(g, text, cap_dim, device=device, dtype=dtype)],
            return_dict=False,
        )

    return Spec(
        ZImageTransformer2DModel,
        config,
        inputs,
        f"{config.get('n_layers', 30)} of 30 layers (+ noise/context refiners)",
        f"{(side // 2) ** 2} image tokens (1024x1024 at full size), {text} caption tokens",
    )


def _hunyuanvideo15(tiny: bool) -> Spec:
    """HunyuanVideo 1.5 (8.3B): the class defaults are its widths (16 heads x 128, 54 layers, Qwen2.5-VL
    text of 3584, ByT5 glyph text of 1472, SigLIP image tokens of 1152); all 54 layers. Text-to-video as
    HunyuanVideo15Pipeline calls it: the 65 input channels are 32 latent channels, 32 zero condition
    channels and a zero mask; the image embedding is zeros (masked out), no glyph text (ByT5 mask zeros);
    1000 text tokens of which 200 are valid."""
    # target_size / task_type: the 480p text-to-video checkpoint's values (read by the pipeline only).
    config: dict[str, Any] = dict(target_size=480, task_type="t2v")
    # 480x848, 81 frames: the VAE compresses 4x in time and 16x in space -> 21 x 30 x 53 latents.
    frames, height, width = 21, 30, 53
    text, valid, text_dim, glyph, glyph_dim, image, image_dim = 1000, 200, 3584, 256, 1472, 729, 1152
    if tiny:
        config = dict(
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=2,
            num_refiner_layers=1,
            text_embed_dim=32,
            text_embed_2_dim=32,
            image_embed_dim=32,
            rope_axes_dim=(4, 6, 6),
        )
        frames, height, width = 2, 4, 6
        text, valid, text_dim, glyph, glyph_dim, image, image_dim = 8, 6, 32, 4, 32, 3, 32

    def inputs(device: str, dtype: torch.dtype) -> dict[str, Any]:
        g = torch.Generator(device).manual_seed(1)
        latents = _randn(g, 1, 32, frames, height, width, device=device, dtype=dtype)
        condition = torch.zeros(1, 33, frames, height, width, device=device, dtype=dtype)
        return dict(
            hidden_states=torch.cat([latents, condition], dim=1),
            timestep=torch.full((1,), 500.0, device=device, dtype=dtype),
            encoder_hidden_states=_randn(g, 1, text, text_dim, device=device, dtype=dtype),
            encoder_attention_mask=_padding_mask(text, valid, device),
            encoder_hidden_states_2=torch.zeros(1, glyph, glyph_dim, device=device, dtype=dtype),
            encoder_attention_mask_2=torch.zeros(1, glyph, device=device, dtype=torch.long),
            image_embeds=torch.zeros(1, image, image_dim, device=device, dtype=dtype),
            return_dict=False,
        )

    return Spec(
        HunyuanVideo15Transformer3DModel,
        config,
        inputs,
        f"{config.get('num_layers', 54)} of 54 transformer_blocks",
        f"latents {frames}x{height}x{width} = {frames * height * width} tokens (480x848, 81 frames at full "
        f"size), {text} text tokens of which {valid} valid, {glyph} glyph and {image} image tokens masked",
    )


def _ltx2(tiny: bool) -> Spec:
    """LTX-2 (19B audio-video): the class defaults are its widths; 24 of 48 layers (three full copies would
    not fit). LTX2Pipeline's defaults: 512x768, 121 frames at 24 fps, with their audio; the text comes from
    its connectors (1024 tokens of 3840, padding replaced by registers: the mask is all ones)."""
    config: dict[str, Any] = dict(num_layers=24)
    # 32x spatial, 8x temporal VAE: (121 - 1) / 8 + 1 = 16 frames of 16 x 24; audio: 121 / 24 s at
    # 16000 / 160 / 4 = 25 latents per second -> 126 latents of 8 channels x 16 mel bins = 128.
    frames, height, width, audio, text, text_dim = 16, 16, 24, 126, 1024, 3840
    if tiny:
        config = dict(
            num_attention_heads=2,
            attention_head_dim=16,
            cross_attention_dim=32,
            audio_num_attention_heads=2,
            audio_attention_head_dim=16,
            audio_cross_attention_dim=32,
            caption_channels=32,
            num_layers=2,
        )
        frames, height, width, audio, text, text_dim = 2, 4, 6, 5, 8, 32

    def inputs(device: str, dtype: torch.dtype) -> dict[str, Any]:
        g = torch.Generator(device).manual_seed(1)
        timestep = torch.full((1,), 500.0, device=device, dtype=dtype)
        mask = torch.ones(1, text, device=device, dtype=torch.long)
        return dict(
            hidden_states=_randn(g, 1, frames * height * width, 128, device=device, dtype=dtype),
            audio_hidden_states=_randn(g, 1, audio, 128, device=device, dtype=dtype),
            encoder_hidden_states=_randn(g, 1, text, text_dim, device=device, dtype=dtype),
            audio_encoder_hidden_states=_randn(g, 1, text, text_dim, device=device, dtype=dtype),
            timestep=timestep,
            sigma=timestep,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=frames,
            height=height,
            width=width,
            fps=24.0,
            audio_num_frames=audio,
            return_dict=False,
        )

    return Spec(
        LTX2VideoTransformer3DModel,
        config,
        inputs,
        f"{config['num_layers']} of 48 transformer_blocks",
        f"video {frames}x{height}x{width} = {frames * height * width} tokens (512x768, 121 frames at full "
        f"size), {audio} audio tokens, {text} text tokens",
    )


def minimax_h3_layout(
    text: int, audio_latents: int, frames: int, height: int, width: int, device: str
) -> dict[str, torch.Tensor]:
    """The packed ``[text, audio, video]`` rows of a text-to-video+audio call (no keyframes) as MiniMax-H3's
    modular pipeline lays them out: stereo audio channel-major, each row's timestep index (0 text, 1 audio,
    2 video) and modality tag (0 video, 1 text, 2 audio), float64 ``(t, h, w)`` positions continuing the
    text's time axis."""
    audio = 2 * audio_latents
    video = frames * height * width
    length = text + audio + video
    positions = torch.zeros(length, 3, dtype=torch.float64)
    positions[:text, 0] = torch.arange(text)
    positions[text : text + audio, 0] = (text + torch.arange(audio_latents)).repeat(2)
    axes = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    grid = torch.stack(axes, dim=-1).reshape(-1, 3)
    positions[text + audio :] = grid.double() + torch.tensor([float(text), 0.0, 0.0], dtype=torch.float64)
    tags = torch.cat([torch.ones(text), torch.full((audio,), 2), torch.zeros(video)]).long()
    timestep_indices = torch.cat([torch.zeros(text), torch.ones(audio), torch.full((video,), 2)]).long()
    return dict(
        timestep_indices=timestep_indices.to(device),
        token_tags=tags.to(device),
        position_ids=positions.to(device),
        text_indices=torch.arange(text, device=device),
        audio_indices=torch.arange(text, text + audio, device=device),
        video_indices=torch.arange(text + audio, length, device=device),
    )


def _minimax_h3(tiny: bool) -> Spec:
    """MiniMax-H3: the class defaults are the released model's widths (hidden 5376, 56 heads x 128, SwiGLU
    14336, AdaLN from a 2688-wide timestep embedding); 10 of its 50 layers (a copy of all 50 is ~64 GB in
    bf16) and both refiner blocks. Its modular pipeline's default length, 124 frames at 24 fps (37 latent
    frames) with their stereo audio (207 latents per channel), at 480x832 (16x VAE, 2x2 patches: 15 x 26
    rows per frame), with a 256-token prompt."""
    config: dict[str, Any] = dict(num_layers=10)
    text, audio, frames, (height, width), text_dim, video_channels, audio_channels = (
        256,
        207,
        37,
        (15, 26),
        5120,
        96,
        32,
    )
    if tiny:
        config = dict(
            num_attention_heads=2,
            attention_head_dim=32,
            hidden_size=48,
            num_layers=2,
            num_refiner_layers=1,
            ffn_dim=64,
            in_channels=4,
            audio_in_channels=6,
            text_dim=24,
            freq_dim=32,
            time_embed_hidden_dim=32,
            time_embed_dim=16,
            rope_freq_dim=4,
        )
        text, audio, frames, (height, width), text_dim, video_channels, audio_channels = (
            5,
            3,
            2,
            (2, 2),
            24,
            16,
            6,
        )

    def inputs(device: str, dtype: torch.dtype) -> dict[str, Any]:
        g = torch.Generator(device).manual_seed(1)
        return dict(
            hidden_states=_randn(g, 1, frames * height * width, video_channels, device=device, dtype=dtype),
            audio_hidden_states=_randn(g, 1, 2 * audio, audio_channels, device=device, dtype=dtype),
            encoder_hidden_states=_randn(g, 1, text, text_dim, device=device, dtype=dtype),
            timestep=torch.tensor([0.0, 0.6, 0.7], device=device),
            **minimax_h3_layout(text, audio, frames, height, width, device),
            return_dict=False,
        )

    return Spec(
        MiniMaxH3Transformer3DModel,
        config,
        inputs,
        f"{config['num_layers']} of 50 transformer_blocks, 2 of 2 refiner blocks",
        f"{text} text + {2 * audio} audio + {frames * height * width} video rows (480x832, 124 frames with stereo audio "
        "at full size), one packed sequence",
    )


MODELS: dict[str, Callable[[bool], Spec]] = {
    "flux": _flux,
    # half of FLUX.1-dev's blocks: four copies (the baselines, ours, ours FP8) fit an 80 GB card
    "flux_half": lambda tiny: _flux(tiny, blocks=(10, 19)),
    "wan14b": _wan(WAN_14B, "Wan 2.1 14B"),
    "wan1.3b": _wan(WAN_1_3B, "Wan 2.1 1.3B"),
    "qwenimage": _qwenimage,
    "sd3": _sd3,
    "flux2": _flux2,
    "zimage": _zimage,
    "hunyuanvideo15": _hunyuanvideo15,
    "ltx2": _ltx2,
    "minimax_h3": _minimax_h3,
}
"""Model name -> its spec (``tiny``: the smoke-run config)."""


class Holder(DiffusionPipeline):
    """The smallest pipeline around a transformer, so that accelerate() can take it."""

    def __init__(self, transformer) -> None:
        super().__init__()
        self.register_modules(transformer=transformer)


def build(spec: Spec, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random ``spec`` model; the same seed, so every copy holds the same weights."""
    torch.manual_seed(0)
    with torch.device(device):
        return randomized(spec.cls(**spec.config), dtype)


def tensors(out: Any) -> list[torch.Tensor]:
    """The floating tensors of a forward's output (tuples and lists flattened), copied in fp32: a CUDA
    graph's outputs live in its pool and the next replay overwrites them."""
    if isinstance(out, torch.Tensor):
        return [out.detach().float().clone()] if out.is_floating_point() else []
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in tensors(item)]
    return []


def error(got: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    if len(got) != len(reference) or any(a.shape != b.shape for a, b in zip(got, reference, strict=True)):
        raise AssertionError("outputs differ in number or shape from Diffusers'")
    return max(rel_err(a, b) for a, b in zip(got, reference, strict=True))


def shapes(x: dict[str, Any]) -> dict[str, Any]:
    def shape(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return f"{list(v.shape)} {str(v.dtype).removeprefix('torch.')}"
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            return [shape(t) for t in v]
        return v if isinstance(v, (int, float, str, bool)) or v is None else repr(v)

    return {k: shape(v) for k, v in x.items()}


LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
"""The attention projections (image and text streams) a benchmark's LoRA goes on, where the model has them."""


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """The same random adapter on every copy (seeded), B nonzero so that it changes the output; on the
    attention projections the model has."""
    from peft import LoraConfig

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in LORA_TARGETS if t.split(".")[0] in names]
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False)
    model.add_adapter(config, adapter_name="bench")
    generator = torch.Generator(model.device).manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator, device=param.device) * 0.02)
    return model
