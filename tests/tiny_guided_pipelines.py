"""Tiny, offline builds of the pipelines that call a transformer without native blocks twice per guided step
(cond, then uncond), and of those that batch both branches in one call (PixArt-Sigma, Sana, HunyuanDiT,
CogVideoX, LTX-Video, Allegro, Mochi, Latte, EasyAnimate, AuraFlow, Lumina-Next), for the CFG tests
(``tests/test_cfg_pairing_families.py``).

Same rules as ``omni_accel.models.tiny_pipelines``: the genuine Diffusers / Transformers classes at toy sizes,
random weights that follow from ``seed`` alone, nothing downloaded. The Wan-family video pipelines reuse the
tiny Wan pipeline's UMT5, tokenizer and video VAE. Their prompt cleaning needs the ``ftfy`` package, absent
here, so they are called with ``prompt_embeds`` (:func:`video_call`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers import (
    AllegroPipeline,
    AllegroTransformer3DModel,
    AuraFlowPipeline,
    AuraFlowTransformer2DModel,
    AutoencoderKLMagvit,
    ChromaPipeline,
    ChromaTransformer2DModel,
    ChronoEditPipeline,
    ChronoEditTransformer3DModel,
    CogVideoXDDIMScheduler,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    CogView4Pipeline,
    CogView4Transformer2DModel,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    EasyAnimatePipeline,
    EasyAnimateTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
    HeliosPipeline,
    HeliosScheduler,
    HeliosTransformer3DModel,
    HunyuanDiT2DModel,
    HunyuanDiTPipeline,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
    Kandinsky5T2VPipeline,
    Kandinsky5Transformer3DModel,
    Krea2Pipeline,
    Krea2Transformer2DModel,
    LattePipeline,
    LatteTransformer3DModel,
    LongCatImagePipeline,
    LongCatImageTransformer2DModel,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    LucyEditPipeline,
    Lumina2Pipeline,
    Lumina2Transformer2DModel,
    LuminaNextDiT2DModel,
    LuminaPipeline,
    MochiPipeline,
    MochiTransformer3DModel,
    NucleusMoEImagePipeline,
    NucleusMoEImageTransformer2DModel,
    OvisImagePipeline,
    OvisImageTransformer2DModel,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
    SanaPipeline,
    SanaTransformer2DModel,
    SkyReelsV2Pipeline,
    SkyReelsV2Transformer3DModel,
    WanTransformer3DModel,
)
from PIL import Image
from transformers import Gemma2Config, Gemma2Model, GlmConfig, GlmModel, Qwen3Model, T5EncoderModel

from omni_accel.models.tiny_pipelines import (
    _TEXT_HEADS,
    _TEXT_HIDDEN,
    _finish,
    _image_vae,
    _qwen3_text,
    _qwen_tokenizer,
    _qwen_vl_text_encoder,
    _randomize_,
    _seeded,
    _t5_encoder,
    _t5_tokenizer,
    flux_rope_axes,
    tiny_wan_pipeline,
)

_HEADS, _HEAD_DIM = 2, 16
_WIDTH = _HEADS * _HEAD_DIM
_VIDEO = dict(patch_size=(1, 2, 2), num_attention_heads=_HEADS, attention_head_dim=_HEAD_DIM, out_channels=16)
_VIDEO |= dict(text_dim=_TEXT_HIDDEN, freq_dim=_WIDTH, ffn_dim=2 * _WIDTH, num_layers=2)
# FLUX-style image transformers: one double and one single block, 3-axis RoPE
_IMAGE = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=_HEAD_DIM)
_IMAGE |= dict(
    num_attention_heads=_HEADS, joint_attention_dim=_TEXT_HIDDEN, axes_dims_rope=flux_rope_axes(_HEAD_DIM)
)


def _transformer(seed: int, model_class: type, **config: Any) -> torch.nn.Module:
    with _seeded(seed, "transformer"):
        model = model_class(**config)
        _randomize_(model)
    return model


def _video(pipeline_class: type, seed: int, transformer: torch.nn.Module, **extra: Any) -> DiffusionPipeline:
    """``pipeline_class`` on the tiny Wan pipeline's tokenizer, UMT5 and video VAE (and scheduler, unless
    ``extra`` gives one)."""
    wan = tiny_wan_pipeline(seed=seed)
    parts = dict(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, vae=wan.vae, scheduler=wan.scheduler)
    return _finish(pipeline_class(**{**parts, **extra}, transformer=transformer), torch.float32, "cpu")


def tiny_skyreels_v2_pipeline(seed: int = 0) -> SkyReelsV2Pipeline:
    return _video(
        SkyReelsV2Pipeline, seed, _transformer(seed, SkyReelsV2Transformer3DModel, in_channels=16, **_VIDEO)
    )


def tiny_helios_pipeline(seed: int = 0) -> HeliosPipeline:
    """Helios with a one-stage scheduler (the pyramid pipeline's three stages are ``HeliosPyramidPipeline``'s);
    call it with a short chunk and history (:func:`helios_call`)."""
    model = _transformer(seed, HeliosTransformer3DModel, in_channels=16, rope_dim=(4, 6, 6), **_VIDEO)
    return _video(HeliosPipeline, seed, model, scheduler=HeliosScheduler(stages=1, stage_range=[0, 1]))


def tiny_lucy_edit_pipeline(seed: int = 0) -> LucyEditPipeline:
    """Lucy Edit: a Wan transformer that reads the video's latents beside the noise (twice the channels)."""
    return _video(LucyEditPipeline, seed, _transformer(seed, WanTransformer3DModel, in_channels=32, **_VIDEO))


