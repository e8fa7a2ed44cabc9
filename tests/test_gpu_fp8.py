"""``quantize="fp8"`` on a GPU: the kernels that write a GEMM's input quantized are the reference
quantization of what the unquantized kernels write (bitwise, or one e4m3 step apart in rare elements where
Triton folds the bf16 rounding); the e4m3 GEMM is the product of the quantized operands
(up to its accumulation and bf16 rounding); a native FLUX replayed from CUDA graphs follows in-place weight
edits (the copies are re-made in place before the replay)."""

import copy

import pytest
import torch
from conftest import flux_inputs, random_flux_transformer, rel_err
from native_contract import _Holder

import omni_accel
from omni_accel.layers import fp8, fused

pytestmark = pytest.mark.gpu


def _bitwise(got: fp8.Fp8Rows, expected: fp8.Fp8Rows) -> None:
    assert torch.equal(got.scale, expected.scale)
    assert torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8))


@pytest.mark.parametrize("dim", [3072, 15360, 40])
def test_quantize_rows_kernel_is_the_reference(dim):
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(2, 300, dim + 8, device="cuda", generator=g).bfloat16()[..., :dim]  # strided rows
    x[0, 3] = 0  # a zero row stays zero
    rows = x.reshape(-1, dim)
    got = fp8.quantize_rows(rows)
    data, scale = fp8.quantize_rows_reference(rows)
    _bitwise(got, fp8.Fp8Rows(data, scale, got.lead, got.dtype))
    assert not got.data[3].float().any()


def _within_a_step(got: fp8.Fp8Rows, expected: fp8.Fp8Rows) -> None:
    """Bitwise but for rare elements one e4m3 step apart: Triton's compiler folds the round trip through
    bf16 that the kernel writes before quantizing (``fused_kernels``' docstring), so it quantizes the
    float32 value, one rounding fewer than the reference (measured on an H200 with bf16 modulation)."""
    assert torch.allclose(got.scale, expected.scale, rtol=2**-8, atol=0)  # amax's bf16 rounding at most
    a, b = got.data.float() * got.scale, expected.data.float() * expected.scale
    assert ((a - b).abs() <= 2**-3 * b.abs() + 2**-9 * expected.scale).all()
    assert (got.data.view(torch.uint8) != expected.data.view(torch.uint8)).float().mean() < 1e-2


@pytest.mark.parametrize("modulation_dtype", [torch.bfloat16, torch.float32])
def test_norm_modulate_fp8_kernel_is_the_quantized_norm_modulate(modulation_dtype):
    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(2, 333, 3072, device="cuda", generator=g).bfloat16() * 4
    shift, scale = (torch.randn(2, 3072, device="cuda", generator=g).to(modulation_dtype) for _ in range(2))
    _within_a_step(
        fused.norm_modulate_fp8(x, shift, scale, 1e-6),
        fp8.quantize_rows(fused.norm_modulate(x, shift, scale, 1e-6)),
    )


@pytest.mark.parametrize(
    "batch, dim_a, dim_b",
    [
        (1, 3072, 12288),  # FLUX's single blocks: attention output beside the MLP's GELU
        (2, 0, 12288),  # FLUX's double blocks' MLP
        (1, 0, 13824),  # Wan 14B's MLP
        (2, 3000, 5000),  # tiles with masked tails in both parts
        (1, 0, 20000),  # wider than a program holds: GELU then the row pass
    ],
)
def test_concat_gelu_fp8_kernel_is_the_quantized_concat_gelu(batch, dim_a, dim_b):
    g = torch.Generator("cuda").manual_seed(2)
    packed = torch.randn(batch, 600, dim_b + 3072, device="cuda", generator=g).bfloat16()  # a GEMM's columns
    a = torch.randn(batch, 600, dim_a, device="cuda", generator=g).bfloat16() * 4
    b = packed[..., 3072:]
    _bitwise(fused.concat_gelu_fp8(a, b), fp8.quantize_rows(fused.concat_gelu(a, b)))
    _bitwise(fused.gelu_tanh_fp8(b), fp8.quantize_rows(fused.gelu_tanh(b)))


