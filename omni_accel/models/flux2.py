"""Native FLUX.2 blocks (dev and the Klein sizes): Diffusers' Flux2Transformer2DModel keeps its embedders,
RoPE tables, its AdaLN modulations (computed once per forward at model level, shared by every block) and
output layers; its double- and single-stream blocks run the shared double-stream math and the single
block below over packed QKV GEMMs (the single block's QKV and SwiGLU MLP input are already one linear in
Diffusers, its outputs read as parts), with attention through our providers.

Only what is FLUX.2's own lives here: the single block's math, the tables of projections, the CFG rule of
its pipelines and what makes a call fall back to Diffusers' forward (among them the reference-image KV
cache of Flux2KleinKVPipeline, whose processors run in Diffusers).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers.models.transformers.transformer_flux2 import (
    Flux2AttnProcessor,
    Flux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor,
    Flux2ParallelSelfAttnProcessor,
    Flux2SingleTransformerBlock,
    Flux2Transformer2DModel,
    Flux2TransformerBlock,
)

from ..layers import gated_residual, norm_modulate_gathered
from ..layers.attention import AttentionSite, places_inputs, qkv_attention, through_module
from ..layers.double_stream import BlockConstants, Rope, double_block
from ..layers.fused import clip_fp16, concat_swiglu, swiglu
from ..layers.projection import LinearWeights, apply_linear, apply_one, takes_fp8_rows
from ..parallel import ParallelPlan, SequencePlan, Split
from ..parallel.cfg import Pairing, guided_per_step
from ..parallel.diffusers_plan import tensor_plan
from .base import NativeBlock, NativeModel, image_output_like, processor_kwargs_reason, processor_reason

_PROCESSOR_TAKES = frozenset({"hidden_states", "encoder_hidden_states", "image_rotary_emb"})
_KV_PROCESSORS = (Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor)

# Diffusers' _tp_plan splits every projection of the blocks as ours would (the SwiGLU inputs' gate and
# linear halves each on their own, the single block's packed QKV+MLP by its parts) and leaves the AdaLN
# modulations whole: they run once per forward at model level, not per block. Taken as it is.
_TP_PLAN = tensor_plan("FLUX.2", Flux2Transformer2DModel._tp_plan)


def flux2_double_block(
    img: torch.Tensor,
    txt: torch.Tensor,
    img_mod: torch.Tensor,
    txt_mod: torch.Tensor,
    rope: Rope,
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor | None],
    c: BlockConstants,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusers' Flux2TransformerBlock.forward: the shared double-stream block with SwiGLU MLPs and no
    biases, the text stream clipped in float16."""
    txt, img = double_block(img, txt, img_mod, txt_mod, rope, w, norms, c, activation=swiglu)
    return clip_fp16(txt), img


def flux2_single_block(
    x: torch.Tensor,
    mod: torch.Tensor,
    rope: Rope,
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor | None],
    c: BlockConstants,
) -> torch.Tensor:
    """Diffusers' Flux2SingleTransformerBlock.forward on ``x = [text, image]``: one GEMM for QKV and the
    SwiGLU MLP's input (its five outputs read as parts: q, k, v, gate, linear), attention, the MLP's SwiGLU
    written next to the attention output (the output projection's input), one output GEMM and the gated
    residual."""
    shift, scale, gate = mod.chunk(3, dim=-1)
    rows = None if c.text_rows is None else c.text_rows + c.image_rows  # x = [text, image] on every rank
    h, gather = norm_modulate_gathered(x, shift, scale, c.eps, rows, takes_fp8_rows(w["qkv_mlp"]))

    def attend() -> torch.Tensor:  # the attention module's forward: all but the norm and the residual
        q, k, v, mlp_gate, mlp_linear = apply_linear(h, w["qkv_mlp"], gather)
        args = (c.head_dim, c.qk_eps, rope, c.site)
        out = qkv_attention([(q, k, v)], [(norms["q"], norms["k"])], *args, placed=c.placed)
        joined = concat_swiglu(out.flatten(2, 3).to(q.dtype), mlp_gate, mlp_linear)
        return apply_one(joined, w["out"], rows)

    x = gated_residual(x, gate, through_module(c.attention_module, attend))
    return clip_fp16(x)


