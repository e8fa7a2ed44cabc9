"""Tiny, offline Diffusers pipelines with random weights, for tests, examples and notebooks.

Real checkpoints weigh gigabytes and live on the Hugging Face Hub, but acceleration code only needs the same
classes, call paths and tensor layouts. Every builder here wires the genuine Diffusers / Transformers classes
at toy sizes, so a two-step 32x32 generation takes well under a second on CPU, nothing is downloaded, and
every weight follows from ``seed`` alone.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
    FluxPipeline,
    FluxTransformer2DModel,
    ModelMixin,
    QwenImageControlNetInpaintPipeline,
    QwenImageControlNetModel,
    QwenImageControlNetPipeline,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImageMultiControlNetModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
    WanVACEPipeline,
    WanVACETransformer3DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from tokenizers import pre_tokenizers
from transformers import (
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    CLIPVisionConfig,
    CLIPVisionModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

__all__ = [
    "flux_rope_axes",
    "tiny_flux2_klein_pipeline",
    "tiny_flux_pipeline",
    "tiny_qwenimage_controlnet_pipeline",
    "tiny_qwenimage_edit_pipeline",
    "tiny_qwenimage_pipeline",
    "tiny_sd3_pipeline",
    "tiny_wan_pipeline",
    "tiny_zimage_pipeline",
]

# Text encoders are never what is being accelerated, so they share one fixed toy size.
_TEXT_HIDDEN = 32
_TEXT_LAYERS = 2
_TEXT_HEADS = 2
# Latent channels of the released FLUX / SD3 / Wan / QwenImage VAEs; kept so the packing maths is the real one.
_LATENT_CHANNELS = 16
# Default image side (pixels) the image pipelines fall back to when called without height/width.
_DEFAULT_IMAGE_SIZE = 32

_BYTE_ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())
_QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-VL's vision tokens, in the order its config names their ids: image, video, vision start / end.
_QWEN_VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


@contextmanager
def _seeded(seed: int, component: str) -> Iterator[None]:
    """Seed the CPU generator from (seed, component) and restore the caller's RNG state afterwards.

    A per-component seed makes each component's weights independent of what was built before it (changing
    one size knob does not reshuffle every other component), and forking keeps the builders free of side
    effects on the caller's global random stream.
    """
    digest = hashlib.sha256(f"{seed}/{component}".encode()).digest()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int.from_bytes(digest[:8], "little"))
        yield


def _randomize_(model: torch.nn.Module) -> None:
    """Redraw every parameter of a denoiser in place so each one influences the output.

    Default init leaves biases at zero and norm scales at one, so whole parameter groups would start out
    inert and a kernel that mishandles them could still pass a parity test. Matrices get N(0, 1/fan_in),
    which keeps activations O(1) through the blocks and attention logits far from uniform; vectors keep
    their init plus N(0, 0.1^2) noise, so norm scales stay near one and biases become non-zero.
    """
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, param[0].numel() ** -0.5)
            else:
                param.add_(torch.randn_like(param), alpha=0.1)


def flux_rope_axes(attention_head_dim: int) -> tuple[int, int, int]:
    """Split a head dim into the (index, height, width) RoPE axes FLUX-style transformers need.

    The axes must be even (rotary pairs) and sum to the head dim; height and width get about 7/16 each, the
    proportion of the released models' (16, 56, 56) split for 128-dim heads.
    """
    if attention_head_dim % 2 or attention_head_dim < 6:
        raise ValueError(
            f"attention_head_dim must be even and >= 6 for 3-axis RoPE, got {attention_head_dim}"
        )
    spatial = max(2, attention_head_dim * 7 // 32 * 2)
    return attention_head_dim - 2 * spatial, spatial, spatial


def _cast_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating weights the way ``from_pretrained(torch_dtype=dtype)`` would.

    Diffusers keeps a model's ``_keep_in_fp32_modules`` (Wan's norms and time embedder, for instance) in
    float32 when loading in low precision; a plain ``.to(dtype)`` would not, so the tiny pipeline would run
    different numerics from the real one.
    """
    keep_fp32 = (isinstance(model, ModelMixin) and model._keep_in_fp32_modules) or []
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if tensor.is_floating_point():
                fp32 = any(module in name.split(".") for module in keep_fp32)
                tensor.data = tensor.data.to(torch.float32 if fp32 else dtype)