def tiny_chronoedit_pipeline(seed: int = 0) -> ChronoEditPipeline:
    """ChronoEdit: the tiny Wan I2V pipeline's CLIP image encoder, image K/V in its cross-attentions."""
    wan = tiny_wan_pipeline(seed=seed, image_to_video=True)
    model = _transformer(
        seed, ChronoEditTransformer3DModel, in_channels=36, image_dim=24, added_kv_proj_dim=_WIDTH, **_VIDEO
    )
    image = dict(image_encoder=wan.image_encoder, image_processor=wan.image_processor)
    return _video(ChronoEditPipeline, seed, model, **image)


def _toy_text_model(config_class: type, model_class: type, tokenizer: Any, seed: int, kv_heads: int) -> Any:
    """A two-layer decoder text model of ``model_class`` over the tokenizer's ids (CogView4's GLM, Lumina 2's
    Gemma 2), its weights seeded as the pipeline's ``text_encoder``."""
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=2 * _TEXT_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=_TEXT_HEADS,
        num_key_value_heads=kv_heads,
        head_dim=_TEXT_HIDDEN // _TEXT_HEADS,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _seeded(seed, "text_encoder"):
        return model_class(config)


def tiny_cogview4_pipeline(seed: int = 0) -> CogView4Pipeline:
    """CogView4 on a toy GLM text model (the T5 test tokenizer's ids) and the tiny 16-channel image VAE."""
    tokenizer = _t5_tokenizer()
    text_encoder = _toy_text_model(GlmConfig, GlmModel, tokenizer, seed, kv_heads=_TEXT_HEADS)
    model = _transformer(
        seed,
        CogView4Transformer2DModel,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=_HEAD_DIM,
        num_attention_heads=_HEADS,
        text_embed_dim=_TEXT_HIDDEN,
        time_embed_dim=_WIDTH,
        condition_dim=16,
        rope_axes_dim=(8, 8),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25,
        max_shift=0.75,
        base_image_seq_len=256,
        use_dynamic_shifting=True,
        time_shift_type="linear",
    )
    pipe = CogView4Pipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=_image_vae(seed, 1.0, 0.0), transformer=model,
        scheduler=scheduler,
    )  # fmt: skip
    return _finish(pipe, torch.float32, "cpu")


