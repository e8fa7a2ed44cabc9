"""On a GPU with a cold Triton disk cache (a fresh process, a new ``TRITON_CACHE_DIR``), an op's first launch
is served by its PyTorch reference while the kernel compiles in the background, and the launches after the
compile run the kernel (``omni_accel/utils/triton_builds.py``); an accelerated tiny FLUX's first call is
Diffusers' output to bf16 rounding either way. The CPU suite tests the protocol with a stand-in
(tests/test_triton_builds.py)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

_SCRIPT = textwrap.dedent(
    """
    import torch
    from omni_accel import kernel_builds
    from omni_accel.layers import fp8, fused

    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(2, 77, 384, device="cuda", generator=g).bfloat16()
    shift, scale = torch.randn(2, 2, 384, device="cuda", generator=g).bfloat16().unbind(0)
    reference = fused.norm_modulate_reference(x, shift, scale, 1e-6)
    first = fused.norm_modulate(x, shift, scale, 1e-6)
    assert torch.equal(first, reference), "the first launch did not serve the reference"
    keys = set(kernel_builds._BUILDING) | kernel_builds._READY
    built = [key for key in keys if "_norm_modulate_kernel" in str(key)]
    assert built, "no background compile started"
    kernel_builds.wait(300)
    assert kernel_builds.state(built[0]) == "ready", kernel_builds.state(built[0])
    later = fused.norm_modulate(x, shift, scale, 1e-6)
    # the kernel rounds once from float32 (the reference rounds each op): within one bf16 step of float32
    exact = fused.norm_modulate_reference(x.float(), shift.float(), scale.float(), 1e-6)
    step = (exact.abs() * 2**-7).clamp_min(2**-126)
    assert ((later.float() - exact).abs() <= step).all(), (later.float() - exact).abs().max()
    rows = fp8.quantize_rows(x)  # an FP8 op: the same
    data, row_scale = fp8.quantize_rows_reference(x.reshape(-1, 384))
    assert torch.equal(rows.data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(rows.scale, row_scale)

    import omni_accel

    pipe = omni_accel.tiny_flux_pipeline(dtype=torch.bfloat16, device="cuda", attention_head_dim=64)
    call = dict(prompt="a cat", num_inference_steps=2, height=64, width=64, output_type="latent")
    plain = pipe(**call, generator=torch.Generator("cuda").manual_seed(0)).images.float()
    omni_accel.accelerate(pipe)
    for _ in range(2):  # the first call served by references, the second by the kernels built meanwhile
        ours = pipe(**call, generator=torch.Generator("cuda").manual_seed(0)).images.float()
        assert ((ours - plain).abs().max() / plain.abs().max()) < 5e-2
        kernel_builds.wait(300)
    print("first launches ok")
    """
)


def test_first_launches_serve_the_reference_while_the_kernels_compile(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "first launches ok" in done.stdout
