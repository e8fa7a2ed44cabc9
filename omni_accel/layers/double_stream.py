"""The double-stream (MMDiT) block shared by the models whose blocks compute it (FLUX.1's and FLUX.2's
double blocks, Qwen-Image's): two token streams, text and image, each with its own projections and
modulation, joined only in attention. A model file supplies the weights' table, the modulation and what
makes a call fall back to Diffusers' forward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..parallel.token_rows import Rows
from .attention import AttentionSite, ModuleCall, qkv_attention, through_module
from .feed_forward import feed_forwards_together
from .fp8 import quantize_rows, split_rows
from .fused import gated_residual, gelu_tanh, norm_modulate_gathered_together
from .projection import LinearWeights, apply_linear, apply_together, takes_fp8_rows

Rope = tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class BlockConstants:
    """The numbers a block's math needs besides tensors (the same for every block of a class)."""

    head_dim: int
    eps: float  # of the LayerNorms before modulation
    qk_eps: float | None  # of the per-head QK RMSNorms
    site: AttentionSite
    split: bool  # attention is over the sequence the forward's layout splits (False: what this rank holds)
    image_rows: Rows | None  # the image and text tokens this rank holds in its TP group (None: all)
    text_rows: Rows | None
    placed: bool  # q, k and v are written where the layout's exchange wants them (peer writes)
    overlaps_work: bool  # attention hides work beside it behind its exchanges (eager blocks, placed)
    # Runs the part of the math that is the block's attention module through that module's hooks (a step
    # cache's: it computes the part or predicts its outputs); None: the math calls the part itself.
    attention_module: ModuleCall | None = None


def double_block(
    img: torch.Tensor,
    txt: torch.Tensor,
    img_mod: torch.Tensor,
    txt_mod: torch.Tensor,
    rope: Rope,
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor | None],
    c: BlockConstants,
    attn_mask: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A double-stream (MMDiT) block over packed projections, its elementwise steps fused: each stream
    LayerNormed and modulated, its own QKV, one joint attention over ``[text, image]`` (``attn_mask``: the
    keys it may see, ``[B, 1, 1, S]`` bool, or None), each stream's output projection and gated residual,
    then each stream's modulated MLP (``activation``: tanh-GELU, or SwiGLU as FLUX.2's) and gated
    residual. FLUX.1's, FLUX.2's and Qwen-Image's blocks compute this; ``*_mod`` hold the six AdaLN chunks
    (shift, scale, gate; then for the MLP) of each stream, per sample ``[B, 6 * D]`` or per token
    ``[B, S, 6 * D]``.
    Returns ``(txt, img)`` as their Diffusers blocks do."""
    i_shift, i_scale, i_gate, i_shift2, i_scale2, i_gate2 = img_mod.chunk(6, dim=-1)
    t_shift, t_scale, t_gate, t_shift2, t_scale2, t_gate2 = txt_mod.chunk(6, dim=-1)
    eps, head_dim, i_rows, t_rows = c.eps, c.head_dim, c.image_rows, c.text_rows
    # The two streams in step: under tensor parallelism each pair of exchanges ends behind one barrier.
    (hi, i_gather), (ht, t_gather) = norm_modulate_gathered_together(
        [(img, i_shift, i_scale, i_rows), (txt, t_shift, t_scale, t_rows)],
        eps,
        [takes_fp8_rows(w["img_qkv"]), takes_fp8_rows(w["txt_qkv"])],
    )

    def attend() -> tuple[torch.Tensor, torch.Tensor]:  # the attention module's forward: (image, text) out
        iq, ik, iv = apply_linear(hi, w["img_qkv"], i_gather)
        tq, tk, tv = apply_linear(ht, w["txt_qkv"], t_gather)
        out = qkv_attention(
            [(tq, tk, tv), (iq, ik, iv)],
            [(norms["added_q"], norms["added_k"]), (norms["q"], norms["k"])],
            head_dim,
            c.qk_eps,
            rope,
            c.site,
            placed=c.placed,
            attn_mask=attn_mask,
        )
        lengths = [tq.shape[1], iq.shape[1]]
        if (
            takes_fp8_rows(w["img_out"])
            and takes_fp8_rows(w["txt_out"])
            and i_rows is None
            and t_rows is None
        ):
            txt_attn, img_attn = split_rows(quantize_rows(out.flatten(2, 3).to(iq.dtype)), lengths)
        else:
            txt_attn, img_attn = (
                t.contiguous() for t in out.flatten(2, 3).to(iq.dtype).split(lengths, dim=1)
            )
        img_out, txt_out = apply_together(
            [(img_attn, w["img_out"], i_rows), (txt_attn, w["txt_out"], t_rows)]
        )
        return img_out, txt_out

    img_out, txt_out = through_module(c.attention_module, attend)
    img, txt = gated_residual(img, i_gate, img_out), gated_residual(txt, t_gate, txt_out)
    (mi, mi_gather), (mt, mt_gather) = norm_modulate_gathered_together(  # the MLPs' inputs
        [(img, i_shift2, i_scale2, i_rows), (txt, t_shift2, t_scale2, t_rows)],
        eps,
        [takes_fp8_rows(w["img_up"]), takes_fp8_rows(w["txt_up"])],
    )
    img_ff, txt_ff = feed_forwards_together(
        [
            (mi, w["img_up"], w["img_down"], i_rows, mi_gather is None),
            (mt, w["txt_up"], w["txt_down"], t_rows, mt_gather is None),
        ],
        activation,
    )
    img, txt = gated_residual(img, i_gate2, img_ff), gated_residual(txt, t_gate2, txt_ff)
    return txt, img