def tiny_longcat_image_pipeline(seed: int = 0) -> LongCatImagePipeline:
    """LongCat-Image on a toy Qwen2.5-VL text tower (no processor: prompt rewriting is off in the calls), its
    prompts padded to 8 tokens (the released 512 is the pipeline's ``tokenizer_max_length`` attribute)."""
    prefix = (
        "<|im_start|>system\nAs an image captioning expert, generate a descriptive text prompt based on an image "
        "content, suitable for input to a text-to-image model.<|im_end|>\n<|im_start|>user\n"
    )
    tokenizer = _qwen_tokenizer(prefix + "{}<|im_end|>\n<|im_start|>assistant\n")
    with _seeded(seed, "text_encoder"):  # vision token ids past the vocabulary: never emitted
        text_encoder = _qwen_vl_text_encoder(tokenizer, [len(tokenizer) + i for i in range(4)], seed)
    pipe = LongCatImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_image_vae(seed, 1.0, 0.0), text_encoder=text_encoder,
        tokenizer=tokenizer, text_processor=None, transformer=_transformer(seed, LongCatImageTransformer2DModel,
        pooled_projection_dim=_TEXT_HIDDEN, **_IMAGE),
    )  # fmt: skip
    pipe.tokenizer_max_length = 8
    return _finish(pipe, torch.float32, "cpu")


def tiny_chroma_pipeline(seed: int = 0) -> ChromaPipeline:
    tokenizer = _t5_tokenizer()
    model = _transformer(
        seed,
        ChromaTransformer2DModel,
        approximator_num_channels=16,
        approximator_hidden_dim=_WIDTH,
        approximator_layers=1,
        **_IMAGE,
    )
    pipe = ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_image_vae(seed, 1.0, 0.0), tokenizer=tokenizer,
        text_encoder=_t5_encoder(T5EncoderModel, tokenizer, _TEXT_HIDDEN, seed, "text_encoder"), transformer=model,
    )  # fmt: skip
    return _finish(pipe, torch.float32, "cpu")


def tiny_ovis_image_pipeline(seed: int = 0) -> OvisImagePipeline:
    tokenizer, text_encoder = _qwen3_text(seed, Qwen3Model, 1)
    model = _transformer(seed, OvisImageTransformer2DModel, out_channels=64, **_IMAGE)
    pipe = OvisImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_image_vae(seed, 1.0, 0.0), text_encoder=text_encoder,
        tokenizer=tokenizer, transformer=model,
    )  # fmt: skip
    return _finish(pipe, torch.float32, "cpu")


def tiny_pixart_sigma_pipeline(seed: int = 0) -> PixArtSigmaPipeline:
    """PixArt-Sigma (its transformer predicts the variance too: twice the latent channels out). Call it with
    ``use_resolution_binning=False``: its bins are the released sizes."""
    tokenizer = _t5_tokenizer()
    model = _transformer(
        seed,
        PixArtTransformer2DModel,
        num_attention_heads=_HEADS,
        attention_head_dim=_HEAD_DIM,
        in_channels=16,
        out_channels=32,
        num_layers=2,
        norm_num_groups=8,
        cross_attention_dim=_WIDTH,
        sample_size=16,
        caption_channels=_TEXT_HIDDEN,
    )
    pipe = PixArtSigmaPipeline(
        tokenizer=tokenizer, text_encoder=_t5_encoder(T5EncoderModel, tokenizer, _TEXT_HIDDEN, seed, "text_encoder"),
        vae=_image_vae(seed, 1.0, 0.0), transformer=model, scheduler=DPMSolverMultistepScheduler(),
    )  # fmt: skip
    return _finish(pipe, torch.float32, "cpu")


