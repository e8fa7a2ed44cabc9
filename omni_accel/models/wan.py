"""Native Wan 2.1 / 2.2 blocks (T2V, I2V with image K/V, TI2V's per-token timesteps, VACE's control
blocks): Diffusers' WanTransformer3DModel (and WanVACETransformer3DModel) keeps its patch embedding,
condition embedder, RoPE and output layers; its blocks run the math below over packed projections
(self-attention Q/K/V, cross-attention K/V of the text), with attention through our providers.

Only what is Wan's own lives here: the block math (Diffusers' float32 norms and gates, RMSNorm across all
heads, the I2V image branch), the table of packed projections and what makes a call fall back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, WanTransformerBlock
from diffusers.models.transformers.transformer_wan_vace import WanVACETransformerBlock

from ..layers import apply_rope, feed_forward, gated_residual, norm_modulate_gathered
from ..layers.attention import (
    AttentionSite,
    ModuleCall,
    attention,
    places_inputs,
    qkv_attention,
    through_module,
)
from ..layers.fp8 import Fp8Rows
from ..layers.norms import rms_norm_across_heads
from ..layers.projection import LinearWeights, apply_linear, apply_one, takes_fp8_rows
from ..parallel import Colwise, ParallelPlan, Rowwise, SequencePlan, Split
from ..parallel.cfg import Pairing, guided_per_step
from ..parallel.tensor import shard_of
from ..parallel.token_rows import Rows
from ..parallel.vae import SAME_SIZE_CONVS, Bands, SplitLayer, register_row_split, whole_attention
from .base import NativeBlock, NativeModel, processor_reason

_TEXT_TOKENS = 512  # Diffusers' WanAttnProcessor: the text context is the last 512 tokens (I2V: image first)

SELF = AttentionSite("wan.self", "self")
CROSS = AttentionSite("wan.cross", "cross", ring_merges=False)  # over the text every rank holds


@dataclass(frozen=True)
class BlockConstants:
    head_dim: int
    eps: float  # of the float32 LayerNorms
    qk_eps: float | None  # of the RMSNorms across all heads
    tp_group: Any = None  # the heads are split over this group: the QK norms reduce across it
    inner_dim: int = 0  # all heads' width (the QK norms' size)
    rows: Rows | None = None  # the video tokens this rank holds in its TP group (None: all)
    placed: bool = False  # q, k and v are written where the layout's exchange wants them (peer writes)
    # What runs the self- and the cross-attention's part of the math through attn1's and attn2's hooks (a
    # step cache's), or None (``NativeBlock.attention_module_call``)
    attn1: ModuleCall | None = None
    attn2: ModuleCall | None = None


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.unflatten(2, (-1, head_dim))


def _qk_norm(x: torch.Tensor, weight: torch.Tensor | None, c: BlockConstants) -> torch.Tensor:
    return rms_norm_across_heads(x, weight, c.qk_eps, c.tp_group, c.inner_dim)


def _rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Diffusers' Wan rotation: in the promoted dtype of ``x`` and the tables."""
    cos, sin = rope
    return apply_rope(x, cos, sin, torch.promote_types(x.dtype, cos.dtype))


def _modulations(table: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """shift, scale, gate (attention), then shift, scale, gate (MLP), in float32: ``[B, D]`` per sample
    (Wan 2.1, 2.2 A14B) or ``[B, S, D]`` per token (Wan 2.2 TI2V)."""
    if temb.ndim == 4:
        return tuple(m.squeeze(2) for m in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2))
    return tuple(m.squeeze(1) for m in (table + temb.float()).chunk(6, dim=1))


