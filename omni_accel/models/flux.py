"""Native FLUX.1 blocks (dev and schnell): Diffusers' FluxTransformer2DModel keeps its embedders, RoPE and
output layers; its double- and single-stream blocks run the math below over packed QKV (and QKV+MLP)
GEMMs, with attention through our providers.

Only what is FLUX's own lives here: the block math, the table of packed projections and what makes a
call fall back to Diffusers' forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers.models.transformers.transformer_flux import (
    FluxAttnProcessor,
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)

from ..layers import (
    concat_gelu,
    concat_gelu_fp8,
    gated_residual,
    gelu_tanh,
    norm_modulate_gathered,
    qkv_norm_rope,
)
from ..layers.attention import (
    AttentionSite,
    attention_beside,
    input_placement,
    places_inputs,
    qkv_attention,
    through_module,
)
from ..layers.double_stream import BlockConstants, Rope
from ..layers.double_stream import double_block as _double_stream
from ..layers.fused import clip_fp16
from ..layers.projection import LinearWeights, apply_linear, apply_one, split_packed, takes_fp8_rows
from ..parallel import Colwise, ParallelPlan, Rowwise, SequencePlan, Split
from .base import NativeBlock, NativeModel, image_output_like, processor_kwargs_reason, processor_reason

_PROCESSOR_TAKES = frozenset({"hidden_states", "encoder_hidden_states", "image_rotary_emb"})


def double_block(
    img: torch.Tensor,
    txt: torch.Tensor,
    img_mod: torch.Tensor,
    txt_mod: torch.Tensor,
    rope: Rope,
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor | None],
    c: BlockConstants,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusers' FluxTransformerBlock.forward: the shared double-stream block, the text stream clipped in
    float16 (only it: FLUX's block leaves the image stream as it is)."""
    txt, img = _double_stream(img, txt, img_mod, txt_mod, rope, w, norms, c)
    return clip_fp16(txt), img


def single_block(
    x: torch.Tensor,
    mod: torch.Tensor,
    rope: Rope,
    w: dict[str, LinearWeights],
    norms: dict[str, torch.Tensor | None],
    c: BlockConstants,
) -> torch.Tensor:
    """Diffusers' FluxSingleTransformerBlock.forward on ``x = [text, image]``, with QKV and the MLP input in
    one GEMM, its elementwise steps fused and the MLP's GELU written next to the attention output (the
    output projection's input) instead of concatenated to it."""
    shift, scale, gate = mod.chunk(3, dim=1)
    rows = None if c.text_rows is None else c.text_rows + c.image_rows  # x = [text, image] on every rank
    quantized = takes_fp8_rows(w["qkv_mlp"]) and not c.overlaps_work
    h, gather = norm_modulate_gathered(x, shift, scale, c.eps, rows, quantized)
    qk_norms = [(norms["q"], norms["k"])]
    if (
        c.overlaps_work
    ):  # QKV's GEMM, the MLP input's beside the inputs' exchange, its GELU beside the outputs'
        qkv_weights, mlp_weights = split_packed(w["qkv_mlp"], 3)
        q, k, v = apply_linear(h, qkv_weights)
        heads = q.shape[-1] // c.head_dim
        placement = input_placement(x.shape[0], heads, c.head_dim, x.dtype, beside=True)
        q, k, v = qkv_norm_rope([(q, k, v)], qk_norms, c.head_dim, c.qk_eps, rope, placement=placement)
        width = heads * c.head_dim
        joined = h.new_empty(*h.shape[:2], width + sum(mlp_weights.sizes))  # [attention, GELU(mlp)]
        attended, activated = joined.split([width, joined.shape[-1] - width], dim=-1)
        attention_beside(
            q, k, v, c.site, lambda: apply_one(h, mlp_weights), placement,
            then=lambda mlp: gelu_tanh(mlp, out=activated), out=attended.unflatten(-1, (heads, c.head_dim)),
        )  # fmt: skip
    else:
        mlp_input = []

        def attend() -> torch.Tensor:  # the attention module's forward (its QKV's GEMM the MLP input's too)
            q, k, v, mlp = apply_linear(h, w["qkv_mlp"], gather)
            mlp_input.append(mlp)
            out = qkv_attention([(q, k, v)], qk_norms, c.head_dim, c.qk_eps, rope, c.site, placed=c.placed)
            return out.flatten(2, 3).to(q.dtype)

        attended = through_module(c.attention_module, attend)
        (mlp,) = mlp_input or apply_linear(h, split_packed(w["qkv_mlp"], 3)[1], gather)  # attend predicted
        fp8 = takes_fp8_rows(w["out"]) and rows is None
        joined = (concat_gelu_fp8 if fp8 else concat_gelu)(attended, mlp)
    x = gated_residual(x, gate, apply_one(joined, w["out"], rows))
    return clip_fp16(x)


