"""MiniMax-H3 on the native-model test contract: one packed sequence of text, video and audio rows, the
AdaLN parameters of each row chosen from a (timestep, modality) table, the rotate-half RoPE of the first
channels of each head, and the text token refiner."""

import pytest
import torch
import torch.distributed as dist
from conftest import random_lora, random_minimax_h3_transformer, rel_err
from multirank import run_multirank
from native_contract import NativeContract, _Holder

import omni_accel
from omni_accel import ParallelConfig


def minimax_inputs(module, batch=1, text=5, frames=2, side=2, audio=3, seed=1):
    """A packed layout as the MiniMax-H3 pipeline makes one: ``[text, video, audio]`` rows, the video's
    first frame a clean conditioning frame (timestep 0) and the rest at the step's noise level."""
    cfg = module.config
    g = torch.Generator().manual_seed(seed)
    video = frames * side * side
    length = text + video + audio
    text_indices = torch.arange(text)
    video_indices = torch.arange(text, text + video)
    audio_indices = torch.arange(text + video, length)
    tags = torch.cat([torch.ones(text), torch.zeros(video), torch.full((audio,), 2)]).long()
    timestep_indices = torch.zeros(length, dtype=torch.long)
    timestep_indices[text + side * side :] = 1  # the first frame (and the text) at t = 0
    t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(side), torch.arange(side), indexing="ij")
    grid = torch.stack([t.flatten(), h.flatten(), w.flatten()], dim=-1)
    positions = torch.cat(
        [
            torch.stack([torch.arange(text)] * 3, dim=-1),
            grid + text,
            torch.stack([torch.arange(audio)] * 3, dim=-1) + text + frames,
        ]
    )
    patch = cfg.in_channels * 4
    return dict(
        hidden_states=torch.randn(batch, video, patch, generator=g),
        audio_hidden_states=torch.randn(batch, audio, cfg.audio_in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text, cfg.text_dim, generator=g),
        timestep=torch.tensor([0.0, 0.7]),
        timestep_indices=timestep_indices,
        token_tags=tags,
        position_ids=positions,
        video_indices=video_indices,
        audio_indices=audio_indices,
        text_indices=text_indices,
    )


class TestMiniMaxH3Contract(NativeContract):
    cases = [
        ({}, dict()),
        ({}, dict(batch=2, text=7, frames=3, side=3, audio=5)),
        ({"num_attention_heads": 4, "num_layers": 1, "num_refiner_layers": 2}, dict(text=3)),
    ]
    layouts = [
        (ParallelConfig(tp=2), {}, None),
        (ParallelConfig(ulysses=2), {}, dict(batch=2, text=7, frames=3, side=3, audio=5)),  # 39 rows: uneven
        (ParallelConfig(ring=2), {}, None),
    ]

    make_module = staticmethod(random_minimax_h3_transformer)
    make_inputs = staticmethod(minimax_inputs)


def test_audio_output_matches_too_and_lora_restores():
    plain, fast = random_minimax_h3_transformer(), random_minimax_h3_transformer()
    holder = omni_accel.accelerate(_Holder(fast))
    inputs = minimax_inputs(plain)
    lora = random_lora(plain, ["to_q", "ff.net.0.proj", "adaln_proj.linear"], seed=3)
    for module in (plain, fast):
        module.load_lora_adapter(lora, adapter_name="a", prefix="transformer")
    with torch.no_grad():
        expected = plain(**inputs, return_dict=False)
        got = fast(**inputs, return_dict=False)
    assert all(rel_err(a, b) <= 1e-5 for a, b in zip(got, expected, strict=True))
    assert omni_accel.describe(holder).components[0].runtime.fallbacks == {}
    omni_accel.restore(holder)
    with torch.no_grad():
        assert all(
            torch.equal(a, b) for a, b in zip(fast(**inputs, return_dict=False), expected, strict=True)
        )


def test_cfg_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="names no batched inputs"):
        from omni_accel.models.minimax_h3 import MINIMAX_H3
        from omni_accel.parallel.parallelize import check_parallel

        class _State:
            config = ParallelConfig(cfg=2)

        check_parallel(random_minimax_h3_transformer(), MINIMAX_H3.parallel, _State())


_CACHE_ON = 1 << 28  # MiniMax-H3's cache is off unless a budget is given (it does not pay there)


