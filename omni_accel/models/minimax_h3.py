"""Native MiniMax-H3 blocks (joint video + audio over one packed sequence): Diffusers'
MiniMaxH3Transformer3DModel keeps its projections in and out, the packing of the three modalities, its
timestep embedding, RoPE tables and output norm; its transformer blocks and its text token refiner's
blocks run the math below over packed QKV GEMMs, with attention through our providers.

Only what is MiniMax-H3's own lives here: modulation per row of the packed sequence (each row's AdaLN
parameters chosen from a ``(timestep, modality)`` table by its index), the rotate-half RoPE of the first
channels of every head, and what makes a call fall back to Diffusers' forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AttnProcessor,
    MiniMaxH3TokenRefinerBlock,
    MiniMaxH3TransformerBlock,
)

from ..layers.attention import AttentionSite, attention, through_module
from ..layers.double_stream import BlockConstants
from ..layers.fused import qkv_norm_rope, swiglu
from ..layers.projection import LinearWeights, apply_linear, apply_one
from ..parallel import Colwise, ParallelPlan, Rowwise, SequencePlan, Split
from .base import NativeBlock, NativeModel, processor_reason

Rope = tuple[torch.Tensor, torch.Tensor] | None
_MODALITIES = 3  # video, text, audio: the rows of each timestep's AdaLN table


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MiniMax-H3's RoPE of BSHD ``x``: the first ``cos.shape[-1]`` channels of each head rotated by halves
    (``[-x2, x1]``), the others passed through; in ``x``'s dtype, as Diffusers computes it."""
    width = cos.shape[-1]
    cos, sin = cos.to(x.dtype)[None, :, None, :], sin.to(x.dtype)[None, :, None, :]
    rotary, rest = x[..., :width], x[..., width:]
    x1, x2 = rotary.chunk(2, dim=-1)
    return torch.cat((rotary * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


def _attend(h: torch.Tensor, rope: Rope, w: dict[str, LinearWeights], norms: dict, c: BlockConstants):
    """Self-attention over the packed sequence: per-head RMSNorm of q and k, their RoPE, the output
    projection."""
    q, k, v = apply_linear(h, w["qkv"])
    q, k, v = qkv_norm_rope([(q, k, v)], [(norms["q"], norms["k"])], c.head_dim, c.qk_eps, None)
    if rope is not None:
        q, k = _rotate_half(q, *rope), _rotate_half(k, *rope)
    out = attention(q, k, v, c.site, c.split)
    return apply_one(out.flatten(2, 3).to(h.dtype), w["out"])


def _feed_forward(h: torch.Tensor, w: dict[str, LinearWeights]) -> torch.Tensor:
    """Diffusers' SwiGLU FeedForward: its projection packs the linear half, then the gate."""
    return apply_one(swiglu(apply_one(h, w["ff_up"]), gate_first=False), w["ff_down"])


def minimax_block(
    x: torch.Tensor,
    mod: torch.Tensor,
    rows: torch.Tensor,
    rope: Rope,
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor],
    c: BlockConstants,
) -> torch.Tensor:
    """Diffusers' MiniMaxH3TransformerBlock.forward: pre-norm attention and SwiGLU MLP, each modulated by
    the AdaLN parameters of its row: ``mod`` ``[T * 3, 6 D]`` (a row per timestep and modality),
    ``rows`` ``[S]`` the table row of every token."""
    shift, scale, gate, shift2, scale2, gate2 = mod.index_select(0, rows).chunk(6, dim=-1)  # [S, D] each
    h = _rms(x, norms["norm1"], c.eps) * (1.0 + scale) + shift
    x = x + gate * through_module(c.attention_module, lambda: _attend(h, rope, w, norms, c))
    h = _rms(x, norms["norm2"], c.eps) * (1.0 + scale2) + shift2
    return x + gate2 * _feed_forward(h, w)


def refiner_block(
    x: torch.Tensor, w: dict[str, LinearWeights], norms: dict[str, torch.Tensor], c: BlockConstants
) -> torch.Tensor:
    """Diffusers' MiniMaxH3TokenRefinerBlock.forward: plain pre-norm attention and SwiGLU MLP."""
    h = _rms(x, norms["norm1"], c.eps)
    x = x + through_module(c.attention_module, lambda: _attend(h, None, w, norms, c))
    return x + _feed_forward(_rms(x, norms["norm2"], c.eps), w)


class _MiniMaxNative(NativeBlock):
    packed = {"qkv": ("attn.to_q", "attn.to_k", "attn.to_v")}
    linears = {"out": "attn.to_out.0", "ff_up": "ff.net.0.proj", "ff_down": "ff.net.2"}
    tp_plan = {
        **dict.fromkeys(packed["qkv"], Colwise()),
        "attn.to_out.0": Rowwise(),
        "ff.net.0.proj": Colwise(ratios=(1, 1)),  # the linear half and the gate, each split on its own
        "ff.net.2": Rowwise(),
    }
    attention_modules = ("attn",)
    site: AttentionSite

    def head_dim(self) -> int:
        return self.attn.head_dim

    def unsupported_reason(self, attention_mask: Any = None) -> str | None:
        reason = processor_reason(self.attn, MiniMaxH3AttnProcessor)
        if reason is None and attention_mask is not None:
            reason = "an attention mask (MiniMax-H3 packs one unmasked document)"
        return reason

    def _constants(self, split: bool = True) -> BlockConstants:
        return BlockConstants(
            self.attn.head_dim,
            self.norm1.eps,
            self.attn.norm_q.eps,
            type(self).site,
            split,
            None,
            None,
            False,
            False,
            self.attention_module_call("attn"),
        )

    def _norms(self) -> dict[str, torch.Tensor]:
        return {
            "norm1": self.norm1.weight,
            "norm2": self.norm2.weight,
            "q": self.attn.norm_q.weight,
            "k": self.attn.norm_k.weight,
        }


class NativeMiniMaxH3TransformerBlock(_MiniMaxNative, MiniMaxH3TransformerBlock):
    """MiniMax-H3's block over the packed sequence, its modulation chosen per row."""

    linears = {**_MiniMaxNative.linears, "mod": "adaln_proj.linear"}
    tp_plan = {**_MiniMaxNative.tp_plan, "adaln_proj.linear": Colwise()}  # the modulation: gathered whole
    modulations = ("mod",)
    site = AttentionSite("minimax_h3.self", "self")
    sites = (site,)
    math = staticmethod(minimax_block)

    def modulation_input(self, conditioning: torch.Tensor) -> torch.Tensor:
        # activated at the timestep embedding's precision (float32 in the checkpoint), cast after
        return F.silu(conditioning).to(self.adaln_proj.linear.weight.dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        temb: torch.Tensor,
        adaln_indices: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = (hidden_states, temb, adaln_indices, rotary_emb, attention_mask)

        def run(math, prepared):
            mod, rows, weights = prepared
            return math(hidden_states, mod, rows, rotary_emb, weights, self._norms(), self._constants())

        return self.native_call(
            functools.partial(super().forward, *inputs),
            lambda: self._prepare(hidden_states, temb, adaln_indices, inputs),
            run,
        )

    @torch.compiler.disable
    def _prepare(self, hidden_states, temb, adaln_indices, inputs):
        weights = self.native_weights(inputs[-1], inputs=inputs)
        if weights is None:
            return None
        table = self.modulate("mod", temb, weights).view(-1, 6 * self.adaln_proj.hidden_size)
        return table, self.own_share(adaln_indices, "packed", 0, hidden_states.shape[1]), weights


class NativeMiniMaxH3TokenRefinerBlock(_MiniMaxNative, MiniMaxH3TokenRefinerBlock):
    """A block of the text token refiner (text rows only, before they are packed)."""

    site = AttentionSite("minimax_h3.refiner", "self", ring_merges=False)  # ahead of the split
    sites = (site,)
    math = staticmethod(refiner_block)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # the text rows, before they are packed: whole on every rank under a sequence split (its attention
        # is not the packed sequence's; under tp its heads are split all the same)
        return self.native_call(
            functools.partial(super().forward, hidden_states),
            lambda: self._weights((hidden_states,)),
            lambda math, weights: math(hidden_states, weights, self._norms(), self._constants(split=False)),
        )

    @torch.compiler.disable
    def _weights(self, inputs: tuple):
        return self.native_weights(inputs=inputs)


MINIMAX_H3 = NativeModel(
    compiled_by_default=True,  # SwiGLU and its norms: Diffusers' ops, fused by the compiler
    # the refined prompt: the same at every step of a request (and across requests with its prompt)
    conditioning_sites=(r"token_refiner",),
    projection_cache_unpaid=(
        "its AdaLN tables change with every step's timestep and the refined prompt is a tiny share of a step: "
        "on an H200 its lookups cost more than its hits save, see docs/PERFORMANCE.md"
    ),
    blocks={
        "token_refiner.refiner_blocks": NativeMiniMaxH3TokenRefinerBlock,
        "transformer_blocks": NativeMiniMaxH3TransformerBlock,
    },
    parallel=ParallelPlan(
        name="MiniMax-H3",
        attention_heads="num_attention_heads",
        # Diffusers' _cp_plan splits the same tensors: the packed sequence at the first block, the RoPE
        # tables (made for it whole) and the output norm's timestep rows, the two heads gathered; ours names
        # the stream. Each block takes its share of the per-row AdaLN indices itself.
        sequence=SequencePlan(
            submodule_inputs={
                "transformer_blocks.0": {"hidden_states": Split("packed", 1)},
                "norm_out": {"timestep_indices": Split("packed", 0, positions=True)},
            },
            submodule_outputs={
                "rope": {0: Split("packed", 0, positions=True), 1: Split("packed", 0, positions=True)}
            },
            output=("proj_out", Split("packed", 1)),
            gathers={"audio_proj_out": Split("packed", 1)},
        ),
        batched_inputs=(),  # it returns video and audio: no cfg layout (refused, with the reason)
        output_like=lambda module, arguments: None,
        tokens_over_tp=False,
    ),
    falls_back_on=(
        "custom attention processors, an attention mask, Diffusers attention backends set on a processor (or "
        "process-wide, where no provider of ours runs the same kernel), DoRA adapters, hooks on a submodule, "
        "active dropout in training mode, gradients flowing through a block and a user's torch.compile of the "
        "blocks run Diffusers' forward of the block (counted in the report, except under torch.compile; an "
        "error under tensor or sequence parallelism)"
    ),
)
