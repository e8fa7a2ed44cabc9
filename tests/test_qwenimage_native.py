"""Qwen-Image on the native-model test contract: text padding as a key mask, several images per sample
(the Edit pipelines' tokens concatenated), Edit-2511's per-token modulation, and the pipelines that use
the class."""

import pytest
import torch
from conftest import first_counts_meet, random_lora, random_qwenimage_transformer, rel_err
from native_contract import NativeContract

import omni_accel
from omni_accel import ParallelConfig


def qwen_inputs(module, batch=2, side=4, text=5, padded=2, images=1, controlnet=0, seed=1):
    """``images`` latents of ``side`` x ``side`` patches per sample (an Edit pipeline's target and
    references), a text of ``text`` tokens whose last ``padded`` are padding in the second sample, and
    ``controlnet`` ControlNet residuals (added after the blocks, as QwenImageControlNetPipeline passes)."""
    cfg = module.config
    g = torch.Generator().manual_seed(seed)
    tokens = images * side * side
    mask = None
    if padded:
        mask = torch.ones(batch, text, dtype=torch.bool)
        mask[-1, text - padded :] = False
    residuals = {}
    if controlnet:
        width = cfg.num_attention_heads * cfg.attention_head_dim
        samples = [torch.randn(batch, tokens, width, generator=g) for _ in range(controlnet)]
        residuals["controlnet_block_samples"] = samples
    return dict(
        **residuals,
        hidden_states=torch.randn(batch, tokens, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text, cfg.joint_attention_dim, generator=g),
        encoder_hidden_states_mask=mask,
        timestep=torch.rand(batch, generator=g),
        img_shapes=[[(1, side, side)] * images] * batch,
    )


class TestQwenImageContract(NativeContract):
    cases = [
        ({}, dict(batch=2, side=4, text=5, padded=2)),
        ({}, dict(batch=2, side=4, text=6, padded=0)),  # no mask: the pipelines drop an all-true one
        ({"num_attention_heads": 3}, dict(batch=1, side=2, text=7, padded=3, images=3)),  # Edit Plus
        ({"zero_cond_t": True}, dict(batch=2, side=2, text=5, padded=2, images=3)),  # Edit-2511
        ({}, dict(batch=2, side=4, text=5, padded=2, controlnet=1)),
    ]
    layouts = [
        (ParallelConfig(cfg=2), {}, None),
        (ParallelConfig(tp=2), {}, None),
        (ParallelConfig(tp=2), {"num_attention_heads": 4}, dict(batch=1, side=3, text=5, padded=2, images=2)),
        (ParallelConfig(cfg=2), {"zero_cond_t": True}, dict(batch=2, side=2, text=5, padded=2, images=2)),
        # per-token modulation with the rows split over the TP ranks (odd: 9 + 2 x 4 image tokens)
        (ParallelConfig(tp=2), {"zero_cond_t": True}, dict(batch=1, side=3, text=5, padded=2, images=2)),
        # the text mask travels with its keys; 5 text tokens: split unevenly
        (ParallelConfig(ulysses=2), {}, dict(batch=2, side=4, text=5, padded=2)),
        (ParallelConfig(ring=2), {}, dict(batch=2, side=4, text=5, padded=2)),
        (ParallelConfig(ring=2), {}, dict(batch=2, side=4, text=6, padded=0)),
        (ParallelConfig(ulysses=2), {"zero_cond_t": True}, dict(batch=1, side=3, text=5, padded=2, images=2)),
        (
            ParallelConfig(ring=2),
            {},
            dict(batch=2, side=3, text=5, padded=2, controlnet=2),
        ),  # 9 tokens: uneven
    ]

    make_module = staticmethod(random_qwenimage_transformer)
    make_inputs = staticmethod(qwen_inputs)


def _images(pipe, **call):
    call = {"prompt": "a cat", "num_inference_steps": 2, "output_type": "latent", **call}
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images


@pytest.mark.parametrize(
    "call",
    [
        {},
        {"prompt": ["a cat", "a much longer prompt about a dog"]},  # padded text in one sample
        {"negative_prompt": "a dog", "true_cfg_scale": 4.0},
    ],
    ids=["plain", "padded", "true_cfg"],
)
def test_tiny_qwenimage_pipeline_native_matches_diffusers(call):
    plain = omni_accel.tiny_qwenimage_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_qwenimage_pipeline(seed=0))
    component = omni_accel.describe(fast).components[0]
    assert component.mode == "native"
    # the padded keys are dropped (an unmasked kernel over the kept ones): the same to fp32 rounding
    assert rel_err(_images(fast, **call), _images(plain, **call)) <= 1e-6
    assert component.runtime.fallbacks == {}


