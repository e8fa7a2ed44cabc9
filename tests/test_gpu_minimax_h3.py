"""MiniMax-H3 on the GPU, as a user gets it there: its modular pipeline accelerated with the defaults (blocks
compiled in the background, steps replayed from CUDA graphs), against plain Diffusers in the same dtype;
and the exact projection cache with compiled blocks (it is consulted in the blocks' eager preparation)."""

import pytest
import torch
from conftest import random_minimax_h3_transformer, rel_err
from native_contract import _Holder
from test_minimax_h3_native import minimax_inputs
from tiny_builders import tiny_minimax_h3_pipeline

import omni_accel

pytestmark = pytest.mark.gpu

_OUTPUTS = ["latents", "audio_latents"]


def _generate(pipe, steps: int = 4) -> dict:
    call = dict(
        prompt="a cat plays the drums", num_inference_steps=steps, height=16, width=16, num_frames=124
    )
    return pipe(**call, generator=torch.Generator().manual_seed(0), output=_OUTPUTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@torch.no_grad()
def test_modular_pipeline_with_the_defaults_matches_plain(dtype):
    plain = tiny_minimax_h3_pipeline(seed=0, dtype=dtype, device="cuda")
    fast = omni_accel.accelerate(tiny_minimax_h3_pipeline(seed=0, dtype=dtype, device="cuda"))
    expected = _generate(plain)
    for request in range(3):  # eager while the blocks compile, then compiled, then replayed
        got = _generate(fast)
        for name in _OUTPUTS:
            assert not torch.isnan(got[name]).any(), (request, name)
            # compiled blocks round in their own order; plain bf16 is ~1e-2 from float32 on these weights
            bound = 3e-2 if dtype is torch.bfloat16 else 1e-4
            assert rel_err(got[name].float(), expected[name].float()) <= bound, (request, name)
        omni_accel.describe(fast).components[0].runtime.compiler.wait()
    component = omni_accel.describe(fast).components[0]
    assert component.mode == "native" and component.runtime.fallbacks == {}


@torch.no_grad()
def test_projection_cache_serves_compiled_blocks_bitwise():
    plain = random_minimax_h3_transformer().cuda()
    fast = random_minimax_h3_transformer().cuda()
    holder = omni_accel.accelerate(
        _Holder(fast), cuda_graphs=False, compile_in_background=False, projection_cache_bytes=1 << 28
    )
    cache = omni_accel.describe(holder).components[0].cache
    assert cache is not None, str(omni_accel.describe(holder))
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in minimax_inputs(plain).items()}
    expected = plain(**inputs, return_dict=False)
    first = fast(**inputs, return_dict=False)
    misses = cache.misses
    second = fast(**inputs, return_dict=False)
    assert cache.misses == misses and cache.hits >= 1 + len(fast.transformer_blocks)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # a hit is bitwise the miss
    assert all(rel_err(a, b) <= 1e-4 for a, b in zip(second, expected, strict=True))