def test_fp8_gemm_is_the_product_of_the_quantized_operands():
    g = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(4608, 3072, device="cuda", generator=g).bfloat16()
    w = (torch.randn(9216, 3072, device="cuda", generator=g) * 0.02).bfloat16()
    bias = torch.randn(9216, device="cuda", generator=g).bfloat16()
    weight, rows = fp8.quantize_weight(w), fp8.quantize_rows(x)
    got = fp8.fp8_linear(rows, weight, bias)
    dequantized = (rows.data.float() * rows.scale) @ (
        weight.data.float() * weight.scale.t()
    ).t() + bias.float()
    assert got.dtype == torch.bfloat16
    assert rel_err(got.float(), dequantized) < 1e-2  # fast accumulation and the bf16 output
    exact = x.float() @ w.float().t() + bias.float()
    assert rel_err(got.float(), exact) < 0.1  # what FP8 costs on Gaussian data (bf16 GEMM: ~2e-3)


def test_native_flux_fp8_follows_weight_edits_under_cuda_graphs():
    model = random_flux_transformer(
        num_attention_heads=2, attention_head_dim=64, axes_dims_rope=(16, 24, 24), joint_attention_dim=64
    )
    model = model.to("cuda", torch.bfloat16)
    inputs = {
        k: v.to("cuda", torch.bfloat16) if v.is_floating_point() else v.cuda()
        for k, v in flux_inputs(model, batch=1, image_tokens=64, text_tokens=16).items()
    }
    with torch.no_grad():
        plain = model(**inputs).sample.float()
        twin = copy.deepcopy(model)
        pipe = omni_accel.accelerate(_Holder(twin), quantize="fp8")
        outs = [twin(**inputs).sample for _ in range(3)]  # eager, capture, replay
        graphs = omni_accel.describe(pipe).components[0].graphs
        assert graphs.replays >= 1
        assert torch.equal(outs[1], outs[2])
        assert 0 < rel_err(outs[2].float(), plain) < 0.2  # lossy, not broken
        copies_before = pipe.transformer.transformer_blocks[0].attn.to_out[0].weight.data_ptr()
        twin.single_transformer_blocks[0].proj_out.weight.mul_(2)  # in place: the graph is kept
        edited = twin(**inputs).sample
        assert twin.transformer_blocks[0].attn.to_out[0].weight.data_ptr() == copies_before
        fresh_model = copy.deepcopy(model)
        fresh_model.single_transformer_blocks[0].proj_out.weight.mul_(2)
        fresh = omni_accel.accelerate(_Holder(fresh_model), quantize="fp8", cuda_graphs=False)
        assert torch.equal(edited, fresh_model(**inputs).sample)
        assert graphs.replays >= 2
        omni_accel.restore(pipe)
        omni_accel.restore(fresh)


@pytest.mark.parametrize("native", [False, True], ids=["generic", "native"])
def test_qwenimage_fp8_compiles_and_replays(native):
    """Qwen-Image under quantize="fp8", in the generic tier (``native=False``: its blocks compiled by
    inductor with our FP8 linears inside) and native (its text of a few tokens splits the joint attention
    output's row scales at an unaligned offset): steps replayed from CUDA graphs, close to the same FP8
    math run eagerly, lossy against plain Diffusers."""

    def pipeline():
        pipe = omni_accel.tiny_qwenimage_pipeline(
            attention_head_dim=64, axes_dims_rope=(16, 24, 24), dtype=torch.bfloat16, device="cuda"
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def images(pipe):
        call = dict(prompt="a cat", height=64, width=64, num_inference_steps=3, output_type="pt")
        return pipe(**call, generator=torch.Generator("cpu").manual_seed(0)).images.float()

    torch._dynamo.reset()
    plain = images(pipeline())
    eager = omni_accel.accelerate(pipeline(), quantize="fp8", compile=False, cuda_graphs=False, native=native)
    compiled = omni_accel.accelerate(pipeline(), quantize="fp8", compile_in_background=False, native=native)
    expected = images(eager)
    got = [images(compiled) for _ in range(3)]
    component = omni_accel.describe(compiled).components[0]
    assert component.runtime.fp8.copies > 0 and component.graphs.replays > 0
    assert rel_err(got[-1], expected) < 2e-2
    assert 0 < rel_err(expected, plain) < 0.5
    omni_accel.restore(compiled)
    assert torch.equal(images(compiled), plain)