def _finish(pipe: DiffusionPipeline, dtype: torch.dtype, device: torch.device | str) -> DiffusionPipeline:
    """Put every model in eval mode at ``dtype`` on ``device`` and silence the progress bars for tests."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
            _cast_(component, dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _clip_tokenizer() -> CLIPTokenizer:
    """Byte-level CLIP tokenizer without merges: every byte is its own token, so any string encodes exactly."""
    tokens = [
        *_BYTE_ALPHABET,
        *(char + "</w>" for char in _BYTE_ALPHABET),
        "<|startoftext|>",
        "<|endoftext|>",
    ]
    return CLIPTokenizer(vocab={token: i for i, token in enumerate(tokens)}, merges=[], model_max_length=77)


def _t5_tokenizer() -> T5Tokenizer:
    """Unigram T5 tokenizer over printable ASCII, as bare and word-initial pieces.

    Anything else maps to <unk>, as unseen characters do with the real SentencePiece vocabulary, so any string
    encodes. ``model_max_length`` is the real 512: the pipelines pad to their own ``max_sequence_length`` and
    the relative-position encoder accepts any length.
    """
    chars = [char for char in string.printable if not char.isspace()]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + char, -2.0) for char in chars] + [(char, -3.0) for char in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def _qwen_tokenizer(template: str, vision: bool = False) -> Qwen2Tokenizer:
    """Byte-level Qwen2 tokenizer whose merges spell out each word of the pipeline's prompt template.

    Bytes alone cover any string. The merges make the template's fixed prefix come out as the same number of
    tokens as with the real vocabulary, which QwenImagePipeline relies on when it drops its first
    ``prompt_template_encode_start_idx`` tokens, so only the user's prompt reaches the transformer.
    ``vision=True`` adds Qwen2.5-VL's vision tokens as special tokens (after the others), for a processor
    that expands ``<|image_pad|>`` into one token per merged image patch.
    """
    specials = _QWEN_SPECIAL_TOKENS + (_QWEN_VISION_TOKENS if vision else ())
    splitter = Qwen2Tokenizer().backend_tokenizer.pre_tokenizer
    # Special tokens and the "{}" prompt slot are not spelled with merges, so split them out first.
    separators = "|".join(re.escape(token) for token in (*specials, "{}"))
    words = [
        word for segment in re.split(separators, template) for word, _ in splitter.pre_tokenize_str(segment)
    ]
    vocab = {char: i for i, char in enumerate(_BYTE_ALPHABET)}
    merges: list[tuple[str, str]] = []
    for word in words:
        for end in range(2, len(word) + 1):
            if word[:end] not in vocab:
                merges.append((word[: end - 1], word[end - 1]))
                vocab[word[:end]] = len(vocab)
    # BPE applies the lowest-ranked merge first, so one word's merges can cut into another's chain ("c"+"o"
    # from "color" leaves " consistency" as "Ġ", "co", "n", ...): join what such a word still comes out as
    # with merges ranked after all the others, which no word already whole ever reaches.
    ranks = {pair: rank for rank, pair in enumerate(merges)}
    for word in words:
        while len(pieces := _bpe(word, ranks)) > 1:
            ranks[pieces[0], pieces[1]] = len(merges)
            merges.append((pieces[0], pieces[1]))
            vocab.setdefault(pieces[0] + pieces[1], len(vocab))
    for token in specials:
        vocab[token] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=list(specials[1:]),
    )


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """``word`` split by byte-pair encoding with ``ranks``: the lowest-ranked adjacent pair merged first,
    as the tokenizers library does."""
    pieces = list(word)
    while len(pieces) > 1:
        rank, i = min(
            (ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(pieces, pieces[1:], strict=False))
        )
        if rank == len(ranks):
            break
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def _clip_text_encoder(
    model_cls: type[CLIPTextModel] | type[CLIPTextModelWithProjection],
    tokenizer: CLIPTokenizer,
    seed: int,
    component: str,
) -> CLIPTextModel | CLIPTextModelWithProjection:
    """Tiny CLIP text tower whose special-token ids come from ``tokenizer``, so the pooled EOS lookup is right."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=2 * _TEXT_HIDDEN,
        projection_dim=_TEXT_HIDDEN,
        num_hidden_layers=_TEXT_LAYERS,
        num_attention_heads=_TEXT_HEADS,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _seeded(seed, component):
        return model_cls(config)