def _self_attention(
    h: torch.Tensor | Fp8Rows,
    gather: Rows | None,
    rope: tuple[torch.Tensor, torch.Tensor],
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor | None],
    c: BlockConstants,
) -> torch.Tensor:
    """attn1's forward: QKV, the QK norms across heads, RoPE, attention and the output projection."""
    q, k, v = apply_linear(h, w["qkv"], gather)
    # One fused pass with RoPE where the norm's row is whole here and the RoPE tables are float32 (the
    # fused math's dtype, as Diffusers' with them); tables a user cast (``pipe.to(torch.bfloat16)``) rotate
    # in their dtype, as in Diffusers.
    if c.tp_group is None and rope[0].dtype == torch.float32:
        qk_norms = [(norms["q"], norms["k"])]
        args = (c.head_dim, c.qk_eps, rope, SELF, True)
        out = qkv_attention([(q, k, v)], qk_norms, *args, placed=c.placed)
    else:
        q = _rope(_heads(_qk_norm(q, norms["q"], c), c.head_dim), rope)
        k = _rope(_heads(_qk_norm(k, norms["k"], c), c.head_dim), rope)
        out = attention(q, k, _heads(v, c.head_dim), SELF, split=True)
    return apply_one(out.flatten(2, 3).type_as(q), w["out"], c.rows)


def _cross_attention(
    h: torch.Tensor,
    context: torch.Tensor,
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor | None],
    c: BlockConstants,
) -> torch.Tensor:
    """attn2's forward: the queries of ``h`` over the text (for I2V also over the image tokens before it,
    the two outputs summed), the output projection."""
    q = _heads(_qk_norm(apply_one(h, w["q2"], c.rows), norms["q2"], c), c.head_dim)
    image = None
    if "added_kv" in w:
        image, context = context[:, : context.shape[1] - _TEXT_TOKENS], context[:, -_TEXT_TOKENS:]
    k, v = apply_linear(context, w["kv2"])
    k = _heads(_qk_norm(k, norms["k2"], c), c.head_dim)
    out = attention(q, k, _heads(v, c.head_dim), CROSS).flatten(2, 3).type_as(q)
    if image is not None:
        k_img, v_img = apply_linear(image, w["added_kv"])
        k_img = _heads(_qk_norm(k_img, norms["added_k"], c), c.head_dim)
        out = out + attention(q, k_img, _heads(v_img, c.head_dim), CROSS).flatten(2, 3).type_as(q)
    return apply_one(out, w["out2"], c.rows)


def wan_block(
    x: torch.Tensor,
    context: torch.Tensor,
    temb: torch.Tensor,
    table: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor | None],
    c: BlockConstants,
) -> torch.Tensor:
    """Diffusers' WanTransformerBlock.forward over packed projections, its float32 norm-modulate and gated
    residual steps fused (the modulation is float32, so the fused ops compute in float32, as Diffusers)."""
    shift, scale, gate, c_shift, c_scale, c_gate = _modulations(table, temb)

    # Self-attention.
    h, gather = norm_modulate_gathered(x, shift, scale, c.eps, c.rows, takes_fp8_rows(w["qkv"]))
    x = gated_residual(
        x, gate, through_module(c.attn1, lambda: _self_attention(h, gather, rope, w, norms, c))
    )

    # Cross-attention over the text (and, for I2V, the image tokens before it). Under sequence parallelism
    # each rank's queries attend to the whole text, which every rank holds: no layout, no communication.
    h = x if norms["cross_norm"] is None else _affine_norm(x, norms, c.eps)
    x = x + through_module(c.attn2, lambda: _cross_attention(h, context, w, norms, c))

    # Feed-forward.
    h, gather = norm_modulate_gathered(x, c_shift, c_scale, c.eps, c.rows, takes_fp8_rows(w["up"]))
    ff = feed_forward(h, w["up"], w["down"], rows=c.rows, gathered=gather is None)
    return gated_residual(x, c_gate, ff)


def wan_vace_block(
    control: torch.Tensor,
    context: torch.Tensor,
    temb: torch.Tensor,
    table: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor | None],
    c: BlockConstants,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Diffusers' WanVACETransformerBlock.forward after its input projection: the control stream through
    the same block math, and the hint it gives the main block of its layer."""
    control = wan_block(control, context, temb, table, rope, w, norms, c)
    return (apply_one(control, w["proj_out"]) if "proj_out" in w else None), control


def _affine_norm(x: torch.Tensor, norms: dict[str, torch.Tensor | None], eps: float) -> torch.Tensor:
    """Diffusers' FP32LayerNorm with weights (``cross_attn_norm=True``)."""
    weight, bias = norms["cross_norm"], norms["cross_norm_bias"]
    return F.layer_norm(
        x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps
    ).type_as(x)


