"""One transformer forward of six Diffusers families: Diffusers as built, its best switches, omni_accel.

Random bf16 weights on one GPU; the three variants are built in one process and timed interleaved
(``timing.interleaved``), so clock drift over the run hits them alike.

Per model three copies with the same random weights (same seed): (a) ``diffusers``, the module exactly
as constructed; (b) ``diffusers_best``, with ``fuse_qkv_projections()`` where the class has it, Diffusers'
cuDNN attention backend (``timing.cudnn_backend_for``) and ``compile_repeated_blocks(fullgraph=True)``
(each block of the block ModuleLists compiled where the class declares no ``_repeated_blocks``); (c)
``omni``, ``omni_accel.accelerate(holder, compile_in_background=True)`` around a bare pipeline (on CUDA:
the repeated blocks compile in the background and the steps replay from CUDA graphs; by default the
generic tier compiles at the first call instead, see docs/archive/performance-history.md). The first call of (b) and (c)
is timed apart (compilation); (c) is then called until its background compile is done and its CUDA
graph captured. Errors of (b) and (c) are against (a)'s output, in fp32 (max abs diff / max abs).

Full published widths; fewer layers where three copies would not fit in an H200's 139 GiB or the run
would be long (the JSON says which layers ran): Qwen-Image (20B widths, 30 of 60 layers; 1024x1024, a
256-token prompt with 200 valid), SD3.5-large (all 38 layers, 1024x1024, 333 text tokens), FLUX.2-dev
(2 of 8 double and 12 of 48 single blocks, 1024x1024, 512 text tokens), Z-Image 6B (all 30 layers,
1024x1024, 256 caption tokens), HunyuanVideo 1.5 (all 54 layers, 480x848, 81 frames, text-to-video)
and LTX-2 (24 of 48 layers, 512x768, 121 frames with their audio). A model that fails (an OOM, a
compile error) is recorded with its traceback and the others still run; the JSON is written after every
model, so a run cut short keeps what finished.

    python benchmarks/generic_step.py --out generic.json
    python benchmarks/generic_step.py --models flux2 zimage --rounds 4 --calls 5
    python benchmarks/generic_step.py --smoke --rounds 1 --calls 1    # CPU, fp32, tiny configs
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import diffusers
import torch
from diffusers import (
    Flux2Transformer2DModel,
    HunyuanVideo15Transformer3DModel,
    LTX2VideoTransformer3DModel,
    MiniMaxH3Transformer3DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    ZImageTransformer2DModel,
)
from flux_step import rel_err
from random_models import randomized
from routed_step import SD35_LARGE
from step_anatomy import gaps
from timing import cudnn_backend_for, interleaved, write_json

import omni_accel
from omni_accel.attention import kernel_builds
from omni_accel.models.registry import spec_for

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


def _qwenimage(smoke: bool) -> Spec:
    """Qwen-Image: the class defaults are the 20B model's; 30 of its 60 layers."""
    config: dict[str, Any] = dict(num_layers=30)
    side, text, valid, text_dim = 64, 256, 200, 3584  # 1024 px: 128x128 latents in 2x2 patches
    if smoke:
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


def _sd3(smoke: bool) -> Spec:
    """SD3.5-large (8B), all 38 layers."""
    config = dict(SD35_LARGE)
    side, text, text_dim, pooled_dim = 128, 333, 4096, 2048
    if smoke:
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


def _flux2(smoke: bool) -> Spec:
    """FLUX.2-dev. The class defaults are the published FLUX.2-dev transformer config (hidden 6144 = 48
    heads x 128, joint_attention_dim 15360 = 3 stacked Mistral-3 layers of 5120, in_channels 128, mlp_ratio
    3, RoPE axes (32, 32, 32, 32), theta 2000, guidance embedding on); 2 of 8 double and 12 of 48 single
    blocks."""
    config: dict[str, Any] = dict(num_layers=2, num_single_layers=12)
    side, text, text_dim, channels = 64, 512, 15360, 128  # 1024 px: 8x VAE, 2x2 patchified latents
    if smoke:
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


