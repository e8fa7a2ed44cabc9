"""The fused Triton kernels against the unfused references they replace.

On a GPU (``-m gpu``) at FLUX's shapes in bf16, fp16 and fp32; on CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, fp32 only: the interpreter does not round to bf16 as the GPU does), when Triton is
installed. The native blocks' parity with Diffusers runs the references on CPU (tests/test_flux_native.py).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from omni_accel.layers import apply_rope, layer_norm, modulate
from omni_accel.utils.kernels import HAS_TRITON


def _check(name: str, got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> None:
    """The kernels round once where the references round after every op: in half precision the results
    may differ by up to two rounding steps of ``scale`` (the magnitude of the values the reference rounds).
    fp32 carries the reordering into every element: relative 1e-5."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, name
    if ref.dtype == torch.float32:
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
        return
    diff = (got.float() - ref.float()).abs()
    steps = torch.where(diff == 0, 0.0, diff / (scale.float() * torch.finfo(ref.dtype).eps))
    assert steps.max() <= 2.01, f"{name}: {steps.max():.1f} rounding steps"


def run_checks(device: str, dtypes: list[torch.dtype], batch=2, text=64, image=192, heads=3, head_dim=128):
    from omni_accel.attention import merge, merge_kernel
    from omni_accel.layers import fused_kernels as kernels
    from omni_accel.parallel import copies
    from omni_accel.parallel.copies import copy_rows_

    g = torch.Generator(device).manual_seed(0)
    dim = heads * head_dim

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    for dtype in dtypes:
        x = randn(batch, image, dim, dtype=dtype) * 3
        mod = randn(batch, 6 * dim, dtype=dtype)
        shift, scale, gate = mod.chunk(6, dim=1)[:3]
        strided = randn(batch, image, 2 * dim, dtype=dtype)[..., :dim]  # rows of a packed projection
        for label, t in (("", x), (" strided", strided)):
            normed = layer_norm(t, 1e-6)
            magnitude = (normed * (1 + scale[:, None])).abs() + shift[:, None].abs()
            got = kernels.norm_modulate(t, shift, scale, 1e-6)
            _check(f"norm_modulate{label} {dtype}", got, modulate(normed, shift, scale), magnitude)
        # Into every rank's buffer of a gather at once (a token split's rows at an offset in one).
        buffers = torch.zeros(2, batch, image + 7, dim, dtype=dtype, device=device)
        outs = [buffers[0].narrow(1, 3, image), buffers[1].narrow(1, 0, image)]
        kernels.norm_modulate_into(x, shift, scale, 1e-6, outs)
        want = kernels.norm_modulate(x, shift, scale, 1e-6)
        assert all(torch.equal(out, want) for out in outs), f"norm_modulate_into {dtype}"
        assert not buffers[0, :, :3].any() and not buffers[0, :, 3 + image :].any()
        assert not buffers[1, :, image:].any(), f"norm_modulate_into wrote outside its rows {dtype}"

        y = randn(batch, image, dim, dtype=dtype)
        product = gate.unsqueeze(1) * y
        magnitude = x.abs() + product.abs()
        _check(f"gated_residual {dtype}", kernels.gated_residual(x, gate, y), x + product, magnitude)

        # Wan: float32 modulation and gates over half-precision activations, float32 math (Diffusers').
        shift32, scale32, gate32 = shift.float(), scale.float(), gate.float()
        scaled = F.layer_norm(x.float(), (dim,), eps=1e-6) * (1 + scale32[:, None])
        got = kernels.norm_modulate(x, shift32, scale32, 1e-6)
        ref = scaled + shift32[:, None]
        _check(
            f"norm_modulate fp32 modulation {dtype}",
            got,
            ref.to(dtype),
            scaled.abs() + shift32[:, None].abs(),
        )
        product = gate32[:, None] * y.float()
        got = kernels.gated_residual(x, gate32, y)
        ref = x.float() + product
        _check(f"gated_residual fp32 gate {dtype}", got, ref.to(dtype), x.abs() + product.abs())

        mlp = randn(batch, image, 5 * dim, dtype=dtype)[..., dim:] * 4  # strided rows, as in a packed GEMM
        activated = F.gelu(mlp, approximate="tanh")
        # GELU's reference rounds values of the input's size (x, 1 + tanh) even where the result is tiny.
        magnitude = activated.abs() + mlp.abs()
        _check(f"gelu_tanh {dtype}", kernels.concat_gelu(x[..., :0], mlp), activated, magnitude)
        ref = torch.cat([x, activated], dim=-1)
        _check(
            f"concat_gelu {dtype}", kernels.concat_gelu(x, mlp), ref, torch.cat([x.abs(), magnitude], dim=-1)
        )
        # Into the columns of a wider tensor (a projection's input whose other columns are written apart).
        wide = torch.zeros(batch, image, dim + 4 * dim + 3, dtype=dtype, device=device)
        kernels.concat_gelu_into(mlp[..., :0], mlp, wide[..., dim : 5 * dim])
        assert torch.equal(wide[..., dim : 5 * dim], kernels.concat_gelu(x[..., :0], mlp)), f"into {dtype}"
        assert not wide[..., :dim].any() and not wide[..., 5 * dim :].any(), f"gelu wrote outside {dtype}"

        # q, k, v are strided views of a QKV GEMM's output; text and image have their own norm weights.
        packed = randn(batch, image, 3 * dim, dtype=dtype)
        txt = randn(batch, text, 3 * dim, dtype=dtype)
        w_img, w_txt = randn(2, head_dim, dtype=dtype), randn(2, head_dim, dtype=dtype)
        angles = torch.rand(text + image, head_dim // 2, generator=g, device=device) * 100
        cos, sin = (f(angles).repeat_interleave(2, dim=1) for f in (torch.cos, torch.sin))
        segments = [txt.chunk(3, dim=-1), packed.chunk(3, dim=-1)]
        weights = [list(w_txt), list(w_img)]
        qs, ks, vs = ([t[i] for t in segments] for i in range(3))
        q_weights, k_weights = ([w[i] for w in weights] for i in range(2))
        got = kernels.qkv_norm_rope(qs, ks, vs, q_weights, k_weights, head_dim, 1e-6, cos, sin)
        for which, (tensors, norm_weights) in enumerate(((qs, q_weights), (ks, k_weights))):
            normed = [
                F.rms_norm(t.unflatten(-1, (-1, head_dim)), (head_dim,), w, 1e-6)
                for t, w in zip(tensors, norm_weights, strict=True)
            ]
            ref = apply_rope(torch.cat(normed, dim=1), cos, sin)
            _check(
                f"qkv_norm_rope {'qk'[which]} {dtype}", got[which], ref, ref.abs().amax(dim=-1, keepdim=True)
            )
        joint_v = torch.cat([v.unflatten(-1, (-1, head_dim)) for v in vs], dim=1)
        assert torch.equal(got[2], joint_v), f"qkv_norm_rope v {dtype}"
        lone = kernels.qkv_norm_rope(
            qs[1:], ks[1:], [], q_weights[1:], k_weights[1:], head_dim, 1e-6, cos[text:], sin[text:]
        )
        assert len(lone) == 2 and torch.equal(lone[0], got[0][:, text:]), f"qkv_norm_rope one segment {dtype}"
        # Into a caller's k/v buffers whose samples hold more tokens (a ring's: this rank's block first).
        buffers = torch.zeros(2, batch, text + image + 5, heads, head_dim, dtype=dtype, device=device)
        outs = [torch.empty_like(got[0]), *(b.narrow(1, 0, text + image) for b in buffers)]
        args = (qs, ks, vs, q_weights, k_weights, head_dim, 1e-6, cos, sin, False)
        kernels.qkv_norm_rope_into(*args, [((0, out),) for out in outs])
        assert all(map(torch.equal, outs, got)), f"qkv_norm_rope_into {dtype}"
        assert not buffers[:, :, text + image :].any(), f"qkv_norm_rope_into wrote past its tokens {dtype}"
        _check_scattered(
            kernels.qkv_norm_rope_into, args, got, device, f"qkv_norm_rope_into scattered {dtype}"
        )

        # Wan: the RMSNorm across all heads (a weight per channel), RoPE tables shaped [1, S, 1, D].
        w_row = randn(2, dim, dtype=dtype)
        wan_cos, wan_sin = cos[None, text:, None], sin[None, text:, None]
        q, k, _ = packed.chunk(3, dim=-1)
        got = kernels.qkv_norm_rope(
            [q], [k], [], [w_row[0]], [w_row[1]], head_dim, 1e-6, wan_cos, wan_sin, True
        )
        for which, t in enumerate((q, k)):
            normed = F.rms_norm(t, (dim,), w_row[which], 1e-6).unflatten(-1, (-1, head_dim))
            ref = apply_rope(normed, wan_cos, wan_sin)
            _check(
                f"qkv_norm_rope across heads {dtype}", got[which], ref, ref.abs().amax(dim=-1, keepdim=True)
            )
        args = ([q], [k], [], [w_row[0]], [w_row[1]], head_dim, 1e-6, wan_cos, wan_sin, True)
        _check_scattered(kernels.qkv_norm_rope_into, args, got, device, f"across heads scattered {dtype}")

        # Ring attention's merge of two partials: outputs BSHD (one a strided view), LSEs [B, H, S] (one
        # transposed, as a kernel may return it), against the reference in float64.
        tokens = text + image
        partials = randn(batch, tokens, heads, 2 * head_dim, dtype=dtype)
        out_a, out_b = partials[..., :head_dim], partials[..., head_dim:].contiguous()
        lse_a = torch.randn(batch, heads, tokens, generator=g, device=device) * 4
        lse_b = (torch.randn(batch, tokens, heads, generator=g, device=device) * 4).transpose(1, 2)
        want, want_lse = merge.merge_partials(out_a.double(), lse_a.double(), out_b.double(), lse_b.double())
        # Ulysses' packing of a stage's heads rank by rank, and the unpacking of its output: bitwise copies.
        q = randn(batch, tokens, 2 * heads * 4, head_dim // 4, dtype=dtype)  # two stages, 4 x 32 per head
        stage = q.narrow(2, heads * 4, heads * 4)
        per_rank = stage.unflatten(2, (2, heads * 2)).movedim(2, 0)
        packed = copy_rows_(torch.empty_like(per_rank, memory_format=torch.contiguous_format), per_rank)
        assert torch.equal(packed, per_rank), f"copy_rows_ pack {dtype}"
        unpacked = copy_rows_(torch.zeros_like(q).narrow(2, 0, heads * 4), stage)
        assert torch.equal(unpacked, stage), f"copy_rows_ unpack {dtype}"
        assert copies._rows(packed, per_rank) is not None  # the kernel ran, not PyTorch's copy

        for out_dtype in dict.fromkeys((torch.float32, dtype)):
            got, got_lse = merge_kernel.merge_attention(out_a, lse_a, out_b, lse_b, out_dtype)
            magnitude = torch.maximum(out_a.abs(), out_b.abs()).double()
            _check(f"merge_attention {dtype} -> {out_dtype}", got, want.to(out_dtype), magnitude)
            _check(f"merge_attention lse {dtype}", got_lse, want_lse.float(), want_lse.abs())


def _check_scattered(into, args, want: list[torch.Tensor], device: str, name: str) -> None:
    """``into`` writing each head group of q, k (and v, if ``want`` has it) into its own buffer, as Ulysses'
    ranks' buffers take them: the first head into one buffer at token 3 of 3 + S + 2, the others into
    another at token 0 of S + 4; each piece bitwise the joint result's heads, nothing written around it."""
    batch, tokens, heads, head_dim = want[0].shape
    groups = [(0, 1, 3, 2), (1, heads - 1, 0, 4)]  # (first head, heads, tokens before, tokens after)
    buffers, pieces = [], []
    for _ in want:
        own = []
        for first, count, before, after in groups:
            buffer = torch.zeros(batch, before + tokens + after, count, head_dim, dtype=want[0].dtype)
            buffers.append((buffer.to(device), before))
            own.append((first, buffers[-1][0].narrow(1, before, tokens)))
        pieces.append(tuple(own))
    into(*args, pieces)
    for own, t in zip(pieces, want, strict=True):
        for first, dst in own:
            assert torch.equal(dst, t.narrow(2, first, dst.shape[2])), name
    for buffer, before in buffers:
        outside = torch.cat([buffer[:, :before], buffer[:, before + tokens :]], dim=1)
        assert not outside.any(), f"{name}: wrote outside its tokens"


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_kernels_in_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "import torch, test_fused_kernels as t; t.run_checks('cpu', [torch.float32], image=24, text=8)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
def test_kernels_on_the_gpu_at_flux_shapes():
    run_checks(
        "cuda", [torch.bfloat16, torch.float16, torch.float32], batch=1, text=512, image=4096, heads=24
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gelu_is_as_accurate_as_pytorchs_on_the_gpu(dtype):
    """The GELU kernel's ``x * sigmoid(2u)`` is not PyTorch's ``tanhf`` arithmetic; against the float64
    GELU (in the same cancellation-free form) it is no less accurate. In half precision it rounds to the
    correctly rounded value at least as often as PyTorch does, and no element is more than one rounding
    step from it where PyTorch's is not; in float32 its worst relative error is no larger (PyTorch's
    ``1 + tanh`` cancels for negative inputs)."""
    from omni_accel.layers import concat_gelu, gelu_tanh

    g = torch.Generator("cuda").manual_seed(0)
    wide = torch.randn(1, 4608, 3072 + 12288, generator=g, device="cuda").mul(4).to(dtype)
    attn, mlp = wide[..., :3072], wide[..., 3072:]
    x = mlp.double()
    exact = x * torch.sigmoid(2 * 0.7978845608028654 * (x + 0.044715 * x**3))
    theirs, ours = F.gelu(mlp, approximate="tanh"), gelu_tanh(mlp)
    assert torch.equal(concat_gelu(attn, mlp), torch.cat([attn, ours], dim=-1))
    joined = torch.cat([attn, torch.zeros_like(mlp)], dim=-1)
    assert gelu_tanh(mlp, out=joined[..., 3072:]).data_ptr() == joined[..., 3072:].data_ptr()
    assert torch.equal(joined, torch.cat([attn, ours], dim=-1))  # the kernel, into the columns
    if dtype == torch.float32:
        worst = [
            ((t.double() - exact).abs() / exact.abs().clamp_min(1e-2)).max().item() for t in (ours, theirs)
        ]
        assert worst[0] <= worst[1], worst
        return
    correct = exact.to(dtype)
    assert (ours != correct).float().mean() <= (theirs != correct).float().mean()
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(correct.double())
    step = torch.ldexp(torch.full_like(exact, info.eps), exponent - 1).clamp_min(info.tiny * info.eps)
    ours_far, theirs_far = ((t.double() - correct.double()).abs() > step for t in (ours, theirs))
    assert not (ours_far & ~theirs_far).any()


@pytest.mark.gpu
def test_custom_ops_pass_opcheck():
    from omni_accel.layers import fused_kernels  # noqa: F401

    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g, device="cuda", dtype=torch.bfloat16)
    mod = torch.randn(2, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    shift, scale = mod.chunk(2, dim=1)
    cos, sin = torch.ones(5, 16, device="cuda"), torch.zeros(5, 16, device="cuda")
    w = torch.ones(16, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.omni_accel.norm_modulate.default, (x, shift, scale, 1e-6))
    torch.library.opcheck(torch.ops.omni_accel.gated_residual.default, (x, shift, x))
    torch.library.opcheck(torch.ops.omni_accel.concat_gelu.default, (x, x[..., 16:]))
    op = torch.ops.omni_accel.qkv_norm_rope.default
    torch.library.opcheck(
        op, ([x, x], [x, x], [x, x], [w, w], [w, w], 16, 1e-6, cos.repeat(2, 1), sin.repeat(2, 1))
    )
    row_weight = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(op, ([x], [x], [], [row_weight], [row_weight], 16, 1e-6, cos, sin, True))
    from omni_accel.attention import merge_kernel  # noqa: F401

    out, lse = x.unflatten(-1, (4, 16)), torch.randn(2, 4, 5, generator=g, device="cuda")
    for out_dtype in (torch.float32, torch.bfloat16):
        args = (out, lse, out * 2, lse.flip(0), out_dtype)
        torch.library.opcheck(torch.ops.omni_accel.merge_attention.default, args)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_qkv_norm_rope_writes_where_the_placement_asks(device):
    """A ring's placement (q anywhere, k and v into its buffer) and a Ulysses one (each tensor's heads split
    between two buffers, at an offset in one): what comes back is what the placement says attention
    takes, each piece holds its heads of the unplaced result, nothing is written around them. On the GPU
    the kernel writes them (heads of 16: the kernel's smallest tile), on CPU the reference and copies."""
    from omni_accel.layers import qkv_norm_rope
    from omni_accel.parallel.placement import Placement

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 5, 48, generator=g).to(device)  # [B, S, H * D] with 3 heads of 16
    norms = [tuple(torch.randn(2, 16, generator=g).to(device))]
    angles = torch.rand(5, 8, generator=g) * 10
    rope = tuple(f(angles).repeat_interleave(2, dim=1).to(device) for f in (torch.cos, torch.sin))
    want = qkv_norm_rope([(q, k, v)], norms, 16, 1e-6, rope)

    ring_buffers = torch.zeros(2, 2, 7, 3, 16, device=device)
    own = tuple(b.narrow(1, 0, 5) for b in ring_buffers)
    ring = Placement(None, ((0, own[0]),), ((0, own[1]),), (None, *own))
    got = qkv_norm_rope([(q, k, v)], norms, 16, 1e-6, rope, placement=ring)
    assert got[1] is own[0] and got[2] is own[1]
    assert all(map(torch.equal, got, want))
    assert not ring_buffers[:, :, 5:].any()

    first, second = torch.zeros(3, 2, 7, 1, 16, device=device), torch.zeros(3, 2, 5, 2, 16, device=device)
    pieces = [((0, a.narrow(1, 2, 5)), (1, b)) for a, b in zip(first, second, strict=True)]
    ulysses = Placement(*pieces, tuple(first))
    got = qkv_norm_rope([(q, k, v)], norms, 16, 1e-6, rope, placement=ulysses)
    assert all(a is b for a, b in zip(got, ulysses.attend_on, strict=True))
    for placed, t in zip(pieces, want, strict=True):
        for head, dst in placed:
            assert torch.equal(dst, t.narrow(2, head, dst.shape[2]))
    assert not first[:, :, :2].any()

    # Ulysses in head stages: every head in a buffer of its own (a stage's rank each), at its own offset
    offsets = (0, 3, 1)
    buffers = [torch.zeros(3, 2, 5 + at, 1, 16, device=device) for at in offsets]
    pieces = [
        tuple(
            (h, buffer[i].narrow(1, at, 5))
            for h, (buffer, at) in enumerate(zip(buffers, offsets, strict=True))
        )
        for i in range(3)
    ]
    staged = Placement(*pieces, tuple(p[0][1] for p in pieces))
    got = qkv_norm_rope([(q, k, v)], norms, 16, 1e-6, rope, placement=staged)
    for placed, t in zip(pieces, want, strict=True):
        for head, dst in placed:
            assert torch.equal(dst, t.narrow(2, head, 1))
    assert not buffers[1][:, :, :3].any() and not buffers[2][:, :, :1].any()


@pytest.mark.gpu
def test_norm_modulate_writes_a_gathers_rows_itself(monkeypatch):
    """``norm_modulate_gathered`` where the gather goes by peer writes: the kernel writes this rank's
    tokens of two segments (text, image) into every rank's buffer at their places, and what comes back
    is the gathered tensor: here one process plays rank 1 of 2, both buffers its own."""
    from omni_accel.layers import fused
    from omni_accel.parallel.token_rows import GatherTargets, Rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3 + 5, 64, generator=g).cuda().bfloat16()  # rank 1's 3 text and 5 image tokens
    shift, scale = (torch.randn(2, 64, generator=g).cuda().bfloat16() for _ in range(2))
    buffers = torch.zeros(2, 2, 4 + 3 + 6 + 5, 64, device="cuda", dtype=torch.bfloat16)  # texts, images
    segments = (
        (0, 3, tuple(b.narrow(1, 4, 3) for b in buffers)),
        (3, 5, tuple(b.narrow(1, 13, 5) for b in buffers)),
    )

    class OnePeer:
        def barrier(self) -> None:
            torch.cuda.synchronize()

    joined = buffers[1]
    monkeypatch.setattr(fused, "gather_targets", lambda x, rows: GatherTargets(segments, joined, OnePeer()))
    rows = Rows("tokens", "tp", ((4, 3), (6, 5)))
    got, left = fused.norm_modulate_gathered(x, shift, scale, 1e-6, rows)
    want = fused.norm_modulate(x, shift, scale, 1e-6)
    assert got is joined and left is None
    for buffer in buffers:
        assert torch.equal(buffer[:, 4:7], want[:, :3]) and torch.equal(buffer[:, 13:], want[:, 3:])
        assert not buffer[:, :4].any() and not buffer[:, 7:13].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_mlps_gelu_runs_in_the_gemms_epilogue_on_the_gpu(dtype, monkeypatch):
    """In half precision a plain MLP's tanh-GELU runs in cuBLASLt's epilogue (one row too: torch's
    fallback is the same tanh-GELU) and is no further from a float64 MLP than the GEMM followed by the
    GELU kernel; float32 and a projection with an adapter keep the kernel."""
    from omni_accel.layers import LinearWeights, apply_one, feed_forward, gelu_tanh
    from omni_accel.layers.projection import LowRank, read_linear

    epilogues = []
    real = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation", lambda *a, **k: epilogues.append(k) or real(*a, **k))
    g = torch.Generator("cuda").manual_seed(0)
    dim, width = 256, 1024
    w_up, w_down = (
        torch.randn(*s, generator=g, device="cuda").div(s[1] ** 0.5) for s in ((width, dim), (dim, width))
    )
    b_up, b_down = (torch.randn(n, generator=g, device="cuda") for n in (width, dim))

    def read(w, b):  # parameters of a linear, as a block reads them
        linear = torch.nn.Linear(w.shape[1], w.shape[0], device="cuda", dtype=dtype).requires_grad_(False)
        linear.weight.copy_(w)
        linear.bias.copy_(b)
        return read_linear(linear, "mlp")

    up, down = read(w_up, b_up), read(w_down, b_down)

    def exact(x):
        h = F.linear(x.double(), w_up.to(dtype).double(), b_up.to(dtype).double())
        h = h * torch.sigmoid(2 * 0.7978845608028654 * (h + 0.044715 * h**3))
        return F.linear(h, w_down.to(dtype).double(), b_down.to(dtype).double())

    for tokens in (1, 300):
        x = torch.randn(2, tokens, dim, generator=g, device="cuda").mul(2).to(dtype)
        ref = exact(x)
        errors = [
            ((y.double() - ref).abs().max() / ref.abs().max()).item()
            for y in (feed_forward(x, up, down), apply_one(gelu_tanh(apply_one(x, up)), down))
        ]
        assert errors[0] <= 1.25 * errors[1] + 1e-6, errors
    assert len(epilogues) == (0 if dtype == torch.float32 else 2)
    scale = torch.tensor(0.5)
    adapter = LowRank(
        torch.zeros(4, dim, device="cuda", dtype=dtype),
        torch.zeros(width, 4, device="cuda", dtype=dtype),
        None,
        scale,
        False,
    )
    adapted = LinearWeights(up.weight, up.bias, up.sizes, ((adapter,),))
    assert torch.equal(feed_forward(x, adapted, down), apply_one(gelu_tanh(apply_one(x, up)), down))
    assert len(epilogues) == (0 if dtype == torch.float32 else 2)