def _t5_encoder(
    model_cls: type[T5EncoderModel] | type[UMT5EncoderModel],
    tokenizer: T5Tokenizer,
    d_model: int,
    seed: int,
    component: str,
) -> T5EncoderModel | UMT5EncoderModel:
    """Tiny gated-GELU (T5 v1.1 / UMT5 style) encoder whose special-token ids come from ``tokenizer``."""
    config_cls = UMT5Config if model_cls is UMT5EncoderModel else T5Config
    config = config_cls(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_model // _TEXT_HEADS,
        d_ff=2 * d_model,
        num_layers=_TEXT_LAYERS,
        num_heads=_TEXT_HEADS,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    with _seeded(seed, component):
        return model_cls(config)


def _image_vae(seed: int, scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    """Two-level 2D VAE with 16 latent channels.

    It downsamples 2x per side instead of the released 8x, so a 32x32 image still gives 8x8 = 64 packed tokens.
    """
    with _seeded(seed, "vae"):
        return AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(16, 32),
            layers_per_block=1,
            latent_channels=_LATENT_CHANNELS,
            norm_num_groups=8,
            sample_size=_DEFAULT_IMAGE_SIZE,
            scaling_factor=scaling_factor,
            shift_factor=shift_factor,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )


def tiny_flux_pipeline(
    *,
    seed: int = 0,
    guidance_embeds: bool = False,
    num_layers: int = 2,
    num_single_layers: int = 2,
    num_attention_heads: int = 2,
    attention_head_dim: int = 16,
    axes_dims_rope: tuple[int, int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> FluxPipeline:
    """FLUX.1 text-to-image pipeline (dual + single stream MMDiT, CLIP + T5, 2x2 latent packing) at toy size.

    ``guidance_embeds=True`` gives the guidance-distilled (FLUX.1-dev) variant that embeds ``guidance_scale``.
    ``axes_dims_rope`` defaults to :func:`flux_rope_axes` of the head dim. Called without height/width the
    pipeline renders 32x32 instead of the real default 1024x1024.
    """
    clip_tokenizer = _clip_tokenizer()
    t5_tokenizer = _t5_tokenizer()
    text_encoder = _clip_text_encoder(CLIPTextModel, clip_tokenizer, seed, "text_encoder")
    text_encoder_2 = _t5_encoder(T5EncoderModel, t5_tokenizer, _TEXT_HIDDEN, seed, "text_encoder_2")
    with _seeded(seed, "transformer"):
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * _LATENT_CHANNELS,
            num_layers=num_layers,
            num_single_layers=num_single_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            joint_attention_dim=text_encoder_2.config.d_model,
            pooled_projection_dim=text_encoder.config.hidden_size,
            guidance_embeds=guidance_embeds,
            axes_dims_rope=axes_dims_rope or flux_rope_axes(attention_head_dim),
        )
        _randomize_(transformer)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=_image_vae(seed, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )
    pipe.default_sample_size = _DEFAULT_IMAGE_SIZE // pipe.vae_scale_factor
    return _finish(pipe, dtype, device)


def tiny_sd3_pipeline(
    *,
    seed: int = 0,
    num_layers: int = 2,
    num_attention_heads: int = 2,
    attention_head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> StableDiffusion3Pipeline:
    """Stable Diffusion 3 pipeline (MMDiT, two projected CLIP towers + T5, classifier-free guidance) at toy size.

    The T5 width is the sum of both CLIP widths, as in the real model, because the pipeline zero-pads the
    concatenated CLIP states to the T5 width. Called without height/width it renders 32x32.
    """
    clip_tokenizer = _clip_tokenizer()
    t5_tokenizer = _t5_tokenizer()
    text_encoder = _clip_text_encoder(CLIPTextModelWithProjection, clip_tokenizer, seed, "text_encoder")
    text_encoder_2 = _clip_text_encoder(CLIPTextModelWithProjection, clip_tokenizer, seed, "text_encoder_2")
    text_encoder_3 = _t5_encoder(T5EncoderModel, t5_tokenizer, 2 * _TEXT_HIDDEN, seed, "text_encoder_3")
    vae = _image_vae(seed, scaling_factor=1.5305, shift_factor=0.0609)
    with _seeded(seed, "transformer"):
        transformer = SD3Transformer2DModel(
            sample_size=_DEFAULT_IMAGE_SIZE // 2 ** (len(vae.config.block_out_channels) - 1),
            patch_size=2,
            in_channels=_LATENT_CHANNELS,
            out_channels=_LATENT_CHANNELS,
            num_layers=num_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            joint_attention_dim=text_encoder_3.config.d_model,
            caption_projection_dim=num_attention_heads * attention_head_dim,
            pooled_projection_dim=text_encoder.config.projection_dim + text_encoder_2.config.projection_dim,
        )
        _randomize_(transformer)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer,
    )
    return _finish(pipe, dtype, device)


def tiny_wan_pipeline(
    *,
    seed: int = 0,
    num_layers: int = 2,
    num_attention_heads: int = 2,
    attention_head_dim: int = 16,
    two_experts: bool = False,
    image_to_video: bool = False,
    vace: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> WanPipeline | WanImageToVideoPipeline | WanVACEPipeline:
    """Wan 2.1 text-to-video pipeline (3D DiT with cross-attention, UMT5, causal video VAE) at toy size.

    ``two_experts=True`` gives Wan 2.2 A14B's layout: a second transformer (``transformer_2``, its own
    random weights) takes the low-noise steps below ``boundary_ratio`` 0.8 (with 4 steps: the last two).
    ``image_to_video=True`` gives Wan 2.1 I2V: a CLIP vision encoder, image K/V in every cross-attention and
    the conditioning latents as extra input channels (a ``WanImageToVideoPipeline``; pass ``prompt_embeds``,
    since Diffusers' I2V prompt cleaning needs the ``ftfy`` package). ``vace=True`` gives Wan VACE (a
    ``WanVACEPipeline``): control blocks at the first and last layers read the control video and mask.

    The VAE keeps Wan's 4x temporal compression (so ``num_frames`` must be 4k+1, e.g. 5) but compresses space
    only 4x, so small clips still give several tokens per frame; height and width must be multiples of 8.
    Call it with small sizes (e.g. ``num_frames=5, height=32, width=32``): the pipeline's own defaults are
    the real 81x480x832.
    """
    tokenizer = _t5_tokenizer()
    text_encoder = _t5_encoder(UMT5EncoderModel, tokenizer, _TEXT_HIDDEN, seed, "text_encoder")
    with _seeded(seed, "vae"):
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=_LATENT_CHANNELS,
            dim_mult=[1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[True, True],
            latents_mean=[0.0] * _LATENT_CHANNELS,
            latents_std=[1.0] * _LATENT_CHANNELS,
            scale_factor_spatial=4,
            scale_factor_temporal=4,
        )
    inner_dim = num_attention_heads * attention_head_dim

    image = {}  # I2V: the image encoder, and what the transformer needs for its image tokens
    if image_to_video:
        with _seeded(seed, "image_encoder"):
            vision = CLIPVisionConfig(
                hidden_size=24,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
            )
            image = {"image_encoder": CLIPVisionModel(vision).eval()}
            _randomize_(image["image_encoder"])
        image["image_processor"] = CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
    # I2V inputs: noise, the image's latents and a 4-channel frame mask (Wan's temporal compression)
    in_channels = 2 * _LATENT_CHANNELS + 4 if image_to_video else _LATENT_CHANNELS
    image_kv = dict(image_dim=24, added_kv_proj_dim=inner_dim) if image_to_video else {}

    # VACE's control input: the control video's latents (inactive and reactive parts) and the mask, one
    # channel per pixel of a latent cell
    vace_kw = {}
    if vace:
        cell = vae.config.scale_factor_spatial**2
        vace_kw = dict(vace_layers=sorted({0, num_layers - 1}), vace_in_channels=2 * _LATENT_CHANNELS + cell)

    def expert(name: str) -> WanTransformer3DModel:
        model_class = WanVACETransformer3DModel if vace else WanTransformer3DModel
        with _seeded(seed, name):
            model = model_class(
                patch_size=(1, 2, 2),
                num_attention_heads=num_attention_heads,
                attention_head_dim=attention_head_dim,
                in_channels=in_channels,
                out_channels=_LATENT_CHANNELS,
                text_dim=text_encoder.config.d_model,
                freq_dim=inner_dim,
                ffn_dim=2 * inner_dim,
                num_layers=num_layers,
                **image_kv,
                **vace_kw,
            )
            _randomize_(model)
        return model

    transformer = expert("transformer")
    extra = {"transformer_2": expert("transformer_2"), "boundary_ratio": 0.8} if two_experts else {}
    pipeline_class = WanVACEPipeline if vace else WanImageToVideoPipeline if image_to_video else WanPipeline
    pipe = pipeline_class(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
        transformer=transformer,
        **extra,
        **image,
    )
    return _finish(pipe, dtype, device)


def _qwen_vl_text_encoder(
    tokenizer: Qwen2Tokenizer, vision_token_ids: Sequence[int], seed: int
) -> Qwen2_5_VLForConditionalGeneration:
    """Tiny Qwen2.5-VL (text tower with multimodal RoPE, one-block vision tower) on ``tokenizer``'s ids.

    ``vision_token_ids`` are the image, video, vision-start and vision-end token ids, in that order: the
    tokenizer's own when a processor inserts image tokens, otherwise ids past its vocabulary that it never
    emits. The vision tower keeps the real 14-pixel patches, 2-frame temporal patches and 2x2 merge.
    """
    image_id, video_id, start_id, end_id = vision_token_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": max(len(tokenizer), max(vision_token_ids) + 1),
            "hidden_size": _TEXT_HIDDEN,
            "intermediate_size": 2 * _TEXT_HIDDEN,
            "num_hidden_layers": _TEXT_LAYERS,
            "num_attention_heads": _TEXT_HEADS,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                # temporal / height / width share of the head's rotary frequency pairs
                "mrope_section": [2, 3, 3],
            },
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": _TEXT_HIDDEN,
            "fullatt_block_indexes": [0],
        },
        image_token_id=image_id,
        video_token_id=video_id,
        vision_start_token_id=start_id,
        vision_end_token_id=end_id,
    )
    with _seeded(seed, "text_encoder"):
        return Qwen2_5_VLForConditionalGeneration(config)