def tiny_lumina2_pipeline(seed: int = 0) -> Lumina2Pipeline:
    """Lumina-Image 2.0 on a toy Gemma 2 text model (the T5 test tokenizer's ids: the pipeline only pads and
    encodes with it); call it with a short ``max_sequence_length``."""
    tokenizer = _t5_tokenizer()
    text_encoder = _toy_text_model(Gemma2Config, Gemma2Model, tokenizer, seed, kv_heads=1)
    model = _transformer(
        seed,
        Lumina2Transformer2DModel,
        sample_size=16,
        patch_size=2,
        in_channels=16,
        hidden_size=_WIDTH,
        num_layers=1,
        num_refiner_layers=1,
        num_attention_heads=_HEADS,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(4, 6, 6),
        axes_lens=(64, 64, 64),
        cap_feat_dim=_TEXT_HIDDEN,
    )
    pipe = Lumina2Pipeline(
        transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(), vae=_image_vae(seed, 1.0, 0.0),
        text_encoder=text_encoder, tokenizer=tokenizer,
    )  # fmt: skip
    return _finish(pipe, torch.float32, "cpu")


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (32, 32, 3), dtype=np.uint8))


def video_call(**extra: Any) -> dict[str, Any]:
    """A guided call of the Wan-family video pipelines, on prompt embeddings (see the module's docstring)."""
    g = torch.Generator().manual_seed(5)
    embeds = dict(prompt_embeds=torch.randn(1, 6, _TEXT_HIDDEN, generator=g))
    embeds["negative_prompt_embeds"] = torch.randn(1, 6, _TEXT_HIDDEN, generator=g)
    return {"prompt": None, **embeds, "guidance_scale": 5.0, "num_frames": 5, **extra}


def helios_call() -> dict[str, Any]:
    return video_call(num_frames=9, num_latent_frames_per_chunk=2, history_sizes=[2, 1, 1])


def chronoedit_call(**extra: Any) -> dict[str, Any]:
    return video_call(image=_image(3), **extra)


def lucy_edit_call() -> dict[str, Any]:
    return video_call(video=[_image(i) for i in range(5)])


# Pipelines built without text encoders or VAE: called on prompt embeddings for latents (``embedded_call``).


def _bare(
    pipeline_class: type, transformer: torch.nn.Module, scheduler: Any = None, **parts: Any
) -> DiffusionPipeline:
    """``pipeline_class`` holding only ``transformer`` and a scheduler (flow matching unless given; ``parts``
    names its other slots)."""
    scheduler = FlowMatchEulerDiscreteScheduler() if scheduler is None else scheduler
    pipe = pipeline_class(transformer=transformer, scheduler=scheduler, **parts)
    return _finish(pipe, torch.float32, "cpu")


def tiny_hunyuan_video_pipeline(seed: int = 0) -> HunyuanVideoPipeline:
    model = _transformer(
        seed, HunyuanVideoTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=_HEADS,
        attention_head_dim=_HEAD_DIM, num_layers=1, num_single_layers=1, num_refiner_layers=1,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6),
    )  # fmt: skip
    slots = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    return _bare(HunyuanVideoPipeline, model, vae=None, **slots)


def tiny_kandinsky5_pipeline(seed: int = 0) -> Kandinsky5T2VPipeline:
    model = _transformer(
        seed, Kandinsky5Transformer3DModel, in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16,
        out_visual_dim=4, model_dim=_WIDTH, ff_dim=2 * _WIDTH, num_text_blocks=1, num_visual_blocks=1,
        axes_dims=(4, 6, 6),
    )  # fmt: skip
    slots = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    return _bare(Kandinsky5T2VPipeline, model, vae=None, **slots)


