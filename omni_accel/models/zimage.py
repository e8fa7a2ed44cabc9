"""Native Z-Image blocks: Diffusers' ZImageTransformer2DModel keeps its patchify, embedders, RoPE tables,
the unified sequence it builds and its final layer; every ZImageTransformerBlock (the noise and context
refiners and the main layers) runs the math below over packed QKV and SwiGLU-input GEMMs, with the
padding of shorter samples as a key mask through our attention.

Only what is Z-Image's own lives here: its sandwich-normed block (RMSNorm before and after attention and
MLP, scale-only modulation, tanh gates), the complex RoPE tables as the cos/sin pairs our q/k kernel takes,
and what makes a call fall back to Diffusers' forward (Z-Image Omni's per-token modulation).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_z_image import (
    ZImageTransformerBlock,
    ZSingleStreamAttnProcessor,
)

from ..layers import gated_residual
from ..layers.attention import AttentionSite, qkv_attention, through_module
from ..layers.double_stream import BlockConstants
from ..layers.projection import LinearWeights, apply_linear, apply_one
from ..parallel import Colwise, ParallelPlan, Rowwise, SequencePlan, Split
from .base import NativeBlock, NativeModel, processor_reason
from .forward_memo import ForwardMemo
from .generic import LearnedOutputs

_NORMS = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")

Rope = tuple[torch.Tensor, torch.Tensor] | None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Diffusers' RMSNorm with a weight (in float32, the result in the weight's dtype when half)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(weight.dtype) * weight


def zimage_block(
    x: torch.Tensor,
    mod: torch.Tensor | None,
    rope: Rope,
    mask: torch.Tensor | None,
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor],
    c: BlockConstants,
) -> torch.Tensor:
    """Diffusers' ZImageTransformerBlock.forward: attention and a SwiGLU MLP, each RMSNormed before and
    after, with (``mod`` ``[B, 4 D]``: scale and tanh gate of each, per sample) or without modulation
    (the context refiner). ``mask``: the keys each sample may see, ``[B, 1, 1, S]`` bool, or None."""
    if mod is not None:
        scale_msa, gate_msa, scale_mlp, gate_mlp = mod.chunk(4, dim=-1)
        gate_msa, gate_mlp = gate_msa.tanh(), gate_mlp.tanh()
        scale_msa, scale_mlp = (1.0 + scale_msa).unsqueeze(1), (1.0 + scale_mlp).unsqueeze(1)
    h = _rms(x, norms["attention_norm1"], c.eps)

    def attend() -> torch.Tensor:  # the attention module's forward: QKV, attention, output projection
        q, k, v = apply_linear(h if mod is None else h * scale_msa, w["qkv"])
        args = (c.head_dim, c.qk_eps, rope, c.site)
        out = qkv_attention([(q, k, v)], [(norms["q"], norms["k"])], *args, attn_mask=mask)
        return apply_one(out.flatten(2, 3).to(q.dtype), w["out"])

    attended = _rms(through_module(c.attention_module, attend), norms["attention_norm2"], c.eps)
    x = x + attended if mod is None else gated_residual(x, gate_msa, attended)
    h = _rms(x, norms["ffn_norm1"], c.eps)
    gate, linear = apply_linear(h if mod is None else h * scale_mlp, w["ff_up"])
    ff = _rms(apply_one(F.silu(gate) * linear, w["ff_down"]), norms["ffn_norm2"], c.eps)
    return x + ff if mod is None else gated_residual(x, gate_mlp, ff)


def _rope(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Z-Image's complex tables ``[B, S, D/2]`` (one per sample: their positions depend on each sample's
    caption length) as ``(cos, sin)``: ``[S, D]`` when one sample, else ``[B, S, 1, D]``. Diffusers
    multiplies each pair ``(x[2i], x[2i+1])`` as a complex number by the table's entry, this rotation."""
    cos = freqs.real.float().repeat_interleave(2, dim=-1)
    sin = freqs.imag.float().repeat_interleave(2, dim=-1)
    if freqs.shape[0] == 1:
        return cos[0].contiguous(), sin[0].contiguous()
    return cos.unsqueeze(2).contiguous(), sin.unsqueeze(2).contiguous()