def _qwen_vae(seed: int, downsamples: int = 1, num_res_blocks: int = 1) -> AutoencoderKLQwenImage:
    """Qwen-Image's causal VAE, 8 channels wide, halving each side ``downsamples`` times (frames never)."""
    with _seeded(seed, "vae"):
        return AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=_LATENT_CHANNELS,
            dim_mult=[1] * (downsamples + 1),
            num_res_blocks=num_res_blocks,
            temperal_downsample=[False] * downsamples,
            latents_mean=[0.0] * _LATENT_CHANNELS,
            latents_std=[1.0] * _LATENT_CHANNELS,
        )


def _qwen_transformer(
    seed: int,
    num_layers: int,
    num_attention_heads: int,
    attention_head_dim: int,
    axes_dims_rope: tuple[int, int, int] | None,
    **config: Any,
) -> QwenImageTransformer2DModel:
    """Qwen-Image's MMDiT on 2x2-packed 16-channel latents and the tiny text encoder's states, all weights
    random."""
    with _seeded(seed, "transformer"):
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * _LATENT_CHANNELS,
            out_channels=_LATENT_CHANNELS,
            num_layers=num_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            joint_attention_dim=_TEXT_HIDDEN,
            axes_dims_rope=axes_dims_rope or flux_rope_axes(attention_head_dim),
            **config,
        )
        _randomize_(transformer)
    return transformer