class _Flux2Native(NativeBlock):
    site: AttentionSite
    math: Any
    processor_class: type

    def unsupported_reason(
        self, joint_attention_kwargs: dict[str, Any] | None, modulation: torch.Tensor
    ) -> str | None:
        if isinstance(self.attn.processor, _KV_PROCESSORS):
            return "the reference-image KV cache of Flux2KleinKVPipeline (its processors) runs in Diffusers"
        # [B, tokens, ...]: the model blends a modulation per token (the K/V extract)
        if modulation.ndim != 2:
            return "a modulation per token (the reference-image K/V extract of Flux2KleinKVPipeline)"
        return processor_reason(self.attn, self.processor_class) or processor_kwargs_reason(
            self.processor_class, _PROCESSOR_TAKES, joint_attention_kwargs
        )

    def head_dim(self) -> int:
        return self.attn.head_dim

    def _norms(self) -> dict[str, torch.Tensor | None]:
        names = ("q", "k", "added_q", "added_k") if hasattr(self.attn, "norm_added_q") else ("q", "k")
        return {name: getattr(self.attn, f"norm_{name}").weight for name in names}

    @torch.compiler.disable
    def _prepare(
        self, joint_attention_kwargs: dict[str, Any] | None, modulation: torch.Tensor, inputs: tuple
    ):
        """The weights, norms and constants, or None when this call runs Diffusers' forward (the reason
        counted). ``modulation``: the image stream's, from the model."""
        weights = self.native_weights(joint_attention_kwargs, modulation, inputs=inputs)
        if weights is None:
            return None
        runtime = self.omni_runtime
        constants = BlockConstants(
            self.attn.head_dim,
            self._layer_norm_eps(),
            self.attn.norm_q.eps,
            type(self).site,
            True,
            runtime.rows("image"),
            runtime.rows("text"),
            places_inputs(),
            False,
            self.attention_module_call("attn"),
        )
        return weights, self._norms(), constants