def test_qwenimage_lora_and_restore():
    plain = omni_accel.tiny_qwenimage_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_qwenimage_pipeline(seed=0))
    lora = random_lora(plain.transformer, ["to_q", "add_v_proj", "img_mlp.net.2"], seed=3)
    for pipe in (plain, fast):
        pipe.load_lora_weights(lora, adapter_name="a")
    assert rel_err(_images(fast), _images(plain)) <= 1e-6
    assert omni_accel.describe(fast).components[0].runtime.fallbacks == {}
    omni_accel.restore(fast)
    assert torch.equal(_images(fast), _images(plain))


def test_per_token_modulation_of_edit_2511_is_native():
    """Qwen-Image-Edit-2511's ``zero_cond_t``: the reference images' tokens take the modulation of a zero
    timestep, the target's the step's own: native, per token, and what Diffusers computes."""
    plain = random_qwenimage_transformer(zero_cond_t=True)
    fast = random_qwenimage_transformer(zero_cond_t=True)
    pipe = omni_accel.accelerate(_holder(fast))
    inputs = qwen_inputs(plain, images=2)
    with torch.no_grad():
        expected = plain(**inputs, return_dict=False)[0]
        got = fast(**inputs, return_dict=False)[0]
    assert rel_err(got, expected) <= 1e-6  # the padded keys dropped: fp32 rounding
    assert omni_accel.describe(pipe).components[0].runtime.fallbacks == {}


def _holder(transformer):
    from native_contract import _Holder

    return _Holder(transformer)


def test_img2img_and_inpaint_pipelines_share_the_native_transformer():
    """The other pipelines of the class, made with ``from_pipe`` from an accelerated one, run its native
    blocks and compute what plain Diffusers' siblings compute."""
    from diffusers import QwenImageImg2ImgPipeline, QwenImageInpaintPipeline

    plain = omni_accel.tiny_qwenimage_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_qwenimage_pipeline(seed=0))
    g = torch.Generator().manual_seed(2)
    image = torch.rand(1, 3, 32, 32, generator=g)
    mask = (torch.rand(1, 1, 32, 32, generator=g) > 0.5).float()
    calls = [
        (QwenImageImg2ImgPipeline, dict(image=image, strength=0.9)),
        (QwenImageInpaintPipeline, dict(image=image, mask_image=mask, strength=0.9)),
    ]
    for cls, extra in calls:
        got = _images(omni_accel.accelerate(cls.from_pipe(fast)), height=32, width=32, **extra)
        expected = _images(cls.from_pipe(plain), height=32, width=32, **extra)
        assert rel_err(got, expected) <= 1e-6, cls.__name__
    assert omni_accel.describe(fast).components[0].runtime.fallbacks == {}


@pytest.mark.parametrize("kind", ["first_block", "taylorseer"])
def test_diffusers_step_caches_on_native_qwenimage(kind):
    """A step cache decides and computes as on Diffusers' blocks, which stay native: FirstBlockCache hooks
    whole blocks, TaylorSeer the attention modules (the math runs its hooks around their part)."""
    from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig

    configs = {
        "first_block": lambda: FirstBlockCacheConfig(threshold=0.3),
        "taylorseer": lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
    }
    plain = omni_accel.tiny_qwenimage_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_qwenimage_pipeline(seed=0))
    for pipe in (plain, fast):
        pipe.transformer.enable_cache(configs[kind]())
    call = dict(prompt=["a cat", "a much longer prompt about a dog"], num_inference_steps=4)
    assert rel_err(_images(fast, **call), _images(plain, **call)) <= 1e-6
    fallbacks = omni_accel.describe(fast).components[0].runtime.fallbacks
    assert fallbacks == {}, fallbacks


def test_inference_mode_with_a_padded_prompt():
    """Under ``torch.inference_mode()`` tensors keep no version counter: the per-forward tables and the key
    mask are kept for one forward, and the images are plain Diffusers'."""
    plain = omni_accel.tiny_qwenimage_pipeline(seed=0)
    fast = omni_accel.accelerate(omni_accel.tiny_qwenimage_pipeline(seed=0))
    call = dict(prompt=["a cat", "a much longer prompt about a dog"])
    with torch.inference_mode():
        assert rel_err(_images(fast, **call), _images(plain, **call)) <= 1e-6