def _attention_reason(module: Any) -> str | None:
    return processor_reason(module.attn1, WanAttnProcessor, "attn1") or processor_reason(
        module.attn2, WanAttnProcessor, "attn2"
    )


class _WanNative(NativeBlock):
    """Self-attention with RoPE, cross-attention over the text (and image), MLP; AdaLN from the timestep."""

    tanh_gelus = ("ffn.net.0",)

    packed = {
        "qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        "kv2": ("attn2.to_k", "attn2.to_v"),
    }
    attention_modules = ("attn1", "attn2")
    linears = {
        "out": "attn1.to_out.0",
        "q2": "attn2.to_q",
        "out2": "attn2.to_out.0",
        "up": "ffn.net.0.proj",
        "down": "ffn.net.2",
    }

    tp_plan = {
        **dict.fromkeys(
            ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q", "attn2.to_k", "attn2.to_v"), Colwise()
        ),
        **dict.fromkeys(("attn2.add_k_proj", "attn2.add_v_proj"), Colwise(optional=True)),  # I2V
        "attn1.to_out.0": Rowwise(),
        "attn2.to_out.0": Rowwise(),
        "ffn.net.0.proj": Colwise(),
        "ffn.net.2": Rowwise(),
    }
    sites = (SELF, CROSS)

    def unsupported_reason(self) -> str | None:
        return _attention_reason(self)

    def head_dim(self) -> int:
        return self.attn1.inner_dim // self.attn1.heads

    def packed_projections(self) -> dict[str, tuple[str, ...]]:
        if self.attn2.add_k_proj is None:
            return dict(self.packed)
        return {**self.packed, "added_kv": ("attn2.add_k_proj", "attn2.add_v_proj")}  # I2V

    @torch.compiler.disable
    def _prepare(self, inputs: tuple):
        """Everything host-side (weights, constants), or None when this call runs Diffusers' forward. Never
        traced (``run_as_diffusers``)."""
        weights = self.native_weights(inputs=inputs)
        if weights is None:
            return None
        attn1, attn2 = self.attn1, self.attn2
        cross_norm = self.norm2 if isinstance(self.norm2, torch.nn.LayerNorm) else None
        norms = {
            "q": _local(attn1.norm_q, attn1.to_q),
            "k": _local(attn1.norm_k, attn1.to_k),
            "q2": _local(attn2.norm_q, attn2.to_q),
            "k2": _local(attn2.norm_k, attn2.to_k),
            "added_k": _local(attn2.norm_added_k, attn2.add_k_proj) if attn2.add_k_proj is not None else None,
            "cross_norm": None if cross_norm is None else cross_norm.weight,
            "cross_norm_bias": None if cross_norm is None else cross_norm.bias,
        }
        runtime = self.omni_runtime
        eps = self.norm1.eps
        shard = shard_of(attn1.to_q)
        constants = BlockConstants(
            attn1.inner_dim // attn1.heads,
            eps,
            attn1.norm_q.eps,
            None if shard is None else shard.group,
            attn1.inner_dim,
            runtime.rows("video"),
            shard is None and places_inputs(),  # eagerly: it may map the peer buffers
            self.attention_module_call("attn1"),
            self.attention_module_call("attn2"),
        )
        return weights, norms, constants


class NativeWanTransformerBlock(_WanNative, WanTransformerBlock):
    math = staticmethod(wan_block)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        inputs = (hidden_states, encoder_hidden_states, temb, rotary_emb)

        def run(math, prepared):
            table = self.scale_shift_table
            return math(hidden_states, encoder_hidden_states, temb, table, rotary_emb, *prepared)

        return self.native_call(
            functools.partial(super().forward, *inputs), lambda: self._prepare(inputs), run
        )


class NativeWanVACETransformerBlock(_WanNative, WanVACETransformerBlock):
    """VACE's control block: the Wan block on the control stream, with the first block's input projection
    and every block's output projection (the hint added to the main block of its layer)."""

    math = staticmethod(wan_vace_block)

    def linear_projections(self) -> dict[str, str]:
        present = {name: name for name in ("proj_in", "proj_out") if getattr(self, name) is not None}
        return {**self.linears, **present}

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        control_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        inputs = (hidden_states, encoder_hidden_states, control_hidden_states, temb, rotary_emb)

        def run(math, prepared):
            weights, norms, constants = prepared
            control = control_hidden_states
            if "proj_in" in weights:  # the first control block joins the video tokens, outside the math
                # that every control block shares (compiled: one graph for all of them)
                control = apply_one(control, weights["proj_in"]) + hidden_states
            table = self.scale_shift_table
            return math(control, encoder_hidden_states, temb, table, rotary_emb, weights, norms, constants)

        return self.native_call(
            functools.partial(super().forward, *inputs), lambda: self._prepare(inputs), run
        )


