"""Native FLUX.1 transformer (dev and schnell): the same math as Diffusers' FluxTransformer2DModel, with
packed QKV(+MLP) GEMMs, tensor-parallel layers and provider-routed attention.

Only what is FLUX's own lives here: the block layout, the checkpoint name map and its parallel plan.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..cache.projection import ExactProjectionCache
from ..layers import (
    Attention,
    ColumnParallelLinear,
    MLPEmbedder,
    Modulation,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    apply_rope,
    layer_norm,
    modulate,
    rope_cos_sin,
    timestep_sinusoid,
)
from ..parallel.mesh import ParallelState
from ..parallel.sequence import SequenceParallel
from ..weights import WeightMap

_FP16_MAX = 65504.0


def _clip_fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clip(-_FP16_MAX, _FP16_MAX) if x.dtype == torch.float16 else x


class FeedForward(nn.Module):
    """GELU(tanh) MLP: column-parallel up projection, row-parallel down projection."""

    def __init__(self, dim: int, hidden: int, tp_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(dim, hidden, tp_group=tp_group)
        self.down = RowParallelLinear(hidden, dim, tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class FluxDoubleBlock(nn.Module):
    """Two streams (image, text) with their own weights, joined only inside attention."""

    def __init__(self, dim: int, head_dim: int, tp_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        qkv = {"q": dim, "k": dim, "v": dim}
        self.img_mod = Modulation(dim, 6)
        self.txt_mod = Modulation(dim, 6)
        self.img_qkv = ColumnParallelLinear(dim, qkv, tp_group=tp_group, align=head_dim)
        self.txt_qkv = ColumnParallelLinear(dim, qkv, tp_group=tp_group, align=head_dim)
        self.img_q_norm, self.img_k_norm = RMSNorm(head_dim), RMSNorm(head_dim)
        self.txt_q_norm, self.txt_k_norm = RMSNorm(head_dim), RMSNorm(head_dim)
        self.attn = Attention(head_dim, role="flux.joint", role_category="self")
        self.img_out = RowParallelLinear(dim, dim, tp_group=tp_group)
        self.txt_out = RowParallelLinear(dim, dim, tp_group=tp_group)
        self.img_mlp = FeedForward(dim, 4 * dim, tp_group)
        self.txt_mlp = FeedForward(dim, 4 * dim, tp_group)

    def _qkv(self, proj: ColumnParallelLinear, q_norm: RMSNorm, k_norm: RMSNorm, x: torch.Tensor):
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in proj.split(proj(x)))
        return q_norm(q), k_norm(k), v

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        temb: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        sp: SequenceParallel | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        i_shift, i_scale, i_gate, i_shift2, i_scale2, i_gate2 = self.img_mod(temb)
        t_shift, t_scale, t_gate, t_shift2, t_scale2, t_gate2 = self.txt_mod(temb)

        iq, ik, iv = self._qkv(
            self.img_qkv, self.img_q_norm, self.img_k_norm, modulate(layer_norm(img), i_shift, i_scale)
        )
        tq, tk, tv = self._qkv(
            self.txt_qkv, self.txt_q_norm, self.txt_k_norm, modulate(layer_norm(txt), t_shift, t_scale)
        )
        q = apply_rope(torch.cat([tq, iq], dim=1), *rope)
        k = apply_rope(torch.cat([tk, ik], dim=1), *rope)
        v = torch.cat([tv, iv], dim=1)
        txt_attn, img_attn = self.attn(q, k, v, sp=sp).flatten(2).split([txt.shape[1], img.shape[1]], dim=1)

        img = img + i_gate[:, None] * self.img_out(img_attn)
        img = img + i_gate2[:, None] * self.img_mlp(modulate(layer_norm(img), i_shift2, i_scale2))
        txt = txt + t_gate[:, None] * self.txt_out(txt_attn)
        txt = txt + t_gate2[:, None] * self.txt_mlp(modulate(layer_norm(txt), t_shift2, t_scale2))
        return _clip_fp16(img), _clip_fp16(txt)


class FluxSingleBlock(nn.Module):
    """One stream over [text, image]; attention QKV and the MLP up projection share one packed GEMM."""

    def __init__(
        self, dim: int, head_dim: int, tp_group: dist.ProcessGroup | None, mlp_ratio: float = 4.0
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        mlp_dim = int(dim * mlp_ratio)
        self.mod = Modulation(dim, 3)
        self.qkv_mlp = ColumnParallelLinear(
            dim, {"q": dim, "k": dim, "v": dim, "mlp": mlp_dim}, tp_group=tp_group, align=head_dim
        )
        self.q_norm, self.k_norm = RMSNorm(head_dim), RMSNorm(head_dim)
        self.attn = Attention(head_dim, role="flux.single", role_category="self")
        self.out = RowParallelLinear(dim + mlp_dim, dim, tp_group=tp_group, input_blocks=(dim, mlp_dim))

    def forward(
        self,
        x: torch.Tensor,
        temb: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        sp: SequenceParallel | None = None,
    ) -> torch.Tensor:
        shift, scale, gate = self.mod(temb)
        q, k, v, mlp = self.qkv_mlp.split(self.qkv_mlp(modulate(layer_norm(x), shift, scale)))
        q = apply_rope(self.q_norm(q.unflatten(-1, (-1, self.head_dim))), *rope)
        k = apply_rope(self.k_norm(k.unflatten(-1, (-1, self.head_dim))), *rope)
        attn = self.attn(q, k, v.unflatten(-1, (-1, self.head_dim)), sp=sp).flatten(2)
        out = self.out(torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=-1))
        return _clip_fp16(x + gate[:, None] * out)


class FluxTransformer(nn.Module):
    """Takes and returns exactly what Diffusers' FluxTransformer2DModel.forward does."""

    projection_cache: ExactProjectionCache | None = None
    projection_name: str = ""
    # What the native model does not do, for the report (each is refused with an error, not ignored).
    limitations = (
        "IP-adapter and LoRA scale via joint_attention_kwargs: refused with an error (fuse LoRA before accelerate)",
    )
    # Lists of identical blocks: compiled once per class with compile=True.
    repeated_blocks = ("double_blocks", "single_blocks")
    weight_map = WeightMap(
        [
            (r"transformer_blocks\.(\d+)\.norm1\.linear\.(\w+)", r"double_blocks.\1.img_mod.linear.\2", None),
            (
                r"transformer_blocks\.(\d+)\.norm1_context\.linear\.(\w+)",
                r"double_blocks.\1.txt_mod.linear.\2",
                None,
            ),
            (r"transformer_blocks\.(\d+)\.attn\.to_([qkv])\.(\w+)", r"double_blocks.\1.img_qkv.\3", "\\2"),
            (
                r"transformer_blocks\.(\d+)\.attn\.add_([qkv])_proj\.(\w+)",
                r"double_blocks.\1.txt_qkv.\3",
                "\\2",
            ),
            (
                r"transformer_blocks\.(\d+)\.attn\.norm_([qk])\.weight",
                r"double_blocks.\1.img_\2_norm.weight",
                None,
            ),
            (
                r"transformer_blocks\.(\d+)\.attn\.norm_added_([qk])\.weight",
                r"double_blocks.\1.txt_\2_norm.weight",
                None,
            ),
            (r"transformer_blocks\.(\d+)\.attn\.to_out\.0\.(\w+)", r"double_blocks.\1.img_out.\2", None),
            (r"transformer_blocks\.(\d+)\.attn\.to_add_out\.(\w+)", r"double_blocks.\1.txt_out.\2", None),
            (r"transformer_blocks\.(\d+)\.ff\.net\.0\.proj\.(\w+)", r"double_blocks.\1.img_mlp.up.\2", None),
            (r"transformer_blocks\.(\d+)\.ff\.net\.2\.(\w+)", r"double_blocks.\1.img_mlp.down.\2", None),
            (
                r"transformer_blocks\.(\d+)\.ff_context\.net\.0\.proj\.(\w+)",
                r"double_blocks.\1.txt_mlp.up.\2",
                None,
            ),
            (
                r"transformer_blocks\.(\d+)\.ff_context\.net\.2\.(\w+)",
                r"double_blocks.\1.txt_mlp.down.\2",
                None,
            ),
            (
                r"single_transformer_blocks\.(\d+)\.norm\.linear\.(\w+)",
                r"single_blocks.\1.mod.linear.\2",
                None,
            ),
            (
                r"single_transformer_blocks\.(\d+)\.attn\.to_([qkv])\.(\w+)",
                r"single_blocks.\1.qkv_mlp.\3",
                "\\2",
            ),
            (r"single_transformer_blocks\.(\d+)\.proj_mlp\.(\w+)", r"single_blocks.\1.qkv_mlp.\2", "mlp"),
            (
                r"single_transformer_blocks\.(\d+)\.attn\.norm_([qk])\.weight",
                r"single_blocks.\1.\2_norm.weight",
                None,
            ),
            (r"single_transformer_blocks\.(\d+)\.proj_out\.(\w+)", r"single_blocks.\1.out.\2", None),
        ]
    )

    def __init__(
        self,
        *,
        patch_size: int = 1,
        in_channels: int = 64,
        out_channels: int | None = None,
        num_layers: int = 19,
        num_single_layers: int = 38,
        attention_head_dim: int = 128,
        num_attention_heads: int = 24,
        joint_attention_dim: int = 4096,
        pooled_projection_dim: int = 768,
        guidance_embeds: bool = False,
        axes_dims_rope: tuple[int, ...] = (16, 56, 56),
        parallel: ParallelState | None = None,
    ) -> None:
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        self.parallel = parallel
        tp_group = parallel.group("tp") if parallel is not None else None
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        if num_attention_heads % tp_size:
            raise ValueError(
                f"tp={tp_size} does not divide FLUX's {num_attention_heads} attention heads; use a tp in "
                f"{[d for d in range(1, num_attention_heads + 1) if num_attention_heads % d == 0]}."
            )
        self.axes_dims_rope = tuple(axes_dims_rope)
        self.x_embedder = ReplicatedLinear(in_channels, dim)
        self.context_embedder = ReplicatedLinear(joint_attention_dim, dim)
        self.time_text_embed = nn.Module()
        self.time_text_embed.timestep_embedder = MLPEmbedder(256, dim)
        self.time_text_embed.text_embedder = MLPEmbedder(pooled_projection_dim, dim)
        if guidance_embeds:
            self.time_text_embed.guidance_embedder = MLPEmbedder(256, dim)
        self.double_blocks = nn.ModuleList(
            FluxDoubleBlock(dim, attention_head_dim, tp_group) for _ in range(num_layers)
        )
        self.single_blocks = nn.ModuleList(
            FluxSingleBlock(dim, attention_head_dim, tp_group) for _ in range(num_single_layers)
        )
        self.norm_out = Modulation(dim, 2)
        self.proj_out = ReplicatedLinear(dim, patch_size * patch_size * (out_channels or in_channels))

    @classmethod
    def from_diffusers_config(cls, config: dict[str, Any], **kwargs: Any) -> FluxTransformer:
        keys = [
            "patch_size",
            "in_channels",
            "out_channels",
            "num_layers",
            "num_single_layers",
            "attention_head_dim",
            "num_attention_heads",
            "joint_attention_dim",
            "pooled_projection_dim",
            "guidance_embeds",
            "axes_dims_rope",
        ]
        return cls(**{k: config[k] for k in keys if k in config}, **kwargs)

    def output_like(self, kwargs: dict[str, Any]) -> torch.Tensor:
        """An uninitialised tensor shaped like the output for these inputs."""
        hidden = kwargs["hidden_states"]
        return hidden.new_empty(*hidden.shape[:2], self.proj_out.out_features)

    def _conditioning(self, timestep, guidance, pooled, dtype) -> torch.Tensor:
        embed = self.time_text_embed
        temb = embed.timestep_embedder(timestep_sinusoid(timestep.to(dtype) * 1000, 256).to(pooled.dtype))
        if guidance is not None:
            if not hasattr(embed, "guidance_embedder"):
                raise ValueError(
                    "This FLUX transformer has no guidance embedding (schnell); do not pass guidance."
                )
            temb = temb + embed.guidance_embedder(
                timestep_sinusoid(guidance.to(dtype) * 1000, 256).to(pooled.dtype)
            )
        elif hasattr(embed, "guidance_embedder"):
            raise ValueError("This FLUX transformer embeds guidance (dev): pass `guidance`.")
        return temb + embed.text_embedder(pooled)

    def _split_sequence(self, txt, img, cos, sin):
        """This rank's share of the sequence: a slice of the text and a slice of the image tokens (and of
        their RoPE rows). Their concatenation is this rank's slice of the joint sequence; attention does not
        depend on the order of keys, so the joint sequence need not be contiguous across ranks. Returns the
        joint plan, the image plan (to gather the output), and the local tensors."""
        groups = dict(ulysses_group=self.parallel.group("ulysses"), ring_group=self.parallel.group("ring"))
        txt_sp = SequenceParallel.plan(txt.shape[1], **groups)
        img_sp = SequenceParallel.plan(img.shape[1], **groups)
        sp = SequenceParallel(tuple(map(sum, zip(txt_sp.sizes, img_sp.sizes, strict=True))), **groups)
        text = txt.shape[1]
        cos, sin = (
            torch.cat([txt_sp.shard(t[:text], dim=0), img_sp.shard(t[text:], dim=0)]) for t in (cos, sin)
        )
        return sp, img_sp, txt_sp.shard(txt), img_sp.shard(img), cos, sin

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        controlnet_block_samples: list[torch.Tensor] | None = None,
        controlnet_single_block_samples: list[torch.Tensor] | None = None,
        controlnet_blocks_repeat: bool = False,
    ) -> torch.Tensor:
        if joint_attention_kwargs:
            raise NotImplementedError(
                f"The native FLUX transformer does not take joint_attention_kwargs {sorted(joint_attention_kwargs)} "
                "(IP-adapter, LoRA scale). Fuse LoRA weights before accelerate(), or call omni_accel.restore(pipe)."
            )
        img = self.x_embedder(hidden_states)
        temb = self._conditioning(timestep, guidance, pooled_projections, img.dtype)
        if self.projection_cache is not None:
            self.projection_cache.prepare(temb)  # every modulation projects this same tensor
        txt = self.context_embedder(encoder_hidden_states)
        txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
        img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
        cos, sin = rope_cos_sin(torch.cat([txt_ids, img_ids], dim=0), self.axes_dims_rope, theta=10000)

        sp = img_sp = None
        if self.parallel is not None and self.parallel.config.sequence_parallel > 1:
            sp, img_sp, txt, img, cos, sin = self._split_sequence(txt, img, cos, sin)
            controlnet_block_samples = _shard_all(controlnet_block_samples, img_sp)
            controlnet_single_block_samples = _shard_all(controlnet_single_block_samples, img_sp)
        rope = (cos, sin)

        for index, block in enumerate(self.double_blocks):
            img, txt = block(img, txt, temb, rope, sp)
            if controlnet_block_samples is not None:
                img = img + _controlnet_residual(
                    controlnet_block_samples, index, len(self.double_blocks), controlnet_blocks_repeat
                )
        text_len = txt.shape[1]
        x = torch.cat([txt, img], dim=1)
        for index, block in enumerate(self.single_blocks):
            x = block(x, temb, rope, sp)
            if controlnet_single_block_samples is not None:
                residual = _controlnet_residual(
                    controlnet_single_block_samples, index, len(self.single_blocks), False
                )
                x = torch.cat([x[:, :text_len], x[:, text_len:] + residual], dim=1)
        img = x[:, text_len:]
        scale, shift = self.norm_out(temb)
        out = self.proj_out(modulate(layer_norm(img), shift, scale))
        return out if img_sp is None else img_sp.gather(out)


def _shard_all(samples: list[torch.Tensor] | None, sp: SequenceParallel) -> list[torch.Tensor] | None:
    return None if samples is None else [sp.shard(s) for s in samples]


def _controlnet_residual(
    samples: list[torch.Tensor], index: int, num_blocks: int, repeat: bool
) -> torch.Tensor:
    if repeat:
        return samples[index % len(samples)]
    interval = -(-num_blocks // len(samples))
    return samples[index // interval]