def _zimage(smoke: bool) -> Spec:
    """Z-Image: the class defaults are the 6B model's; all 30 layers (and its 2 + 2 refiner blocks)."""
    config: dict[str, Any] = {}
    side, text, cap_dim = 128, 256, 2560  # 1024 px: 128x128 latents of 16 channels, 2x2 patches
    if smoke:
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


def _hunyuanvideo15(smoke: bool) -> Spec:
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
    if smoke:
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


def _ltx2(smoke: bool) -> Spec:
    """LTX-2 (19B audio-video): the class defaults are its widths; 24 of 48 layers (three full copies would
    not fit). LTX2Pipeline's defaults: 512x768, 121 frames at 24 fps, with their audio; the text comes from
    its connectors (1024 tokens of 3840, padding replaced by registers: the mask is all ones)."""
    config: dict[str, Any] = dict(num_layers=24)
    # 32x spatial, 8x temporal VAE: (121 - 1) / 8 + 1 = 16 frames of 16 x 24; audio: 121 / 24 s at
    # 16000 / 160 / 4 = 25 latents per second -> 126 latents of 8 channels x 16 mel bins = 128.
    frames, height, width, audio, text, text_dim = 16, 16, 24, 126, 1024, 3840
    if smoke:
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


def _minimax_h3(smoke: bool) -> Spec:
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
    if smoke:
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
    "qwenimage": _qwenimage,
    "sd3": _sd3,
    "flux2": _flux2,
    "zimage": _zimage,
    "hunyuanvideo15": _hunyuanvideo15,
    "ltx2": _ltx2,
    "minimax_h3": _minimax_h3,
}


class Holder(omni_accel.api.DiffusionPipeline):
    """The smallest pipeline around a transformer, so that accelerate() can take it."""

    def __init__(self, transformer) -> None:
        super().__init__()
        self.register_modules(transformer=transformer)


def _build(spec: Spec, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random ``spec`` model; the same seed, so every copy holds the same weights."""
    torch.manual_seed(0)
    with torch.device(device):
        return randomized(spec.cls(**spec.config), dtype)


def _wall(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """``fn()`` and its wall seconds, the device synchronized on both sides."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _tensors(out: Any) -> list[torch.Tensor]:
    """The floating tensors of a forward's output (tuples and lists flattened), copied in fp32: a CUDA
    graph's outputs live in its pool and the next replay overwrites them."""
    if isinstance(out, torch.Tensor):
        return [out.detach().float().clone()] if out.is_floating_point() else []
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _tensors(item)]
    return []