def _joined(txt: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
    """``cat([txt, img], dim=1)``; without a copy when they are the two halves of one tensor, as the
    previous single block returns them (so only the first single block pays for the concatenation)."""
    if torch.compiler.is_dynamo_compiling():  # storage checks do not trace; the compiler handles the copy
        return torch.cat([txt, img], dim=1)
    if torch.is_grad_enabled() and (txt.requires_grad or img.requires_grad):
        return torch.cat([txt, img], dim=1)  # autograd must see both halves (as_strided's backward would not)
    batch, text_len, dim = txt.shape
    length = text_len + img.shape[1]
    stride = (length * dim, dim, 1)
    if (
        txt.untyped_storage().data_ptr() == img.untyped_storage().data_ptr()
        and txt.stride() == stride
        and img.stride() == stride
        and img.storage_offset() == txt.storage_offset() + text_len * dim
        and txt.dtype == img.dtype
    ):
        return txt.as_strided((batch, length, dim), stride)
    return torch.cat([txt, img], dim=1)


class _FluxNative(NativeBlock):
    site: AttentionSite
    math: Any

    def unsupported_reason(self, joint_attention_kwargs: dict[str, Any] | None) -> str | None:
        return processor_reason(self.attn, FluxAttnProcessor) or processor_kwargs_reason(
            FluxAttnProcessor, _PROCESSOR_TAKES, joint_attention_kwargs
        )

    def head_dim(self) -> int:
        return self.attn.head_dim

    def _norms(self) -> dict[str, torch.Tensor | None]:
        attn = self.attn
        names = ("q", "k", "added_q", "added_k") if attn.added_kv_proj_dim is not None else ("q", "k")
        return {name: getattr(attn, f"norm_{name}").weight for name in names}

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: Rope = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = (hidden_states, encoder_hidden_states, temb, image_rotary_emb)

        def run(math, prepared):
            modulation, weights, norms, constants = prepared
            args = (*modulation, image_rotary_emb, weights, norms, constants)
            return self._run(math, hidden_states, encoder_hidden_states, *args)

        return self.native_call(
            functools.partial(super().forward, *inputs, joint_attention_kwargs),
            lambda: self._prepare(temb, joint_attention_kwargs, inputs),
            run,
        )

    @torch.compiler.disable
    def _prepare(self, temb: torch.Tensor, joint_attention_kwargs: dict[str, Any] | None, inputs: tuple):
        """Everything host-side (reading and packing weights, the projection cache, constants), or None when
        this call runs Diffusers' forward. Never traced (``run_as_diffusers``)."""
        weights = self.native_weights(joint_attention_kwargs, inputs=inputs)
        if weights is None:
            return None
        runtime = self.omni_runtime
        modulation = [self.modulate(name, temb, weights) for name in self.modulations]
        placed = places_inputs()  # decided here, eagerly: it may map the peer buffers
        attention_module = self.attention_module_call("attn")
        constants = BlockConstants(
            self.attn.head_dim,
            self._layer_norm_eps(),
            self.attn.norm_q.eps,
            type(self).site,
            True,
            runtime.rows("image"),
            runtime.rows("text"),
            placed,
            # compiled, attention_beside runs attention then the work: one GEMM serves better there
            placed and runtime.compiler is None and runtime.rows("text") is None and attention_module is None,
            attention_module,
        )
        return modulation, weights, self._norms(), constants


class NativeFluxTransformerBlock(_FluxNative, FluxTransformerBlock):
    """FLUX's double-stream block: image and text streams with their own weights, joined in attention."""

    tanh_gelus = ("ff.net.0", "ff_context.net.0")

    packed = {
        "img_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    }
    linears = {
        "img_mod": "norm1.linear",
        "txt_mod": "norm1_context.linear",
        "img_out": "attn.to_out.0",
        "txt_out": "attn.to_add_out",
        "img_up": "ff.net.0.proj",
        "img_down": "ff.net.2",
        "txt_up": "ff_context.net.0.proj",
        "txt_down": "ff_context.net.2",
    }
    # Diffusers' FluxTransformer2DModel._tp_plan splits the same projections the same way; ours is kept
    # because it also splits the AdaLN modulation projections (norm1*.linear, gathered whole: a third of
    # this block's weights, a fifth of the single block's, which its plan leaves whole on every rank) and
    # declares the packed QKV GEMMs our blocks run over those linears' parameters.
    tp_plan = {
        **dict.fromkeys(packed["img_qkv"] + packed["txt_qkv"], Colwise()),
        "attn.to_out.0": Rowwise(),
        "attn.to_add_out": Rowwise(),
        "norm1.linear": Colwise(),  # modulations: gathered whole (NativeBlock.modulate)
        "norm1_context.linear": Colwise(),
        "ff.net.0.proj": Colwise(),
        "ff.net.2": Rowwise(),
        "ff_context.net.0.proj": Colwise(),
        "ff_context.net.2": Rowwise(),
    }
    modulations = ("img_mod", "txt_mod")
    attention_modules = ("attn",)
    site = AttentionSite("flux.joint", "self")
    sites = (site,)
    math = staticmethod(double_block)

    def _run(self, math, img, txt, *args):
        return math(img, txt, *args)

    def _layer_norm_eps(self) -> float:
        return self.norm2.eps


class NativeFluxSingleTransformerBlock(_FluxNative, FluxSingleTransformerBlock):
    """FLUX's single-stream block over [text, image]: attention QKV and the MLP input share one GEMM."""

    tanh_gelus = ("act_mlp",)

    packed = {"qkv_mlp": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
    linears = {"mod": "norm.linear", "out": "proj_out"}
    tp_plan = {
        **dict.fromkeys(packed["qkv_mlp"], Colwise()),
        "proj_out": Rowwise(input_parts=("attn.to_q", "proj_mlp")),  # its input: cat([attention, mlp])
        "norm.linear": Colwise(),  # the modulation: gathered whole (NativeBlock.modulate)
    }
    modulations = ("mod",)
    attention_modules = ("attn",)
    site = AttentionSite("flux.single", "self", ring_merges=False)  # beside its MLP: attention_beside
    sites = (site,)
    math = staticmethod(single_block)

    def _run(self, math, img, txt, *args):
        text_len = txt.shape[1]
        x = math(_joined(txt, img), *args)
        return x[:, :text_len], x[:, text_len:]

    def _layer_norm_eps(self) -> float:
        return self.norm.norm.eps


def true_cfg_pairs(arguments: dict[str, Any]) -> bool:
    """FluxPipeline calls the transformer twice per step (cond, then uncond) exactly when true CFG is on."""
    negative = arguments.get("negative_prompt") is not None or (
        arguments.get("negative_prompt_embeds") is not None
        and arguments.get("negative_pooled_prompt_embeds") is not None
    )
    return arguments.get("true_cfg_scale", 1.0) > 1 and negative


FLUX = NativeModel(
    blocks={
        "transformer_blocks": NativeFluxTransformerBlock,
        "single_transformer_blocks": NativeFluxSingleTransformerBlock,
    },
    parallel=ParallelPlan(
        name="FLUX",
        attention_heads="num_attention_heads",
        # Diffusers' _cp_plan splits hidden_states, encoder_hidden_states, img_ids and txt_ids and gathers
        # proj_out as this does; ours is kept for what it lacks: ControlNet residuals split with the image
        # tokens, the deprecated 3-D ids, which stream each input belongs to (so that uneven splits need no
        # length exchange) and the ring's schedule.
        sequence=SequencePlan(
            inputs={
                "hidden_states": Split("image", 1),
                "img_ids": Split("image", -2, positions=True),  # [tokens, 3] (or deprecated [1, tokens, 3])
                "controlnet_block_samples": Split("image", 1),
                "controlnet_single_block_samples": Split("image", 1),
                "encoder_hidden_states": Split("text", 1),
                "txt_ids": Split("text", -2, positions=True),
            },
            output=("proj_out", Split("image", 1)),
            ring_first=True,  # its single blocks run the MLP's GEMM beside the K/V transfer (docs/PERFORMANCE.md)
        ),
        batched_inputs=(
            "hidden_states",
            "encoder_hidden_states",
            "pooled_projections",
            "timestep",
            "guidance",
            "controlnet_block_samples",
            "controlnet_single_block_samples",
        ),
        output_like=image_output_like,
    ),
    cfg_pairing=true_cfg_pairs,
    falls_back_on=(
        "IP-adapter processors, Diffusers attention backends set on a processor (or process-wide, where no "
        "provider of ours runs the same kernel), fuse_qkv_projections(), DoRA adapters, hooks on a submodule "
        "(but TaylorSeer's on attention, which runs around the native attention), active dropout in training "
        "mode, gradients flowing through a block and a user's torch.compile of the blocks run Diffusers' "
        "forward of the block (counted in the report, except under torch.compile; an error under tensor or "
        "sequence parallelism)"
    ),
)
