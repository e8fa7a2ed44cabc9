"""Tiny, offline builds of the FLUX.2-dev pipeline and of MiniMax-H3's modular pipeline, for the pipeline tests.

Same rules as ``omni_accel.models.tiny_pipelines``: the genuine Diffusers / Transformers classes at toy sizes,
random weights that follow from ``seed`` alone (each component seeded on its own), nothing downloaded.

Two processors cannot be built as their checkpoints ship them in this environment, because torchvision is not
installed (they are what ``transformers`` resolves to the torchvision image / video processors):

* FLUX.2-dev's ``tokenizer`` is a ``PixtralProcessor`` in the checkpoint; without torchvision ``transformers``
  exposes only a placeholder for that class. ``Flux2Pipeline`` only calls ``tokenizer.apply_chat_template`` on it
  for text prompts, which a tokenizer with the Mistral chat template answers the same way, so the tiny pipeline
  holds that tokenizer, exposing itself as the processor's ``tokenizer`` (which text-to-image prompt
  up-sampling decodes with). Up-sampling a prompt with reference images is what would need the processor.
* MiniMax-H3's ``processor`` is a ``Qwen3VLProcessor``, whose constructor insists on a video processor of class
  ``BaseVideoProcessor``, which does not exist without torchvision (even ``video_processor=None`` fails that
  check). The ``t2va`` text step calls only ``processor.create_mm_token_type_ids``, which reads the vision token
  ids from the tokenizer; :class:`_TextOnlyQwen3VLProcessor` skips the class check for the absent video
  processor and is otherwise the real class.
"""

from __future__ import annotations

import torch
from conftest import random_minimax_h3_transformer
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
)
from diffusers.modular_pipelines import MiniMaxH3Blocks, MiniMaxH3ModularPipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)

from omni_accel.models.tiny_pipelines import (
    _BYTE_ALPHABET,
    _DEFAULT_IMAGE_SIZE,
    _TEXT_HEADS,
    _TEXT_HIDDEN,
    _cast_,
    _finish,
    _flux2_transformer,
    _flux2_vae,
    _qwen_tokenizer,
    _randomize_,
    _seeded,
)

__all__ = ["tiny_flux2_dev_pipeline", "tiny_minimax_h3_pipeline"]

# ---------------------------------------------------------------------------------------------------------------
# FLUX.2-dev
# ---------------------------------------------------------------------------------------------------------------

# Mistral-Small-3.1's control tokens, in the order its tekken vocabulary starts with.
_MISTRAL_SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "<pad>",
)
# Mistral-Small-3.1's chat template, reduced to what Flux2Pipeline's conversations hold: a system message and user
# turns whose content is a list of text (or image) parts.
_MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% for part in parts %}{{ part['text'] }}{% endfor %}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]"
    "{% for part in parts %}{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}[IMG]{% endif %}"
    "{% endfor %}[/INST]"
    "{% else %}{% for part in parts %}{{ part['text'] }}{% endfor %}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)
# Flux2Pipeline stacks the Mistral hidden states after these layers by default.
_DEV_TEXT_LAYERS = (10, 20, 30)