def _error(got: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    if len(got) != len(reference) or any(a.shape != b.shape for a, b in zip(got, reference, strict=True)):
        raise AssertionError("outputs differ in number or shape from Diffusers'")
    return max(rel_err(a, b) for a, b in zip(got, reference, strict=True))


def _processors(model: torch.nn.Module) -> set[type]:
    """The classes of the attention processors of ``model``'s attention modules."""
    return {type(m.processor) for m in model.modules() if getattr(m, "processor", None) is not None}


def _backend_ignored_by(model: torch.nn.Module) -> list[str]:
    """The attention processors that do not call Diffusers' dispatcher, so ignore a backend switch
    (SD3's JointAttnProcessor2_0 calls F.scaled_dot_product_attention itself)."""
    ignoring = []
    for processor in _processors(model):
        try:
            if "dispatch_attention_fn" not in inspect.getsource(processor.__call__):
                ignoring.append(processor.__name__)
        except (OSError, TypeError):  # no source to read
            ignoring.append(f"{processor.__name__}?")
    return sorted(ignoring)


def _best_switches(model: torch.nn.Module, smoke: bool) -> dict[str, Any]:
    """Diffusers' best switches on ``model``, in place; what applied."""
    info: dict[str, Any] = {}
    if hasattr(model, "fuse_qkv_projections"):
        try:
            model.fuse_qkv_projections()
            fused = sum(bool(getattr(m, "fused_projections", False)) for m in model.modules())
            info["fuse_qkv"] = f"called: {fused} attention modules fused"
        except Exception as error:  # e.g. "not supported for models having added KV projections"
            info["fuse_qkv"] = f"not applied: {type(error).__name__}: {error}"
    else:
        info["fuse_qkv"] = f"not applied: {type(model).__name__} has no fuse_qkv_projections"
    info["attention_processors"] = sorted(p.__name__ for p in _processors(model))
    if smoke:
        info["cudnn"] = "skipped (smoke run on CPU)"
    else:
        cudnn_backend_for(model)
        ignoring = _backend_ignored_by(model)
        info["cudnn"] = "_native_cudnn set" + (f" (ignored by {', '.join(ignoring)})" if ignoring else "")
    options: dict[str, Any] = dict(fullgraph=True, backend="eager") if smoke else dict(fullgraph=True)
    if getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(**options)
        info["compile"] = f"compile_repeated_blocks({options}) over {list(model._repeated_blocks)}"
    else:
        lists = [
            (name, child)
            for name, child in model.named_children()
            if isinstance(child, torch.nn.ModuleList) and name.endswith("blocks") and len(child)
        ]
        for _, blocks in lists:
            for block in blocks:
                block.compile(**options)
        names = ", ".join(f"{name}[0..{len(blocks) - 1}]" for name, blocks in lists)
        info["compile"] = f"no _repeated_blocks: each of {names} .compile({options})"
    return info


def _first_best_call(model: torch.nn.Module, fn: Callable[[], Any], device: str, info: dict) -> tuple:
    """(b)'s first call (it compiles); where cuDNN attention refuses these inputs, Diffusers' native
    backend instead (said in ``info``)."""
    try:
        return _wall(fn, device)
    except Exception as error:
        if not info["cudnn"].startswith("_native_cudnn"):
            raise
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        model.set_attention_backend("native")
        _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)
        info["cudnn"] = f"failed at the first call ({type(error).__name__}: {error}); native backend used"
        return _wall(fn, device)


def _omni_ready(holder: Holder, fn: Callable[[], Any], device: str) -> tuple[float, list[str]]:
    """Calls (c) until its background compile and kernel builds are done and a CUDA graph of the compiled
    step is captured: one call, the waits, three calls; their wall seconds and the compiler's summary."""
    runtime = omni_accel.describe(holder).components[0].runtime
    compiler = getattr(runtime, "compiler", None)
    t0 = time.perf_counter()
    fn()
    if compiler is not None:
        # compiles queued by a call start at the next one (a step of a pipeline); one forward per "step"
        # here: start them now, or the wait returns at once and the timed calls race the compiler
        compiler.start_compiles()
        compiler.wait()
    kernel_builds.wait()
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, compiler.summary() if compiler is not None else ["no compiler"]