def _local(norm: torch.nn.Module, linear: torch.nn.Module) -> torch.Tensor | None:
    """The norm's weight for the heads this rank holds (all of them without tensor parallelism)."""
    shard = shard_of(linear)
    weight = norm.weight
    return weight if shard is None or weight is None else shard.take(weight, 0)


def _output_like(transformer: Any, arguments: dict[str, Any]) -> torch.Tensor:
    hidden = arguments["hidden_states"]
    channels = transformer.config.out_channels or transformer.config.in_channels
    return hidden.new_empty(hidden.shape[0], channels, *hidden.shape[2:])


def cfg_pairs(arguments: dict[str, Any]) -> Pairing:
    """The Wan pipelines call the transformer twice per step (cond, then uncond) while guidance is on, which
    they ask at every step (a callback may turn it off midway)."""
    return arguments.get("guidance_scale", 5.0) > 1.0 and guided_per_step(arguments["self"])


_BATCHED = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image")
_FALLS_BACK_ON = (
    "custom attention processors, Diffusers attention backends set on a processor (or process-wide, where "
    "no provider of ours runs the same kernel), "
    "fuse_qkv_projections(), DoRA adapters, hooks on a submodule, active dropout in training mode, gradients "
    "flowing through a block and a user's torch.compile of the blocks run Diffusers' forward of the block "
    "(counted in the report, except under torch.compile)"
)
_LIMITATIONS = (
    "exact projection cache: not used for Wan: its repeated projections (text K/V, timestep MLP) are ~0.1% of "
    "a 14B forward at 480p, and caching them measured no gain (docs/archive/performance-history.md)",
)


def _wan_model(name: str, blocks: dict, first_blocks: dict, batched: tuple[str, ...]) -> NativeModel:
    """Wan's native model: ``first_blocks`` are the submodules whose video-token inputs split first under
    sequence parallelism (path -> argument names)."""
    return NativeModel(
        blocks=blocks,
        parallel=ParallelPlan(
            name=name,
            attention_heads="num_attention_heads",
            # Diffusers' WanTransformer3DModel._cp_plan splits the RoPE tables and the first block's tokens
            # and gathers proj_out as this does, and Wan 2.2 TI2V's per-token timesteps before the condition
            # embedder where this splits its outputs (the same tokens). Ours is kept for what it lacks: the
            # VACE control blocks' inputs, and which stream each split belongs to (uneven splits need no
            # length exchange). Wan declares no _tp_plan.
            sequence=SequencePlan(
                # The video tokens are made inside the model: split the RoPE tables, the per-token timestep
                # embeddings (Wan 2.2 TI2V; per-sample ones stay whole) and the first blocks' tokens.
                submodule_outputs={
                    "rope": {0: Split("video", 1, positions=True), 1: Split("video", 1, positions=True)},
                    "condition_embedder": {0: Split("video", 1, ndim=3), 1: Split("video", 1, ndim=3)},
                },
                submodule_inputs={
                    path: {argument: Split("video", 1) for argument in arguments}
                    for path, arguments in first_blocks.items()
                },
                output=("proj_out", Split("video", 1)),
            ),
            batched_inputs=batched,
            output_like=_output_like,
        ),
        cfg_pairing=cfg_pairs,
        falls_back_on=_FALLS_BACK_ON,
        limitations=_LIMITATIONS,
        projection_cache=False,
    )


