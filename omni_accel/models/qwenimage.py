"""Native Qwen-Image blocks (text-to-image, image-to-image, inpaint, ControlNet and the Edit pipelines):
Diffusers' QwenImageTransformer2DModel keeps its embedders, RoPE tables and output layers; its blocks run
the shared double-stream math (``layers.double_stream``) over packed QKV GEMMs, with the text padding as a
key mask through our attention.

Only what is Qwen-Image's own lives here: the table of projections, the complex RoPE tables turned into
the cos/sin pairs our q/k kernel takes, the joint key mask, and what makes a call fall back to Diffusers'.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    QwenImageTransformerBlock,
)

from ..layers.attention import AttentionSite, places_inputs
from ..layers.double_stream import BlockConstants, Rope, double_block
from ..layers.fused import clip_fp16
from ..layers.projection import LinearWeights
from ..parallel import Colwise, ParallelPlan, Rowwise, SequencePlan, Split
from .base import NativeBlock, NativeModel, image_output_like, processor_kwargs_reason, processor_reason
from .forward_memo import ForwardMemo

_PROCESSOR_TAKES = frozenset(
    {
        "hidden_states",
        "encoder_hidden_states",
        "encoder_hidden_states_mask",
        "image_rotary_emb",
    }
)


def qwen_block(
    img: torch.Tensor,
    txt: torch.Tensor,
    img_mod: torch.Tensor,
    txt_mod: torch.Tensor,
    rope: Rope,
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor | None],
    c: BlockConstants,
    attn_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusers' QwenImageTransformerBlock.forward: the shared double-stream block, both streams clipped
    in float16."""
    txt, img = double_block(img, txt, img_mod, txt_mod, rope, w, norms, c, attn_mask)
    return clip_fp16(txt), clip_fp16(img)