def test_a_mask_written_in_place_under_inference_mode_is_read_again():
    """An inference tensor's in-place write leaves no trace: a key mask the caller edits between two calls
    of the transformer is read afresh (it was the first call's, 6e-2 off, before)."""
    plain = random_qwenimage_transformer(seed=0)
    fast = omni_accel.accelerate(_holder(random_qwenimage_transformer(seed=0))).transformer
    generator = torch.Generator().manual_seed(11)
    config, batch, text = plain.config, 2, 10
    inputs = dict(
        hidden_states=torch.randn(batch, 16, config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, text, config.joint_attention_dim, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        img_shapes=[[(1, 4, 4)]] * batch,
        return_dict=False,
    )
    with torch.inference_mode():
        mask = torch.ones(batch, text, dtype=torch.bool)
        mask[0, 6:] = False
        for _ in range(2):  # the second call reads the mask the first one kept
            got = fast(**inputs, encoder_hidden_states_mask=mask)[0]
        assert rel_err(got, plain(**inputs, encoder_hidden_states_mask=mask)[0]) <= 1e-6
        mask[1, 3:] = False
        got = fast(**inputs, encoder_hidden_states_mask=mask)[0]
        assert rel_err(got, plain(**inputs, encoder_hidden_states_mask=mask)[0]) <= 1e-6


def test_the_blocks_memos_hold_nothing_of_a_forward_that_ended(monkeypatch):
    """The joint RoPE tables and key mask every block of a forward shares (class attributes, per thread)
    are let go of when the forward's tensors die: they pin no device memory after ``pipe.to("cpu")``, and
    nothing of a pipeline the user dropped."""
    import gc
    import weakref

    from omni_accel.models.qwenimage import NativeQwenImageTransformerBlock as Block

    made = []
    for memo in (Block._ropes, Block._masks):
        get = memo.get

        def spy(key, extra, make, get=get):
            value = get(key, extra, make)
            made.extend(weakref.ref(t) for t in torch.utils._pytree.tree_leaves(value))
            return value

        monkeypatch.setattr(memo, "get", spy)
    module = random_qwenimage_transformer()
    omni_accel.accelerate(_holder(module))
    with torch.no_grad():
        module(**qwen_inputs(module), return_dict=False)
    gc.collect()
    assert len(made) > 2  # the RoPE tables and the mask, at every block
    assert all(ref() is None for ref in made)


def test_the_blocks_memos_let_go_at_moves_and_restore():
    """What a memo made of tensors a caller still holds (each thread its own) is let go of when the
    transformer moves or is restored; a value is kept while its keys live, even as older keys die."""
    import gc
    import threading
    import weakref

    from omni_accel.models.qwenimage import NativeQwenImageTransformerBlock as Block

    module = random_qwenimage_transformer()
    pipe = omni_accel.accelerate(_holder(module))
    memo = Block._ropes
    keys = [torch.ones(2), torch.ones(2)]
    values = []

    def fill() -> None:
        for key in keys:
            value = torch.zeros(3)
            assert memo.get((key,), None, lambda value=value: value) is value
            values.append(weakref.ref(value))

    for move in (lambda: module.to(torch.float64), lambda: omni_accel.restore(pipe)):
        values.clear()
        fill()
        thread = threading.Thread(target=fill)
        thread.start()
        thread.join()
        gc.collect()
        assert [ref() is None for ref in values] == [True, False, True, True]  # the thread's died with it
        del keys[0]  # an older state's key dies: the newer value stays
        gc.collect()
        assert values[1]() is not None
        assert memo.get((keys[-1],), None, lambda: torch.ones(3)) is values[1]()
        move()
        gc.collect()
        assert values[1]() is None
        keys.insert(0, torch.ones(2))


def test_blocks_falling_back_in_two_threads_at_once_are_all_counted_and_logged_once(monkeypatch):
    """Two threads whose blocks run Diffusers' forward for a reason not counted before (an attention
    argument only Diffusers' processor takes), at the same time: every call is counted, the reason logged
    once."""
    import threading

    from omni_accel.models import base

    module = random_qwenimage_transformer()
    pipe = omni_accel.accelerate(_holder(module))
    fallbacks = omni_accel.describe(pipe).components[0].runtime.fallbacks
    warned = []
    monkeypatch.setattr(base.logger, "warning", lambda *args: warned.append(args))
    first_counts_meet(monkeypatch, fallbacks)
    inputs = qwen_inputs(module)

    def call() -> None:
        with torch.no_grad():
            module(**inputs, attention_kwargs={"attention_mask": None})

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(fallbacks.values()) == 2 * len(module.transformer_blocks)
    assert len(warned) == 1