def tiny_qwenimage_pipeline(
    *,
    seed: int = 0,
    num_layers: int = 2,
    num_attention_heads: int = 2,
    attention_head_dim: int = 16,
    axes_dims_rope: tuple[int, int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> QwenImagePipeline:
    """Qwen-Image text-to-image pipeline (MMDiT, Qwen2.5-VL text encoder, causal VAE) at toy size.

    The Qwen2.5-VL model includes a one-block vision tower only because the class requires one; prompts never
    reach it. ``axes_dims_rope`` defaults to :func:`flux_rope_axes` of the head dim. Called without
    height/width the pipeline renders 32x32.
    """
    # Built bare only to read the prompt template the tokenizer's merges are learned from.
    template = QwenImagePipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None
    )
    tokenizer = _qwen_tokenizer(template.prompt_template_encode)
    vision_token_ids = range(len(tokenizer), len(tokenizer) + 4)  # reserved ids the tokenizer never emits
    pipe = QwenImagePipeline(
        # Dynamic shifting because the pipeline always passes a resolution-dependent ``mu``.
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=_qwen_vae(seed),
        text_encoder=_qwen_vl_text_encoder(tokenizer, vision_token_ids, seed),
        tokenizer=tokenizer,
        transformer=_qwen_transformer(
            seed, num_layers, num_attention_heads, attention_head_dim, axes_dims_rope
        ),
    )
    pipe.default_sample_size = _DEFAULT_IMAGE_SIZE // pipe.vae_scale_factor
    return _finish(pipe, dtype, device)


class _ImageQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without a video processor, which the Qwen-Image Edit pipelines never use.

    Transformers checks each sub-processor's class and, without torchvision installed, cannot even look up
    the video processor base class, so the real class refuses ``video_processor=None``; this one skips that
    check alone. Text and images go through Qwen2VLProcessor's own ``__call__``.
    """

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


# What the Qwen2-VL image processor resizes each image to (in pixels, multiples of 28 per side): 2x2 to
# 4x4 merged patches, so 4 to 16 image tokens per picture instead of up to 1280.
_VL_MIN_PIXELS = 56 * 56
_VL_MAX_PIXELS = 112 * 112


def tiny_qwenimage_edit_pipeline(
    *,
    seed: int = 0,
    plus: bool = False,
    zero_cond_t: bool = False,
    num_layers: int = 2,
    num_attention_heads: int = 2,
    attention_head_dim: int = 16,
    axes_dims_rope: tuple[int, int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> QwenImageEditPipeline | QwenImageEditPlusPipeline:
    """Qwen-Image-Edit pipeline (the condition image's latent tokens after the noisy ones, per-image
    ``img_shapes``; a Qwen2.5-VL that sees the image through a Qwen2VLProcessor) at toy size.

    ``plus=True`` gives Qwen-Image-Edit-2509's ``QwenImageEditPlusPipeline``, which takes a list of condition
    images of any sizes (batch size 1); ``zero_cond_t=True`` gives Edit-2511's transformer, whose condition
    tokens are modulated as at timestep 0.

    Whatever its input, the pipeline resizes each condition image to about 1024x1024 pixels (hard-coded) for
    the VAE, so this VAE compresses 16x per side (the real one 8x) and has no encoder residual blocks: a
    condition image is 32x32 = 1024 tokens and encodes in well under a second on CPU. 16x is the most that
    fits those sizes (multiples of 32 pixels, 2x2-packed) at any aspect ratio. The output size defaults to
    the condition's 1024x1024 too: pass height/width (multiples of 32; 64x64 is 4 tokens). The vision
    tower sees each image at most 112x112 pixels, 16 tokens.
    """
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    # Built bare only to read the prompt template the tokenizer's merges are learned from.
    template = pipeline_class(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None
    )
    tokenizer = _qwen_tokenizer(template.prompt_template_encode, vision=True)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=_VL_MIN_PIXELS, max_pixels=_VL_MAX_PIXELS)
    pipe = pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=_qwen_vae(seed, downsamples=4, num_res_blocks=0),
        text_encoder=_qwen_vl_text_encoder(
            tokenizer, tokenizer.convert_tokens_to_ids(_QWEN_VISION_TOKENS), seed
        ),
        tokenizer=tokenizer,
        processor=_ImageQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer),
        transformer=_qwen_transformer(
            seed, num_layers, num_attention_heads, attention_head_dim, axes_dims_rope, zero_cond_t=zero_cond_t
        ),
    )
    return _finish(pipe, dtype, device)


def tiny_qwenimage_controlnet_pipeline(
    *,
    seed: int = 0,
    inpaint: bool = False,
    multi: bool = False,
    num_layers: int = 2,
    num_controlnet_layers: int = 1,
    num_attention_heads: int = 2,
    attention_head_dim: int = 16,
    axes_dims_rope: tuple[int, int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> QwenImageControlNetPipeline | QwenImageControlNetInpaintPipeline:
    """Qwen-Image ControlNet pipeline: :func:`tiny_qwenimage_pipeline`'s components (same seed, same
    weights) and a ``QwenImageControlNetModel`` of ``num_controlnet_layers`` blocks whose residuals the
    transformer adds after its blocks (one residual serving several blocks when it has fewer layers).

    The ControlNet's zero-initialised projections are drawn at random like the rest, so its residuals are
    not zero. ``multi=True`` wraps it in a ``QwenImageMultiControlNetModel`` (a union ControlNet: one model,
    a list of control images and scales). ``inpaint=True`` gives ``QwenImageControlNetInpaintPipeline``, whose
    ControlNet also reads the mask (one extra channel per packed latent pixel). Called without height/width
    the pipeline renders 32x32.
    """
    if inpaint and multi:
        raise ValueError("QwenImageControlNetInpaintPipeline takes a single QwenImageControlNetModel")
    base = tiny_qwenimage_pipeline(
        seed=seed,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        axes_dims_rope=axes_dims_rope,
    )
    with _seeded(seed, "controlnet"):
        controlnet = QwenImageControlNetModel(
            patch_size=2,
            in_channels=4 * _LATENT_CHANNELS,
            out_channels=_LATENT_CHANNELS,
            num_layers=num_controlnet_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            joint_attention_dim=_TEXT_HIDDEN,
            axes_dims_rope=axes_dims_rope or flux_rope_axes(attention_head_dim),
            extra_condition_channels=4 if inpaint else 0,
        )
        _randomize_(controlnet)
    if multi:
        controlnet = QwenImageMultiControlNetModel([controlnet])
    pipeline_class = QwenImageControlNetInpaintPipeline if inpaint else QwenImageControlNetPipeline
    pipe = pipeline_class(**base.components, controlnet=controlnet)
    pipe.default_sample_size = _DEFAULT_IMAGE_SIZE // pipe.vae_scale_factor
    return _finish(pipe, dtype, device)


# The chat template Qwen3's tokenizer applies (Flux2KleinPipeline asks for it with thinking off).
_QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Flux2KleinPipeline stacks the Qwen3 hidden states after these layers by default.
_KLEIN_TEXT_LAYERS = (9, 18, 27)


def _qwen3_text(seed: int, model_class: type, layers: int) -> tuple[Qwen2Tokenizer, torch.nn.Module]:
    """A byte-level Qwen tokenizer with Qwen3's chat template, and a toy Qwen3 text tower of ``layers``."""
    tokenizer = _qwen_tokenizer("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=2 * _TEXT_HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=_TEXT_HEADS,
        num_key_value_heads=1,
        head_dim=_TEXT_HIDDEN // _TEXT_HEADS,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _seeded(seed, "text_encoder"):
        return tokenizer, model_class(config)


_FLUX2_LATENT_CHANNELS = 4


def _flux2_vae(seed: int) -> AutoencoderKLFlux2:
    """FLUX.2's VAE at toy size: 8 channels wide, halving each side once, 4 latent channels."""
    with _seeded(seed, "vae"):
        return AutoencoderKLFlux2(
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 8),
            layers_per_block=1,
            latent_channels=_FLUX2_LATENT_CHANNELS,
            norm_num_groups=4,
        )