def tiny_krea2_pipeline(seed: int = 0) -> Krea2Pipeline:
    model = _transformer(
        seed, Krea2Transformer2DModel, in_channels=16, num_layers=1, attention_head_dim=_HEAD_DIM,
        num_attention_heads=_HEADS, num_key_value_heads=1, intermediate_size=_WIDTH, timestep_embed_dim=16,
        text_hidden_dim=16, num_text_layers=2, text_num_attention_heads=2, text_num_key_value_heads=2,
        text_intermediate_size=_WIDTH, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    return _bare(Krea2Pipeline, model, vae=None, text_encoder=None, tokenizer=None)


def tiny_nucleusmoe_image_pipeline(seed: int = 0) -> NucleusMoEImagePipeline:
    """NucleusMoE-Image with dense blocks only (two layers: its first three and last are dense)."""
    model = _transformer(
        seed, NucleusMoEImageTransformer2DModel, in_channels=64, out_channels=16, num_layers=2,
        attention_head_dim=2 * _HEAD_DIM, num_attention_heads=_HEADS, joint_attention_dim=16,
        axes_dims_rope=(8, 12, 12), mlp_ratio=3.0,
    )  # fmt: skip
    return _bare(NucleusMoEImagePipeline, model, vae=None, text_encoder=None, processor=None)


def _embeddings(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _text(name: str, seed: int, *shape: int, mask: torch.dtype | None = torch.long) -> dict[str, Any]:
    """``{name}``, and its ``negative_`` twin, of ``shape`` (with masks of ``mask``'s dtype)."""
    call = {name: _embeddings(seed, *shape), f"negative_{name}": _embeddings(seed + 1, *shape)}
    if mask is not None:
        call |= {f"{name}_mask": torch.ones(shape[:2], dtype=mask)}
        call |= {f"negative_{name}_mask": torch.ones(shape[:2], dtype=mask)}
    return call


def hunyuan_video_call() -> dict[str, Any]:
    call = _text("prompt_embeds", 1, 1, 5, 16, mask=None) | _text("pooled_prompt_embeds", 3, 1, 8, mask=None)
    masks = dict(prompt_attention_mask=torch.ones(1, 5, dtype=torch.long))
    masks["negative_prompt_attention_mask"] = masks["prompt_attention_mask"]
    return {"prompt": None, **call, **masks, "true_cfg_scale": 4.0, "num_frames": 5, "output_type": "latent"}


def kandinsky5_call() -> dict[str, Any]:
    call = _text("prompt_embeds_qwen", 1, 5, 16, mask=None) | _text("prompt_embeds_clip", 3, 1, 8, mask=None)
    lengths = dict(prompt_cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    lengths["negative_prompt_cu_seqlens"] = lengths["prompt_cu_seqlens"]
    return {
        "prompt": None,
        **call,
        **lengths,
        "guidance_scale": 3.5,
        "num_frames": 5,
        "output_type": "latent",
    }


def krea2_call() -> dict[str, Any]:
    """Krea 2's embeddings hold several text layers each ([batch, tokens, layers, width])."""
    call = _text("prompt_embeds", 1, 1, 5, 2, 16, mask=torch.bool)
    return {"prompt": None, **call, "guidance_scale": 4.5, "output_type": "latent"}


def nucleusmoe_image_call() -> dict[str, Any]:
    call = _text("prompt_embeds", 1, 1, 5, 16)
    return {"prompt": None, **call, "guidance_scale": 4.0, "output_type": "latent"}


# Pipelines that batch both guidance branches in each transformer call, bare as above (``batched_calls``).


def _masked_text(seed: int, tokens: int = 5, width: int = 16) -> dict[str, Any]:
    """``prompt_embeds`` and their ``prompt_attention_mask``, with the negative twins."""
    call = _text("prompt_embeds", seed, 1, tokens, width)
    return {key.replace("prompt_embeds_mask", "prompt_attention_mask"): v for key, v in call.items()}


def _call(**extra: Any) -> dict[str, Any]:
    return {"prompt": None, "output_type": "latent", "height": 64, "width": 64, **extra}


def tiny_sana_pipeline(seed: int = 0) -> SanaPipeline:
    model = _transformer(
        seed, SanaTransformer2DModel, in_channels=4, out_channels=4, num_attention_heads=_HEADS,
        attention_head_dim=_HEAD_DIM, num_layers=2, num_cross_attention_heads=_HEADS,
        cross_attention_head_dim=_HEAD_DIM, cross_attention_dim=_WIDTH, caption_channels=16, sample_size=8,
    )  # fmt: skip
    return _bare(SanaPipeline, model, vae=None, text_encoder=None, tokenizer=None)


def tiny_hunyuandit_pipeline(seed: int = 0) -> HunyuanDiTPipeline:
    """HunyuanDiT: its 2-D RoPE goes to the model as a (cos, sin) tuple as long as the image tokens. DPM-Solver
    rather than its DDPM scheduler, whose step from pure noise magnifies rounding ~150x in two steps."""
    model = _transformer(
        seed, HunyuanDiT2DModel, num_attention_heads=_HEADS, attention_head_dim=_HEAD_DIM, in_channels=4,
        patch_size=2, sample_size=8, hidden_size=_WIDTH, num_layers=2, cross_attention_dim=16,
        cross_attention_dim_t5=16, pooled_projection_dim=8, text_len=5, text_len_t5=6,
    )  # fmt: skip
    slots = dict(
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, safety_checker=None
    )
    pipe = HunyuanDiTPipeline(
        transformer=model, scheduler=DPMSolverMultistepScheduler(), vae=None, feature_extractor=None,
        requires_safety_checker=False, **slots,
    )  # fmt: skip
    return _finish(pipe, torch.float32, "cpu")


def tiny_cogvideox_pipeline(seed: int = 0) -> CogVideoXPipeline:
    """CogVideoX with its 3-D RoPE (a (cos, sin) tuple, as HunyuanDiT's)."""
    model = _transformer(
        seed, CogVideoXTransformer3DModel, num_attention_heads=_HEADS, attention_head_dim=_HEAD_DIM,
        in_channels=4, out_channels=4, time_embed_dim=_WIDTH, text_embed_dim=16, num_layers=2, sample_width=8,
        sample_height=8, sample_frames=9, max_text_seq_length=5, use_rotary_positional_embeddings=True,
    )  # fmt: skip
    pipe = CogVideoXPipeline(
        transformer=model, scheduler=CogVideoXDDIMScheduler(), vae=None, text_encoder=None, tokenizer=None
    )
    return _finish(pipe, torch.float32, "cpu")


def tiny_ltx_pipeline(seed: int = 0) -> LTXPipeline:
    model = _transformer(
        seed, LTXVideoTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=_HEADS,
        attention_head_dim=_HEAD_DIM, cross_attention_dim=_WIDTH, num_layers=2, caption_channels=16,
    )  # fmt: skip
    return _bare(LTXPipeline, model, vae=None, text_encoder=None, tokenizer=None)


def tiny_allegro_pipeline(seed: int = 0) -> AllegroPipeline:
    """Allegro (heads of 24: its RoPE splits them in three even parts; a tuple of tuples of tables)."""
    model = _transformer(
        seed, AllegroTransformer3DModel, num_attention_heads=_HEADS, attention_head_dim=24, in_channels=4,
        out_channels=4, num_layers=2, cross_attention_dim=2 * 24, sample_height=8, sample_width=8,
        sample_frames=3, caption_channels=16,
    )  # fmt: skip
    return _bare(
        AllegroPipeline, model, DPMSolverMultistepScheduler(), vae=None, text_encoder=None, tokenizer=None
    )


def tiny_mochi_pipeline(seed: int = 0) -> MochiPipeline:
    model = _transformer(
        seed, MochiTransformer3DModel, num_attention_heads=_HEADS, attention_head_dim=_HEAD_DIM, num_layers=2,
        pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=16, max_sequence_length=5,
    )  # fmt: skip
    return _bare(MochiPipeline, model, vae=None, text_encoder=None, tokenizer=None)


def tiny_latte_pipeline(seed: int = 0) -> LattePipeline:
    """Latte (its transformer predicts the variance too: twice the latent channels out)."""
    model = _transformer(
        seed, LatteTransformer3DModel, num_attention_heads=_HEADS, attention_head_dim=_HEAD_DIM, in_channels=4,
        out_channels=8, num_layers=2, cross_attention_dim=_WIDTH, sample_size=8, patch_size=2,
        norm_type="ada_norm_single", caption_channels=16, video_length=3, num_embeds_ada_norm=1000,
    )  # fmt: skip
    return _bare(
        LattePipeline, model, DPMSolverMultistepScheduler(), vae=None, text_encoder=None, tokenizer=None
    )


def tiny_easyanimate_pipeline(seed: int = 0) -> EasyAnimatePipeline:
    """EasyAnimate (its loop reads the VAE's latent channels: a toy Magvit VAE)."""
    model = _transformer(
        seed, EasyAnimateTransformer3DModel, num_attention_heads=_HEADS, attention_head_dim=_HEAD_DIM,
        in_channels=4, out_channels=4, patch_size=2, sample_width=8, sample_height=8, num_layers=2,
        mmdit_layers=2, time_embed_dim=_WIDTH, text_embed_dim=16,
    )  # fmt: skip
    blocks = dict(down_block_types=["SpatialDownBlock3D"] * 2, up_block_types=["SpatialUpBlock3D"] * 2)
    with _seeded(seed, "vae"):
        vae = AutoencoderKLMagvit(
            latent_channels=4, block_out_channels=[8, 8], layers_per_block=1, norm_num_groups=4, **blocks
        )
    return _bare(EasyAnimatePipeline, model, vae=vae, text_encoder=None, tokenizer=None)


def tiny_auraflow_pipeline(seed: int = 0) -> AuraFlowPipeline:
    model = _transformer(
        seed, AuraFlowTransformer2DModel, sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1,
        num_single_dit_layers=1, attention_head_dim=_HEAD_DIM, num_attention_heads=_HEADS, joint_attention_dim=16,
        caption_projection_dim=_WIDTH, out_channels=4, pos_embed_max_size=64,
    )  # fmt: skip
    return _bare(AuraFlowPipeline, model, vae=None, text_encoder=None, tokenizer=None)


def tiny_lumina_pipeline(seed: int = 0) -> LuminaPipeline:
    model = _transformer(
        seed, LuminaNextDiT2DModel, sample_size=8, patch_size=2, in_channels=4, hidden_size=_WIDTH, num_layers=2,
        num_attention_heads=_HEADS, num_kv_heads=1, multiple_of=16, cross_attention_dim=16,
    )  # fmt: skip
    return _bare(LuminaPipeline, model, vae=None, text_encoder=None, tokenizer=None)


def batched_calls() -> tuple[tuple[Any, dict[str, Any]], ...]:
    """(builder, guided call) of each pipeline above that batches both branches in each transformer call."""
    video = dict(num_frames=9)
    return (
        (tiny_sana_pipeline, _call(**_masked_text(1), negative_prompt=None, guidance_scale=4.5,
                                   use_resolution_binning=False)),
        (tiny_hunyuandit_pipeline, _call(**_masked_text(1), **{f"{key}_2": v for key, v in _masked_text(3, 6).items()},
                                         guidance_scale=5.0, use_resolution_binning=False)),
        (tiny_cogvideox_pipeline, _call(**_text("prompt_embeds", 1, 1, 5, 16, mask=None), guidance_scale=6.0,
                                        **video)),
        (tiny_ltx_pipeline, _call(**_masked_text(1), guidance_scale=3.0, **video)),
        (tiny_allegro_pipeline, _call(**_masked_text(1), negative_prompt=None, guidance_scale=7.5, **video)),
        (tiny_mochi_pipeline, _call(**_masked_text(1), guidance_scale=4.5, num_frames=7)),
        (tiny_latte_pipeline, _call(**_text("prompt_embeds", 1, 1, 5, 16, mask=None), negative_prompt=None,
                                    guidance_scale=7.5, video_length=3, mask_feature=False)),
        (tiny_easyanimate_pipeline, _call(**_masked_text(1), guidance_scale=5.0, height=32, width=32, num_frames=5)),
        (tiny_auraflow_pipeline, _call(**_masked_text(1), guidance_scale=3.5)),
        (tiny_lumina_pipeline, _call(**_masked_text(1), guidance_scale=4.0)),
    )  # fmt: skip
