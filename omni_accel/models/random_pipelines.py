"""Full-size pipelines with random weights, built on the device: the real architectures, offline.

Speed depends on the shapes, not on the weights, so a released model's architecture with random weights
measures what the checkpoint would, with nothing downloaded. Everything is created on ``device`` (a 12B
transformer drawn on a CPU would take minutes and its memory) from ``seed`` alone, so every rank of a
torchrun launch builds the same weights. The tokenizers are the tiny pipelines' byte-level ones: a prompt
becomes as many tokens as it has bytes, and the pipelines pad to their usual lengths.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from .tiny_pipelines import _clip_tokenizer, _finish, _randomize_, _t5_tokenizer

__all__ = ["random_flux_dev_pipeline"]

# FLUX.1-dev's released configs (transformer, CLIP-L text tower, T5-XXL encoder, VAE).
FLUX_DEV_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
_CLIP_L = dict(
    hidden_size=768,
    intermediate_size=3072,
    projection_dim=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    hidden_act="quick_gelu",
)
_T5_XXL = dict(
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
)
FLUX_DEV_VAE = dict(
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def random_flux_dev_pipeline(
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
) -> FluxPipeline:
    """FLUX.1-dev's pipeline (12B transformer, CLIP-L, T5-XXL, 16-channel VAE) with random weights on
    ``device``; it renders 1024x1024 by default, as the released one does. ``device="meta"`` builds the
    shapes only."""
    device = torch.device(device)
    clip_tokenizer, t5_tokenizer = _clip_tokenizer(), _t5_tokenizer()
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), torch.device(device):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(clip_tokenizer),
                max_position_embeddings=clip_tokenizer.model_max_length,
                bos_token_id=clip_tokenizer.bos_token_id,
                eos_token_id=clip_tokenizer.eos_token_id,
                pad_token_id=clip_tokenizer.pad_token_id,
                **_CLIP_L,
            )
        )
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(t5_tokenizer),
                pad_token_id=t5_tokenizer.pad_token_id,
                eos_token_id=t5_tokenizer.eos_token_id,
                decoder_start_token_id=t5_tokenizer.pad_token_id,
                **_T5_XXL,
            )
        )
        transformer = FluxTransformer2DModel(**FLUX_DEV_TRANSFORMER)
        _randomize_(transformer)
        vae = AutoencoderKL(**FLUX_DEV_VAE)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )
    return _finish(pipe, dtype, device)