def _joint_rope(img_freqs: torch.Tensor, txt_freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-Image's complex tables ``[S, D/2]`` (one per stream) as the ``(cos, sin)`` ``[S_txt + S_img, D]``
    our kernels rotate adjacent pairs with: Diffusers multiplies each pair ``(x[2i], x[2i+1])`` as a complex
    number by the table's entry, which is this rotation."""
    joint = torch.cat([txt_freqs, img_freqs])
    return (
        joint.real.float().repeat_interleave(2, dim=-1).contiguous(),
        joint.imag.float().repeat_interleave(2, dim=-1).contiguous(),
    )


def _per_token(modulation: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Qwen-Image-Edit-2511's per-token modulation: ``modulation`` ``[2B, 6D]`` holds each sample's two
    rows (the noisy target's, then the references'); ``index`` ``[B, S]`` says which one each image token
    takes (0 or 1), as ``[B, S, 6D]``."""
    first, second = modulation.chunk(2, dim=0)
    return torch.where(index.unsqueeze(-1) == 0, first.unsqueeze(1), second.unsqueeze(1))


def _joint_mask(text_mask: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """The processor's mask: the text padding, every image token kept, as ``[B, 1, 1, S_txt + S_img]``."""
    image = text_mask.new_ones(text_mask.shape[0], image_tokens, dtype=torch.bool)
    return torch.cat([text_mask.bool(), image], dim=1)[:, None, None, :]


class NativeQwenImageTransformerBlock(NativeBlock, QwenImageTransformerBlock):
    """Qwen-Image's double-stream block: image and text streams with their own weights, joined in
    attention over ``[text, image]`` with the text padding masked."""

    tanh_gelus = ("img_mlp.net.0", "txt_mlp.net.0")

    packed = {
        "img_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    }
    linears = {
        "img_mod": "img_mod.1",
        "txt_mod": "txt_mod.1",
        "img_out": "attn.to_out.0",
        "txt_out": "attn.to_add_out",
        "img_up": "img_mlp.net.0.proj",
        "img_down": "img_mlp.net.2",
        "txt_up": "txt_mlp.net.0.proj",
        "txt_down": "txt_mlp.net.2",
    }
    # Diffusers' _tp_plan splits the same projections the same way; ours also splits the AdaLN modulation
    # projections (gathered whole) and declares the packed QKV GEMMs.
    tp_plan = {
        **dict.fromkeys(packed["img_qkv"] + packed["txt_qkv"], Colwise()),
        "attn.to_out.0": Rowwise(),
        "attn.to_add_out": Rowwise(),
        "img_mod.1": Colwise(),
        "txt_mod.1": Colwise(),
        "img_mlp.net.0.proj": Colwise(),
        "img_mlp.net.2": Rowwise(),
        "txt_mlp.net.0.proj": Colwise(),
        "txt_mlp.net.2": Rowwise(),
    }
    modulations = ("img_mod", "txt_mod")
    attention_modules = ("attn",)
    site = AttentionSite("qwenimage.joint", "self")
    sites = (site,)
    math = staticmethod(qwen_block)
    _ropes, _masks = ForwardMemo(), ForwardMemo()  # per thread, the last forward's
    memos = (_ropes, _masks)

    def head_dim(self) -> int:
        return self.attention_head_dim

    def unsupported_reason(
        self, joint_attention_kwargs: dict[str, Any] | None, modulate_index: Any, rope: Any
    ) -> str | None:
        reason = processor_reason(self.attn, QwenDoubleStreamAttnProcessor2_0) or processor_kwargs_reason(
            QwenDoubleStreamAttnProcessor2_0, _PROCESSOR_TAKES, joint_attention_kwargs
        )
        if reason is not None:
            return reason
        if rope is None or not (
            isinstance(rope, tuple | list)
            and len(rope) == 2
            and all(isinstance(t, torch.Tensor) and t.is_complex() and t.ndim == 2 for t in rope)
        ):
            return "RoPE tables other than Qwen-Image's two complex [tokens, head_dim / 2] ones"
        return None

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        modulate_index: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = (hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, image_rotary_emb)

        def run(math, prepared):
            modulation, rope, weights, norms, constants, mask = prepared
            args = (*modulation, rope, weights, norms, constants, mask)
            return math(hidden_states, encoder_hidden_states, *args)

        return self.native_call(
            functools.partial(super().forward, *inputs, joint_attention_kwargs, modulate_index),
            lambda: self._prepare(*inputs, joint_attention_kwargs, modulate_index, inputs),
            run,
        )

    @torch.compiler.disable
    def _prepare(
        self,
        hidden_states,
        encoder_hidden_states,
        text_mask,
        temb,
        rope,
        joint_attention_kwargs,
        modulate_index,
        inputs,
    ):
        """Everything host-side (weights, the projection cache, the joint RoPE and mask, constants), or None
        when this call runs Diffusers' forward."""
        weights = self.native_weights(joint_attention_kwargs, modulate_index, rope, inputs=inputs)
        if weights is None:
            return None
        runtime = self.omni_runtime
        if self.zero_cond_t:  # temb: the timestep's embedding, then a zero timestep's (the references')
            img_mod = self.modulate("img_mod", temb, weights)
            txt_mod = self.modulate("txt_mod", temb.chunk(2, dim=0)[0], weights)
            if modulate_index is not None:
                img_mod = _per_token(
                    img_mod, self.own_share(modulate_index, "image", 1, hidden_states.shape[1], per_row=True)
                )
            modulation = [img_mod, txt_mod]
        else:
            modulation = [self.modulate(name, temb, weights) for name in self.modulations]
        img_freqs, txt_freqs = rope
        joint_rope = self._ropes.get((img_freqs, txt_freqs), None, lambda: _joint_rope(img_freqs, txt_freqs))
        mask = None
        if text_mask is not None:
            text_mask = self.own_share(text_mask, "text", 1, encoder_hidden_states.shape[1])
            rows = runtime.rows("image")  # tokens split over the TP ranks: attention sees them gathered
            tokens = hidden_states.shape[1] if rows is None else sum(rows.sizes[0])
            mask = self._masks.get((text_mask,), tokens, lambda: _joint_mask(text_mask, tokens))
        constants = BlockConstants(
            self.attention_head_dim,
            self.img_norm1.eps,
            self.attn.norm_q.eps,
            type(self).site,
            True,
            runtime.rows("image"),
            runtime.rows("text"),
            mask is None and places_inputs(),
            False,
            self.attention_module_call("attn"),
        )
        norms = {name: getattr(self.attn, f"norm_{name}").weight for name in ("q", "k", "added_q", "added_k")}
        return modulation, joint_rope, weights, norms, constants, mask


def true_cfg_pairs(arguments: dict[str, Any]) -> bool:
    """The Qwen-Image pipelines call the transformer twice per step (cond, then uncond) exactly when true CFG
    is on: a scale above 1 and a negative prompt (or its embeddings)."""
    negative = (
        arguments.get("negative_prompt") is not None or arguments.get("negative_prompt_embeds") is not None
    )
    return arguments.get("true_cfg_scale", 1.0) > 1 and negative


QWEN_IMAGE = NativeModel(
    blocks={"transformer_blocks": NativeQwenImageTransformerBlock},
    parallel=ParallelPlan(
        name="Qwen-Image",
        attention_heads="num_attention_heads",
        # Diffusers' _cp_plan splits the same tensors at the same places: the streams at the first block
        # (after the RoPE tables are made for the whole sequence), the tables themselves, the output.
        # Ours names each split's stream, and splits the ControlNet residuals with the image tokens; each
        # block takes its share of the text mask (and of Edit-2511's per-token index) itself.
        sequence=SequencePlan(
            inputs={"controlnet_block_samples": Split("image", 1)},
            submodule_inputs={
                "transformer_blocks.0": {
                    "hidden_states": Split("image", 1),
                    "encoder_hidden_states": Split("text", 1),
                },
            },
            submodule_outputs={
                "pos_embed": {0: Split("image", 0, positions=True), 1: Split("text", 0, positions=True)}
            },
            output=("proj_out", Split("image", 1)),
        ),
        batched_inputs=(
            "hidden_states",
            "encoder_hidden_states",
            "encoder_hidden_states_mask",
            "timestep",
            "guidance",
            "controlnet_block_samples",
            "img_shapes",  # per sample: Edit-2511's per-token modulation is built from them
        ),
        output_like=image_output_like,
    ),
    cfg_pairing=true_cfg_pairs,
    falls_back_on=(
        "custom attention processors, Diffusers attention backends set on a processor (or process-wide, where"
        " no provider of ours runs the same kernel), fuse_qkv_projections(), DoRA adapters, hooks on a "
        "submodule (but TaylorSeer's on attention, which runs around the native attention), active dropout in"
        " training mode, gradients flowing through a block and a user's torch.compile of the blocks run "
        "Diffusers' forward of the block (counted in the report, except under torch.compile; an error under "
        "tensor parallelism)"
    ),
)