WAN = _wan_model("Wan", {"blocks": NativeWanTransformerBlock}, {"blocks.0": ("hidden_states",)}, _BATCHED)
# VACE: the control blocks run first, on the control tokens (padded to the video's length) and, in the
# first one, the video tokens; their hints are added to the main blocks of their layers, token by token.
WAN_VACE = _wan_model(
    "Wan VACE",
    {"blocks": NativeWanTransformerBlock, "vace_blocks": NativeWanVACETransformerBlock},
    {"vace_blocks.0": ("hidden_states", "control_hidden_states"), "blocks.0": ("hidden_states",)},
    (*_BATCHED, "control_hidden_states"),
)


# Wan's video VAE under a parallel layout (omni_accel.parallel.vae): it encodes and decodes frame chunk by
# frame chunk with cached frames, each chunk split by rows the same way, so each rank's cached frames are
# its band's. No reduction is split: only a convolution kernel's own order for a smaller input can differ
# (bitwise in the tiny gloo tests).


def _causal_conv_reason(conv: torch.nn.Conv3d) -> str | None:
    kernel, (pad_w, _, pad_h, _, _, _) = conv.kernel_size[1:], conv._padding
    spatial_stride = conv.stride[1:]  # a stride in time (the encoder's temporal downsampling) needs no rows
    if spatial_stride != (1, 1) or (kernel, (pad_h, pad_w)) not in SAME_SIZE_CONVS or conv.groups != 1:
        return f"a causal convolution the row split does not handle ({conv})"
    return None


def _is_downsampling(resample: torch.nn.Module) -> bool:
    return resample.mode.startswith("downsample")


def _resample_reason(resample: torch.nn.Module) -> str | None:
    """A WanResample the row split handles: any upsampling, or the downsampling's zero pad (one column
    right, one row below) and 3x3 stride-2 convolution."""
    if not _is_downsampling(resample):
        return None
    pad, conv = resample.resample
    if (pad.padding, conv.kernel_size, conv.stride, conv.padding) != ((0, 1, 0, 1), (3, 3), (2, 2), (0, 0)):
        return f"a downsampling WanResample the row split does not handle ({resample.resample})"
    return None


def _resample_in_bands(
    resample: torch.nn.Module, bands: Bands, x: torch.Tensor, *args, **kwargs
) -> torch.Tensor:
    """Diffusers' WanResample.forward; when it downsamples, the row under each frame's band is the next
    band's first (zeros under the image), in place of the zero row its pad adds."""
    if not _is_downsampling(resample):
        return type(resample).forward(resample, x, *args, **kwargs)
    pad, conv = resample.resample

    def downsample(frames: torch.Tensor) -> torch.Tensor:
        below = F.pad(bands.with_row_below(frames), (pad.padding[0], pad.padding[1], 0, 0))
        return F.conv2d(below, conv.weight, conv.bias, conv.stride)

    resample.resample.forward = downsample
    try:
        return type(resample).forward(resample, x, *args, **kwargs)
    finally:
        del resample.resample.forward


def _causal_conv_in_bands(conv: torch.nn.Conv3d, bands: Bands, x: torch.Tensor, cache_x=None) -> torch.Tensor:
    """WanCausalConv3d (cached frames before, zero padding around) with the band's halo rows in place of the
    zero rows, after the cached frames are joined (so the halo carries them too)."""
    padding = list(conv._padding)  # (w, w, h, h, t before, t after)
    if cache_x is not None and padding[4] > 0:
        x = torch.cat([cache_x.to(x.device), x], dim=2)
        padding[4] -= cache_x.shape[2]
    if padding[2]:
        x = bands.with_halo(x)
        padding[2] = padding[3] = 0
    return torch.nn.Conv3d.forward(conv, F.pad(x, padding))


def _continues(args: tuple, kwargs: dict) -> bool:
    """A frame chunk after the first: its cache (``feat_cache``) holds the frames the chunks before it left."""
    cache = kwargs.get("feat_cache", args[0] if args else None)
    return cache is not None and any(frames is not None for frames in cache)


register_row_split(
    ("WanDecoder3d", "WanEncoder3d"),
    {
        "WanCausalConv3d": SplitLayer(_causal_conv_reason, _causal_conv_in_bands),
        "WanAttentionBlock": SplitLayer(forward=whole_attention),  # per-frame attention: the whole frame
        "WanResample": SplitLayer(
            _resample_reason, _resample_in_bands, lambda resample: 2 if _is_downsampling(resample) else 1
        ),
    },
    continues=_continues,
)