def _shapes(x: dict[str, Any]) -> dict[str, Any]:
    def shape(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return f"{list(v.shape)} {str(v.dtype).removeprefix('torch.')}"
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            return [shape(t) for t in v]
        return v if isinstance(v, (int, float, str, bool)) or v is None else repr(v)

    return {k: shape(v) for k, v in x.items()}


def measure(name: str, args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """The three variants of model ``name``, built, warmed up and timed interleaved."""
    spec = MODELS[name](args.smoke)
    x = spec.inputs(device, dtype)
    result: dict[str, Any] = {
        "class": spec.cls.__name__,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in spec.config.items()},
        "layers_measured": spec.layers,
        "inputs": spec.shapes,
        "input_shapes": _shapes(x),
    }
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # The three copies; cleared at the end, so that the caller's empty_cache() returns their memory.
    models: dict[str, Any] = {
        "diffusers": _build(spec, device, dtype),
        "diffusers_best": _build(spec, device, dtype),
    }
    best = models["diffusers_best"]
    result["diffusers_best_switches"] = info = _best_switches(best, args.smoke)
    options: dict[str, Any] = (
        dict(compile={"backend": "eager"}, compile_in_background=False)
        if args.smoke
        else dict(
            compile_in_background=True
        )  # as measured in docs/archive/performance-history.md (the default waits)
    )
    models["omni"] = omni_accel.accelerate(Holder(_build(spec, device, dtype)), **options)
    result["parameters_per_copy_b"] = sum(p.numel() for p in models["diffusers"].parameters()) / 1e9
    variants = {
        "diffusers": lambda: models["diffusers"](**x),
        "diffusers_best": lambda: models["diffusers_best"](**x),
        "omni": lambda: models["omni"].transformer(**x),
    }
    if spec_for(models["diffusers"]).native is not None:  # a model with native blocks: its generic tier too
        models["omni_generic"] = omni_accel.accelerate(
            Holder(_build(spec, device, dtype)), native=False, **options
        )
        variants["omni_generic"] = lambda: models["omni_generic"].transformer(**x)
    if args.probe:  # where (b) gains on (c): its fused QKV, and our CUDA graphs' share
        fused = _build(spec, device, dtype)
        if hasattr(fused, "fuse_qkv_projections"):
            fused.fuse_qkv_projections()
            models["omni_fused_qkv"] = omni_accel.accelerate(Holder(fused), **options)
            variants["omni_fused_qkv"] = lambda: models["omni_fused_qkv"].transformer(**x)
        no_graphs = _build(spec, device, dtype)
        models["omni_no_graphs"] = omni_accel.accelerate(Holder(no_graphs), cuda_graphs=False, **options)
        variants["omni_no_graphs"] = lambda: models["omni_no_graphs"].transformer(**x)

    first: dict[str, float] = {}
    _, first["diffusers"] = _wall(variants["diffusers"], device)
    _, first["diffusers_best"] = _first_best_call(best, variants["diffusers_best"], device, info)
    _, first["omni"] = _wall(variants["omni"], device)
    result["first_call_s"] = first
    result["omni_ready_s"], result["omni_compiler"] = _omni_ready(models["omni"], variants["omni"], device)
    for probe in ("omni_generic", "omni_fused_qkv", "omni_no_graphs"):
        if probe in variants:
            _omni_ready(models[probe], variants[probe], device)
    outputs = {}
    for variant, fn in variants.items():  # one more call each: the outputs compared are warm ones
        if not variant.startswith("omni"):
            fn()
        outputs[variant] = _tensors(fn())
    result["rel_err_vs_diffusers"] = {
        variant: _error(outputs[variant], outputs["diffusers"])
        for variant in variants
        if variant != "diffusers"
    }
    del outputs

    stats = interleaved(variants, device, args.rounds, args.calls)
    ms = {variant: stat["median_ms"] for variant, stat in stats.items()}
    result["median_ms"] = ms
    result["timing"] = stats
    result["speedup"] = {
        "diffusers/omni": ms["diffusers"] / ms["omni"],
        "diffusers_best/omni": ms["diffusers_best"] / ms["omni"],
        "diffusers/diffusers_best": ms["diffusers"] / ms["diffusers_best"],
        **(
            {"diffusers_best/omni_generic": ms["diffusers_best"] / ms["omni_generic"]}
            if "omni_generic" in ms
            else {}
        ),
    }
    result["omni_report"] = str(omni_accel.describe(models["omni"]))
    if args.profile and device == "cuda":  # where the two compiled variants differ, kernel family by family
        result["profile"] = {v: gaps(variants[v], steps=2) for v in ("diffusers_best", "omni")}
    if args.probe:
        result["probe_ms"] = {v: ms[v] for v in variants if v.startswith("omni_")}
    if args.power and device == "cuda":
        result["power"] = [  # interleaved: (b), ours, (b), ours
            {"variant": v, **sustained(variants[v], args.power)}
            for v in ("diffusers_best", "omni", "diffusers_best", "omni")
        ]
    if device == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 1024**3
    del best
    variants.clear()
    models.clear()
    return result


def sustained(fn: Callable[[], Any], seconds: float) -> dict[str, float]:
    """``fn`` called back to back for ``seconds`` while ``nvidia-smi`` samples the SM clock and the board
    power every 100 ms: whether a variant that keeps the GPU busier runs at lower clocks (the H200 here sits
    at its 700 W cap under dense GEMMs). Mean ms per call (CUDA events around the whole window / calls),
    median clock (MHz) and power (W) over the window's second half."""
    sampler = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE,
        text=True,
    )
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    end.record()
    torch.cuda.synchronize()
    sampler.terminate()
    rows = [line.split(",") for line in sampler.communicate()[0].splitlines() if line.count(",") == 1]
    rows = rows[len(rows) // 2 :]
    return {
        "ms_per_call": start.elapsed_time(end) / calls,
        "calls": calls,
        "sm_clock_mhz": statistics.median(float(r[0]) for r in rows) if rows else float("nan"),
        "power_w": statistics.median(float(r[1]) for r in rows) if rows else float("nan"),
    }


def _summary(name: str, r: dict[str, Any]) -> str:
    ms, first, err, up = r["median_ms"], r["first_call_s"], r["rel_err_vs_diffusers"], r["speedup"]
    return (
        f"{name}: diffusers {ms['diffusers']:.1f} ms, best {ms['diffusers_best']:.1f} ms, "
        f"omni {ms['omni']:.1f} ms | x{up['diffusers/omni']:.2f} vs diffusers, "
        f"x{up['diffusers_best/omni']:.2f} vs best, best x{up['diffusers/diffusers_best']:.2f} | first call: "
        f"best {first['diffusers_best']:.1f} s, omni {first['omni']:.1f} s (ready after "
        f"{r['omni_ready_s']:.1f} s more) | rel err: best {err['diffusers_best']:.1e}, omni {err['omni']:.1e}"
        + (
            f" | generic tier {ms['omni_generic']:.1f} ms (x{up['diffusers_best/omni_generic']:.2f} vs best), "
            f"rel err {err['omni_generic']:.1e}"
            if "omni_generic" in ms
            else ""
        )
        + f" | omni: {r['omni_report'].splitlines()[1][:80]}"
    )


def _profile_line(table: dict[str, Any]) -> str:
    families = ", ".join(f"{k} {v:.1f}" for k, v in sorted(table["family_ms_per_step"].items()))
    top = "; ".join(f"{name[:70]} {ms:.2f} x{n}" for name, ms, n in table["top_kernels"][:10])
    return (
        f"{table['kernels_per_step']:.0f} kernels, busy {table['busy_ms_per_step']:.1f} ms of a span of "
        f"{table['span_ms_per_step']:.1f} | {families} | top: {top}"
    )


def _free(device: str) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per variant per round")
    parser.add_argument("--out", help="JSON results path (written after every model)")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="also time ours with the model's fuse_qkv_projections() first, and ours without CUDA graphs",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile (b) and ours: GPU busy time and span per call, kernel families, the top kernels",
    )
    parser.add_argument(
        "--power",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also run (b) and ours back to back for SECONDS each, twice, sampling SM clock and board power",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, fp32, tiny configs, eager compile backend: a logic check"
    )
    args = parser.parse_args(argv)
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "args": vars(args),
        "dtype": str(dtype),
    }
    for name in args.models:
        try:
            results[name] = measure(name, args, device, dtype)
            print(_summary(name, results[name]), flush=True)
            for variant, table in results[name].get("profile", {}).items():
                print(f"{name} {variant} profile: {_profile_line(table)}", flush=True)
            if "power" in results[name]:
                print(f"{name} sustained: {json.dumps(results[name]['power'])}", flush=True)
            if "probe_ms" in results[name]:
                print(f"{name} probes (ms): {json.dumps(results[name]['probe_ms'])}", flush=True)
            print(json.dumps(results[name]["diffusers_best_switches"]), flush=True)
            print(results[name]["omni_report"], flush=True)
        except Exception as error:  # one model's failure (an OOM, a compile error) keeps the others
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
            print(f"{name}: FAILED\n{results[name]['traceback']}", file=sys.stderr, flush=True)
        _free(device)
        write_json(results, args.out)
    return results


if __name__ == "__main__":
    failed = [name for name, r in main().items() if isinstance(r, dict) and "error" in r]
    sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