def _cache(holder):
    return omni_accel.describe(holder).components[0].cache


def test_refined_prompt_is_reused_and_invalidated_exactly():
    """The text refiner's output (a cache site of its own) and the AdaLN tables: reused when a call repeats
    the prompt and the timesteps, recomputed after any change to what they depend on."""
    plain, fast = random_minimax_h3_transformer(), random_minimax_h3_transformer()
    holder = omni_accel.accelerate(_Holder(fast), projection_cache_bytes=_CACHE_ON)
    cache = _cache(holder)
    inputs = minimax_inputs(plain)
    sites = 1 + len(fast.transformer_blocks)  # the refiner, each block's AdaLN table

    def check(**changed):
        call = {**inputs, **changed}
        with torch.no_grad():
            expected, got = plain(**call, return_dict=False), fast(**call, return_dict=False)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))

    check()
    assert (cache.hits, cache.misses) == (0, sites)
    check()  # cold -> warm: bitwise the same, every site reused
    assert (cache.hits, cache.misses) == (sites, sites)
    check(hidden_states=inputs["hidden_states"] + 1)  # new latents, same prompt and timesteps
    assert cache.hits == 2 * sites
    check(timestep=torch.tensor([0.0, 0.4]))  # another step: new tables, the refined prompt reused
    assert (cache.hits, cache.misses) == (2 * sites + 1, 2 * sites - 1)
    check(encoder_hidden_states=inputs["encoder_hidden_states"] * 2)  # another prompt: refined anew
    assert cache.misses == 2 * sites
    for module in (plain, fast):  # an in-place edit of a refiner weight
        with torch.no_grad():
            module.token_refiner.refiner_blocks[0].ff.net[2].weight.mul_(1.5)
    misses = cache.misses
    check()
    assert cache.misses == misses + 1
    lora = random_lora(plain, ["token_refiner.refiner_blocks.0.attn.to_v"], seed=5)
    for module in (plain, fast):
        module.load_lora_adapter(lora, adapter_name="r", prefix="transformer")
    check()
    assert cache.misses == misses + 2
    handle = fast.token_refiner.register_forward_hook(lambda module, args, out: out * 2)
    plain_handle = plain.token_refiner.register_forward_hook(lambda module, args, out: out * 2)
    bypasses = cache.bypasses
    check()  # a hook on the site: its forward runs, the hook sees a fresh output
    assert cache.bypasses == bypasses + 1
    handle.remove(), plain_handle.remove()
    omni_accel.restore(holder)
    assert "forward" not in vars(fast.token_refiner)  # the site's wrapper is gone with restore


@pytest.mark.multirank
def test_a_miss_on_one_rank_is_every_ranks_under_tp():
    """Under tp the AdaLN tables come from one all-gather per forward and the refiner's blocks are split:
    a rank that hits while another misses would skip the other's collective. The ranks decide each hit
    together, so a cache emptied on one rank has both compute; outputs stay those of one rank."""
    run_multirank(_rank_local_miss_body, 2, timeout=300)


def _rank_local_miss_body(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    plain = random_minimax_h3_transformer()
    inputs = minimax_inputs(plain)
    with torch.no_grad():
        expected = plain(**inputs, return_dict=False)
    fast = random_minimax_h3_transformer()
    holder = omni_accel.accelerate(
        _Holder(fast), parallel=ParallelConfig(tp=2), projection_cache_bytes=_CACHE_ON
    )
    cache = _cache(holder)
    with torch.no_grad():
        for call in range(3):
            if call == 2 and rank == 0:
                cache.clear()  # rank 0 alone forgets: its next call misses everywhere
            got = fast(**inputs, return_dict=False)
            assert all(rel_err(a, b) <= 1e-5 for a, b in zip(got, expected, strict=True))
            for tensor in got:
                replicas = [torch.empty_like(tensor) for _ in range(world)]
                dist.all_gather(replicas, tensor)
                assert all(torch.equal(r, replicas[0]) for r in replicas)
    sites = 1 + len(fast.transformer_blocks)
    # call 1 misses, call 2 hits, call 3 misses on rank 0 and so (agreed) on rank 1 too, whose entries hold
    assert (cache.hits, cache.misses) == (sites, 2 * sites), cache.stats()