class _MistralTokenizer(PreTrainedTokenizerFast):
    """Stands for FLUX.2-dev's ``PixtralProcessor`` on text: ``Flux2Pipeline.upsample_prompt`` decodes the
    generated prompt with ``tokenizer.tokenizer``, the processor's tokenizer, which here is itself."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        return self


def _mistral_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """Byte-level BPE tokenizer (tekken is one) with Mistral's control tokens and chat template.

    Bytes alone cover any string; the merges spell out each word of ``template`` (the pipeline's system message),
    so it takes about as many tokens as with the real vocabulary and a short ``max_sequence_length`` still leaves
    room for the prompt after it.
    """
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab = {token: i for i, token in enumerate(_MISTRAL_SPECIAL_TOKENS)}
    vocab.update({char: len(vocab) + i for i, char in enumerate(_BYTE_ALPHABET)})
    merges: list[tuple[str, str]] = []
    for word, _ in pre_tokenizer.pre_tokenize_str(template):
        for end in range(2, len(word) + 1):
            if word[:end] not in vocab:
                merges.append((word[: end - 1], word[end - 1]))
                vocab[word[:end]] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    tokenizer = _MistralTokenizer(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=list(_MISTRAL_SPECIAL_TOKENS[3:-1]),
        model_max_length=131072,
    )
    tokenizer.chat_template = _MISTRAL_CHAT_TEMPLATE
    return tokenizer


def _mistral3_text_encoder(tokenizer: PreTrainedTokenizerFast, layers: int, seed: int):
    """Mistral-Small-3.1 (``Mistral3ForConditionalGeneration``) at a toy width, with ``layers`` decoder layers.

    The class builds its Pixtral vision tower and projector unconditionally, so they exist at the smallest size
    the config accepts; text prompts never reach them.
    """
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": len(tokenizer),
            "hidden_size": _TEXT_HIDDEN,
            "intermediate_size": 2 * _TEXT_HIDDEN,
            "num_hidden_layers": layers,
            "num_attention_heads": _TEXT_HEADS,
            "num_key_value_heads": 1,
            "head_dim": _TEXT_HIDDEN // _TEXT_HEADS,
            "max_position_embeddings": 2048,
            "sliding_window": None,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "image_size": 32,
            "patch_size": 8,
        },
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
    )
    with _seeded(seed, "text_encoder"):
        return Mistral3ForConditionalGeneration(config)


def tiny_flux2_dev_pipeline(
    *,
    seed: int = 0,
    num_layers: int = 1,
    num_single_layers: int = 2,
    num_attention_heads: int = 2,
    attention_head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Flux2Pipeline:
    """FLUX.2-dev text-to-image pipeline (FLUX.2 transformer *with* the embedded guidance, Mistral-Small-3.1 text
    encoder, FLUX.2 VAE) at toy size. One transformer call per step: ``guidance_scale`` is embedded, not a second
    branch. The text encoder has the 30 layers the pipeline reads hidden states from, at a toy width; its
    tokenizer is a tokenizer rather than the checkpoint's ``PixtralProcessor`` (see the module docstring). Called
    without height/width the pipeline renders 32x32."""
    tokenizer = _mistral_tokenizer(SYSTEM_MESSAGE)
    text_encoder = _mistral3_text_encoder(tokenizer, max(_DEV_TEXT_LAYERS), seed)
    blocks = dict(num_layers=num_layers, num_single_layers=num_single_layers)
    heads = dict(num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim)
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=_flux2_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_flux2_transformer(seed, len(_DEV_TEXT_LAYERS), guidance_embeds=True, **blocks, **heads),
    )
    pipe.default_sample_size = _DEFAULT_IMAGE_SIZE // pipe.vae_scale_factor
    return _finish(pipe, dtype, device)


# ---------------------------------------------------------------------------------------------------------------
# MiniMax-H3
# ---------------------------------------------------------------------------------------------------------------

_QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# MiniMax-H3 conditions on hidden_states[50] of its Qwen3-VL encoder, so the toy encoder needs 51 layers.
_MINIMAX_TEXT_LAYERS = 51


class _TextOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """A ``Qwen3VLProcessor`` without a video processor, which its constructor refuses when torchvision is
    missing (the base class it checks against is then not importable): only that check is skipped."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def _qwen3vl_text_encoder(tokenizer, text_dim: int, seed: int) -> Qwen3VLForConditionalGeneration:
    """Qwen3-VL at a toy width with the 51 layers MiniMax-H3 reads; its (required) vision tower is one block."""
    head_dim = text_dim // _TEXT_HEADS
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _QWEN_VISION_TOKENS}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": text_dim,
            "intermediate_size": 2 * text_dim,
            "num_hidden_layers": _MINIMAX_TEXT_LAYERS,
            "num_attention_heads": _TEXT_HEADS,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                # temporal / height / width share of the head's rotary frequency pairs
                "mrope_section": [head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6],
                "mrope_interleaved": True,
            },
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "patch_size": 8,
            "out_hidden_size": text_dim,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    with _seeded(seed, "text_encoder"):
        return Qwen3VLForConditionalGeneration(config)