class NativeFlux2TransformerBlock(_Flux2Native, Flux2TransformerBlock):
    """FLUX.2's double-stream block: image and text streams with their own weights, joined in attention;
    the modulation of each stream comes from the model."""

    packed = {
        "img_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    }
    linears = {
        "img_out": "attn.to_out.0",
        "txt_out": "attn.to_add_out",
        "img_up": "ff.linear_in",
        "img_down": "ff.linear_out",
        "txt_up": "ff_context.linear_in",
        "txt_down": "ff_context.linear_out",
    }
    tp_plan = _TP_PLAN["transformer_blocks"]
    attention_modules = ("attn",)
    site = AttentionSite("flux2.joint", "self")
    sites = (site,)
    math = staticmethod(flux2_double_block)
    processor_class = Flux2AttnProcessor

    def _layer_norm_eps(self) -> float:
        return self.norm1.eps

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb_mod_img: torch.Tensor,
        temb_mod_txt: torch.Tensor,
        image_rotary_emb: Rope = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = (hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt, image_rotary_emb)
        return self.native_call(
            functools.partial(super().forward, *inputs, joint_attention_kwargs),
            lambda: self._prepare(joint_attention_kwargs, temb_mod_img, inputs),
            lambda math, prepared: math(*inputs, *prepared),
        )


class NativeFlux2SingleTransformerBlock(_Flux2Native, Flux2SingleTransformerBlock):
    """FLUX.2's single-stream (parallel) block over [text, image]; its modulation comes from the model."""

    linears = {"qkv_mlp": "attn.to_qkv_mlp_proj", "out": "attn.to_out"}
    # the one linear's outputs: Q, K, V, the SwiGLU's gate and linear halves (Diffusers' attribute)
    output_parts = {"qkv_mlp": "_tp_packed_col_blocks"}
    tp_plan = _TP_PLAN["single_transformer_blocks"]
    attention_modules = ("attn",)
    site = AttentionSite("flux2.single", "self")
    sites = (site,)
    math = staticmethod(flux2_single_block)
    processor_class = Flux2ParallelSelfAttnProcessor

    def _layer_norm_eps(self) -> float:
        return self.norm.eps

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        temb_mod: torch.Tensor,
        image_rotary_emb: Rope = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        split_hidden_states: bool = False,
        text_seq_len: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        inputs = (hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb)

        def run(math, prepared):
            x, text = hidden_states, text_seq_len
            if encoder_hidden_states is not None:
                text = encoder_hidden_states.shape[1]
                x = torch.cat([encoder_hidden_states, x], dim=1)
            x = math(x, temb_mod, image_rotary_emb, *prepared)
            return (x[:, :text], x[:, text:]) if split_hidden_states else x

        diffusers_args = (*inputs, joint_attention_kwargs, split_hidden_states, text_seq_len)
        return self.native_call(
            functools.partial(super().forward, *diffusers_args),
            lambda: self._prepare(joint_attention_kwargs, temb_mod, inputs),
            run,
        )


def cfg_pairs(arguments: dict[str, Any]) -> Pairing:
    """Flux2KleinPipeline (and its inpaint sibling) call the transformer twice per step (cond, then uncond)
    while guidance is on, which they ask at every step (a callback may turn it off midway), and the
    checkpoint is not step-distilled; Flux2Pipeline (dev) is guidance-distilled: one call per step, the
    scale an input."""
    pipe = arguments.get("self")
    distilled = getattr(getattr(pipe, "config", None), "is_distilled", None)
    return distilled is False and arguments.get("guidance_scale", 4.0) > 1.0 and guided_per_step(pipe)


FLUX2 = NativeModel(
    compiled_by_default=True,  # SwiGLU and its norms: Diffusers' ops, fused by the compiler
    blocks={
        "transformer_blocks": NativeFlux2TransformerBlock,
        "single_transformer_blocks": NativeFlux2SingleTransformerBlock,
    },
    parallel=ParallelPlan(
        name="FLUX.2",
        attention_heads="num_attention_heads",
        # Diffusers' _cp_plan splits the same four inputs and gathers proj_out; ours names the stream of
        # each (so uneven splits need no length exchange, and tp can split the tokens too).
        sequence=SequencePlan(
            inputs={
                "hidden_states": Split("image", 1),
                "img_ids": Split("image", -2, positions=True),  # [B, tokens, 4] (or [tokens, 4])
                "encoder_hidden_states": Split("text", 1),
                "txt_ids": Split("text", -2, positions=True),
            },
            output=("proj_out", Split("image", 1)),
        ),
        batched_inputs=("hidden_states", "encoder_hidden_states", "timestep", "guidance"),
        output_like=image_output_like,
    ),
    cfg_pairing=cfg_pairs,
    projection_cache=False,
    falls_back_on=(
        "custom attention processors, Flux2KleinKVPipeline's reference-image KV cache, Diffusers attention "
        "backends set on a processor (or process-wide, where no provider of ours runs the same kernel), "
        "fuse_qkv_projections(), DoRA adapters, hooks on a submodule (but TaylorSeer's on attention, which "
        "runs around the native attention), active dropout in training mode, gradients flowing through a "
        "block and a user's torch.compile of the blocks run Diffusers' forward of the block (counted in the "
        "report, except under torch.compile; an error under tensor or sequence parallelism)"
    ),
    limitations=(
        "exact projection cache: not used for FLUX.2: its AdaLN projections run once per forward at model "
        "level, not in every block",
    ),
)