class NativeZImageTransformerBlock(NativeBlock, ZImageTransformerBlock):
    """Z-Image's single-stream block; a refiner's or a main layer's, with its AdaLN modulation (the
    context refiner's blocks have none, ``linear_projections``)."""

    packed = {
        "qkv": ("attention.to_q", "attention.to_k", "attention.to_v"),
        "ff_up": ("feed_forward.w1", "feed_forward.w3"),  # SwiGLU's gate, then its linear half
    }
    linears = {"out": "attention.to_out.0", "ff_down": "feed_forward.w2", "mod": "adaLN_modulation.0"}
    tp_plan = {
        **dict.fromkeys(packed["qkv"] + packed["ff_up"], Colwise()),
        "attention.to_out.0": Rowwise(),
        "feed_forward.w2": Rowwise(),
        "adaLN_modulation.0": Colwise(optional=True),  # the modulation: gathered whole
    }
    modulations = ("mod",)
    attention_modules = ("attention",)
    site = AttentionSite("zimage.self", "self")
    sites = (site,)
    math = staticmethod(zimage_block)
    _ropes, _masks = ForwardMemo(), ForwardMemo()  # per thread, the last forward's
    memos = (_ropes, _masks)

    @staticmethod
    def modulation_input(conditioning: torch.Tensor) -> torch.Tensor:
        return conditioning  # Z-Image's AdaLN is a linear of the timestep embedding, without a SiLU

    def head_dim(self) -> int:
        return self.head_dim

    def linear_projections(self) -> dict[str, str]:
        return self.linears if self.modulation else {k: v for k, v in self.linears.items() if k != "mod"}

    def unsupported_reason(self, noise_mask: Any, freqs_cis: Any) -> str | None:
        reason = processor_reason(self.attention, ZSingleStreamAttnProcessor)
        if reason is not None:
            return reason
        if noise_mask is not None:
            return "Z-Image Omni's per-token modulation (noisy and clean tokens)"
        if not (isinstance(freqs_cis, torch.Tensor) and freqs_cis.is_complex() and freqs_cis.ndim == 3):
            return "RoPE tables other than Z-Image's complex [batch, tokens, head_dim / 2] ones"
        return None

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor,
        freqs_cis: torch.Tensor,
        adaln_input: torch.Tensor | None = None,
        noise_mask: torch.Tensor | None = None,
        adaln_noisy: torch.Tensor | None = None,
        adaln_clean: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = (x, attn_mask, freqs_cis, adaln_input, noise_mask, adaln_noisy, adaln_clean)
        return self.native_call(
            functools.partial(super().forward, *inputs),
            lambda: self._prepare(x, attn_mask, freqs_cis, adaln_input, noise_mask, inputs),
            lambda math, prepared: math(x, *prepared),
        )

    @torch.compiler.disable
    def _prepare(self, x, attn_mask, freqs_cis, adaln_input, noise_mask, inputs):
        """Everything host-side (weights, the projection cache, the RoPE pairs and the key mask, constants),
        or None when this call runs Diffusers' forward."""
        weights = self.native_weights(noise_mask, freqs_cis, inputs=inputs)
        if weights is None:
            return None
        mod = self.modulate("mod", adaln_input, weights) if self.modulation else None
        freqs_cis = self.own_share(freqs_cis, "unified", 1, x.shape[1])
        rope = self._ropes.get((freqs_cis,), None, lambda: _rope(freqs_cis))
        mask = None
        if attn_mask is not None:
            attn_mask = self.own_share(attn_mask, "unified", 1, x.shape[1])
            mask = self._masks.get((attn_mask,), None, lambda: attn_mask.bool()[:, None, None, :])
        constants = BlockConstants(
            self.head_dim,
            self.attention_norm1.eps,
            self.attention.norm_q.eps,
            type(self).site,
            True,
            None,
            None,
            False,
            False,
            self.attention_module_call("attention"),
        )
        norms = {name: getattr(self, name).weight for name in _NORMS}
        norms.update(q=self.attention.norm_q.weight, k=self.attention.norm_k.weight)
        return mod, rope, mask, weights, norms, constants


_BATCHED = ("x", "t", "cap_feats", "siglip_feats", "image_noise_mask")


def _batched_inputs(arguments: dict[str, Any]) -> tuple[str, ...] | None:
    """The arguments that carry ZImagePipeline's stacked batch; None (the call runs whole on both cfg ranks)
    where ControlNet residuals come with it: the ControlNet padded them to the longest sample of the whole
    batch, and half of it holds a shorter unified sequence, which the transformer adds them to as they are."""
    return None if arguments.get("controlnet_block_samples") is not None else _BATCHED


ZIMAGE = NativeModel(
    compiled_by_default=True,  # SwiGLU and its norms: Diffusers' ops, fused by the compiler
    blocks={
        "noise_refiner": NativeZImageTransformerBlock,
        "context_refiner": NativeZImageTransformerBlock,
        "layers": NativeZImageTransformerBlock,
    },
    parallel=ParallelPlan(
        name="Z-Image",
        attention_heads="n_heads",
        # Diffusers declares no _cp_plan. The model builds its unified sequence from per-sample lists in
        # its forward: split where the main layers take it (the refiners before run whole on every rank),
        # with the ControlNet residuals added after them, and gathered after the final layer. Each main
        # layer takes its share of the RoPE tables and the key mask itself (the model passes them whole).
        sequence=SequencePlan(
            inputs={"controlnet_block_samples": Split("unified", 1)},
            submodule_inputs={"layers.0": {"x": Split("unified", 1)}},
            output=("all_final_layer.2-1", Split("unified", 1)),
        ),
        # ZImagePipeline stacks cond and uncond in one call, each a list of per-sample entries.
        batched_inputs=_batched_inputs,
        per_sample_inputs=("x", "cap_feats", "siglip_feats", "image_noise_mask"),
        output_like=LearnedOutputs(),
        tokens_over_tp=False,
    ),
    falls_back_on=(
        "custom attention processors, Z-Image Omni's per-token modulation, Diffusers attention backends set "
        "on a processor (or process-wide, where no provider of ours runs the same kernel), DoRA adapters, "
        "hooks on a submodule, active dropout in training mode, gradients flowing through a block and a "
        "user's torch.compile of the blocks run Diffusers' forward of the block (counted in the report, "
        "except under torch.compile; an error under tensor or sequence parallelism)"
    ),
)