def _flux2_transformer(
    seed: int,
    text_layers: int,
    *,
    guidance_embeds: bool,
    num_layers: int,
    num_single_layers: int,
    num_attention_heads: int,
    attention_head_dim: int,
) -> Flux2Transformer2DModel:
    """FLUX.2's transformer on :func:`_flux2_vae`'s 2x2-packed latents and ``text_layers`` stacked hidden
    states of the tiny text encoder, every weight random. ``guidance_embeds``: FLUX.2-dev's embedded
    guidance (Klein has none)."""
    with _seeded(seed, "transformer"):
        transformer = Flux2Transformer2DModel(
            in_channels=4 * _FLUX2_LATENT_CHANNELS,  # 2x2 patches of the latent, packed
            num_layers=num_layers,
            num_single_layers=num_single_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            joint_attention_dim=text_layers * _TEXT_HIDDEN,
            timestep_guidance_channels=16,
            axes_dims_rope=(attention_head_dim // 4,) * 4,
            guidance_embeds=guidance_embeds,
        )
        _randomize_(transformer)
    return transformer


def tiny_flux2_klein_pipeline(
    *,
    seed: int = 0,
    num_layers: int = 1,
    num_single_layers: int = 2,
    num_attention_heads: int = 2,
    attention_head_dim: int = 16,
    is_distilled: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Flux2KleinPipeline:
    """FLUX.2 Klein text-to-image pipeline (FLUX.2 transformer without guidance embedding, Qwen3 text
    encoder, FLUX.2 VAE) at toy size. ``is_distilled``: the step-distilled checkpoints (one transformer call
    per step); otherwise guidance above 1 calls it twice (cond, uncond). The text encoder has the 27 layers
    the pipeline reads hidden states from, at a toy width. Called without height/width the pipeline
    renders 32x32."""
    tokenizer, text_encoder = _qwen3_text(seed, Qwen3ForCausalLM, max(_KLEIN_TEXT_LAYERS))
    blocks = dict(num_layers=num_layers, num_single_layers=num_single_layers)
    heads = dict(num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim)
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=_flux2_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_flux2_transformer(
            seed, len(_KLEIN_TEXT_LAYERS), guidance_embeds=False, **blocks, **heads
        ),
        is_distilled=is_distilled,
    )
    pipe.default_sample_size = _DEFAULT_IMAGE_SIZE // pipe.vae_scale_factor
    return _finish(pipe, dtype, device)


def tiny_zimage_pipeline(
    *,
    seed: int = 0,
    num_layers: int = 2,
    num_refiner_layers: int = 1,
    num_heads: int = 2,
    head_dim: int = 24,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ZImagePipeline:
    """Z-Image text-to-image pipeline (single-stream transformer with noise and context refiners, Qwen3
    text encoder, FLUX-style VAE) at toy size. Its default size is the real 1024x1024: pass height/width
    (32x32 is 64 image tokens)."""
    tokenizer, text_encoder = _qwen3_text(seed, Qwen3Model, _TEXT_LAYERS)
    vae = _image_vae(seed, scaling_factor=0.3611, shift_factor=0.1159)
    third = head_dim // 3
    with _seeded(seed, "transformer"):
        transformer = ZImageTransformer2DModel(
            in_channels=_LATENT_CHANNELS,
            dim=num_heads * head_dim,
            n_layers=num_layers,
            n_refiner_layers=num_refiner_layers,
            n_heads=num_heads,
            n_kv_heads=num_heads,
            cap_feat_dim=_TEXT_HIDDEN,
            axes_dims=[head_dim - 2 * third, third, third],
            axes_lens=[1024, 64, 64],
        )
        _randomize_(transformer)
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return _finish(pipe, dtype, device)