def tiny_minimax_h3_components(seed: int = 0, **transformer_overrides) -> dict:
    """Every component of MiniMax-H3's ``t2va`` workflow at toy size.

    The transformer has the conftest's ``random_minimax_h3_transformer`` config (its text width is the encoder's, its
    video and audio channels the two VAEs' latent channels). The video VAE keeps the released temporal geometry
    (17-frame chunks, 4x temporal compression: ``17 n + 5`` frames give ``5 n + 2`` latent frames) but compresses
    space only 2x, so an 8x8 canvas is 2x2 = 4 transformer rows per latent frame. The audio VAE is mono with a hop
    of 4 samples; MiniMax-H3 packs its stereo as two blocks of rows, 40 latents per second each.
    """
    # The conftest's config, freshly initialised and then redrawn as every tiny denoiser is (N(0, 1/fan_in)
    # matrices, near-one norm scales): its own N(0, 0.1) weights shrink the velocity so much that two steps
    # barely move the noise, and a wrong transformer output would hide under the 1e-5 tolerance.
    with _seeded(seed, "transformer"):  # also keeps the conftest builder's manual_seed off the caller's RNG
        config = random_minimax_h3_transformer(seed, **transformer_overrides).config
        transformer = MiniMaxH3Transformer3DModel.from_config(config)
        _randomize_(transformer)

    tokenizer = _qwen_tokenizer("{}")
    tokenizer.add_tokens(list(_QWEN_VISION_TOKENS), special_tokens=True)
    processor = _TextOnlyQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(patch_size=8, merge_size=2),
        tokenizer=tokenizer,
        video_processor=None,
    )
    text_encoder = _qwen3vl_text_encoder(tokenizer, config.text_dim, seed)

    with _seeded(seed, "vae"):
        vae = AutoencoderKLMiniMaxH3(
            latent_channels=config.in_channels,
            block_out_channels=(8, 8),
            layers_per_block=1,
            spatial_downsample_factors=(2, 2),  # spatial 2 wherever temporal is 2, as in the real VAE
            temporal_downsample_factors=(2, 2),
            norm_num_groups=4,
            decoder_num_layers=1,
            decoder_num_attention_heads=2,
            decoder_attention_head_dim=8,
            decoder_num_register_tokens=1,
            decoder_ffn_mult=2,
            latents_mean=tuple(0.1 * i for i in range(config.in_channels)),
            latents_std=tuple(1.0 + 0.1 * i for i in range(config.in_channels)),
        )
    with _seeded(seed, "audio_vae"):
        audio_vae = AutoencoderKLMiniMaxH3Audio(
            encoder_dim=4,
            encoder_rates=(2, 2),
            latent_dim=2 * config.audio_in_channels,
            latent_channels=config.audio_in_channels,
            num_attention_heads=2,
            decoder_dim=8,
            decoder_rates=(2, 2),
            decoder_kernel_sizes=(4, 4),
            resblock_kernel_sizes=(3,),
            resblock_dilation_sizes=((1, 3),),
            sampling_rate=160,  # 40 latents per second at a hop of 4 samples
            latents_mean=[0.0] * config.audio_in_channels,
            latents_std=[1.0] * config.audio_in_channels,
        )
    return dict(
        transformer=transformer,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        vae=vae,
        audio_vae=audio_vae,
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )


def tiny_minimax_h3_pipeline(
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    **transformer_overrides,
) -> MiniMaxH3ModularPipeline:
    """MiniMax-H3's modular pipeline (``MiniMaxH3Blocks``: text -> packed text/audio/video denoising -> video and
    audio decode) holding :func:`tiny_minimax_h3_components`. Call it with ``height=16, width=16`` (the canvas must
    be a multiple of 8 here: the VAE's 4x and the 2x2 patches) and a ``num_frames`` of 5-15 seconds at 24 fps (e.g. 124): the pipeline's own
    defaults are the released 768-pixel canvas."""
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(**tiny_minimax_h3_components(seed, **transformer_overrides))
    for name in ("transformer", "text_encoder", "vae", "audio_vae"):
        module = getattr(pipe, name)
        module.eval()
        _cast_(module, dtype)
        module.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe
