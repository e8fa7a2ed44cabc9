"""Key-padding masks served by dropping the padded keys: the same attention as the dense mask."""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from diffusers import DiffusionPipeline, HunyuanVideoTransformer3DModel

import omni_accel
from omni_accel.attention import key_padding, routing
from omni_accel.attention.key_padding import attend_kept, kept_keys
from omni_accel.attention.selection import AttentionSelector


def _bshd(batch=2, tokens=9, heads=2, head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, tokens, heads, head_dim, generator=g) for _ in range(3)]


def _dense(q, k, v, mask):
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    return out.transpose(1, 2)


def _unmasked(q, k, v):
    return _dense(q, k, v, None)


def _kept(mask, batch=2, kv_len=9):
    """``kept_keys`` as a model passing one mask to every block meets it: read when it comes back."""
    assert kept_keys(mask, batch, kv_len) is None  # the first sighting runs the dense mask
    return kept_keys(mask, batch, kv_len)


def test_dropped_keys_give_the_dense_masks_attention():
    q, k, v = _bshd()
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., 3:5] = False  # padded text in the middle of the joint sequence
    mask[1, ..., 0] = False
    kept = _kept(mask)
    assert [t.tolist() for t in kept.per_sample] == [[0, 1, 2, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]]
    got = attend_kept(q, k, v, kept, _unmasked)
    assert rel_err(got, _dense(q, k, v, mask)) <= 1e-6

    one_mask_for_the_batch = mask[:1]
    kept = _kept(one_mask_for_the_batch)
    calls = []
    got = attend_kept(q, k, v, kept, lambda *args: calls.append(args) or _unmasked(*args))
    assert rel_err(got, _dense(q, k, v, one_mask_for_the_batch)) <= 1e-6
    assert len(calls) == 1 and calls[0][1].shape[:2] == (2, 7)  # the whole batch over the 7 kept keys

    mixed = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mixed[1, ..., 7:] = False  # the first sample keeps every key
    kept = _kept(mixed)
    assert kept.per_sample[0] is None and not kept.all_kept
    assert rel_err(attend_kept(q, k, v, kept, _unmasked), _dense(q, k, v, mixed)) <= 1e-6


def test_a_mask_keeping_every_key_is_dropped_whole():
    q, k, v = _bshd()
    calls = []
    kept = _kept(torch.ones(1, 1, 1, 9, dtype=torch.bool))
    assert kept.all_kept
    attend_kept(q, k, v, kept, lambda *args: calls.append(args) or _unmasked(*args))
    assert len(calls) == 1 and calls[0][1].shape[0] == 2  # one call for the whole batch


@pytest.mark.parametrize(
    "mask",
    [
        torch.ones(1, 1, 9, 9, dtype=torch.bool),  # differs per query
        torch.ones(1, 2, 1, 9, dtype=torch.bool),  # differs per head
        torch.zeros(1, 1, 1, 9),  # additive float mask
        torch.ones(1, 9, dtype=torch.bool),  # 2-D: broadcast over queries, not samples
        torch.ones(3, 1, 1, 9, dtype=torch.bool),  # batch of 3 for 2 samples
    ],
)
def test_other_masks_keep_the_dense_path(mask):
    assert kept_keys(mask, batch=2, kv_len=9) is None
    assert kept_keys(mask, batch=2, kv_len=9) is None


def test_a_sample_without_keys_keeps_the_dense_path():
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1] = False
    assert _kept(mask) is None


def test_a_mask_is_read_when_it_comes_back_and_once(monkeypatch):
    reads = []
    read = key_padding._read
    monkeypatch.setattr(key_padding, "_read", lambda rows: reads.append(rows) or read(rows))
    mask = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    mask[..., 2] = False
    assert kept_keys(mask, batch=1, kv_len=9) is None and not reads  # seen once: no host read
    first = kept_keys(mask, batch=1, kv_len=9)
    assert first.per_sample[0].tolist() == [0, 1, 3, 4, 5, 6, 7, 8] and len(reads) == 1
    assert kept_keys(mask, batch=1, kv_len=9).per_sample[0] is first.per_sample[0] and len(reads) == 1
    mask[..., 3] = False  # in place: a new version, seen for the first time
    assert kept_keys(mask, batch=1, kv_len=9) is None
    assert kept_keys(mask, batch=1, kv_len=9).per_sample[0].tolist() == [0, 1, 4, 5, 6, 7, 8]
    assert len(reads) == 2
    assert kept_keys(mask.clone(), batch=1, kv_len=9) is None and len(reads) == 2  # another tensor


def test_routed_attention_drops_the_keys_of_a_mask_passed_to_every_block():
    """What a model building its mask once per forward meets: every call after the first drops the padded
    keys, and every output is the dense mask's."""
    q, k, v = _bshd()
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., 3:5] = False
    selector = AttentionSelector()
    token = routing.enter_selector(selector)
    try:
        for _ in range(3):
            got = routing.route(q, k, v, attn_mask=mask, scale=None, unsupported=None)
            assert rel_err(got, _dense(q, k, v, mask)) <= 1e-6
    finally:
        routing.leave_selector(token)
    assert selector.served_without_mask == {"diffusers.attention": 2}


def test_routed_qwenimage_with_padded_prompts_matches_diffusers(monkeypatch):
    """Two prompts of different lengths: the shorter one's text is padded, and every joint attention call
    carries a key-padding mask, a new one in every block: each runs with the dense mask, no host read."""
    call = dict(
        prompt=["a cat", "a photograph of a very small cat sitting on a wooden table"],
        height=32,
        width=32,
        num_inference_steps=2,
        output_type="latent",
    )
    pipe = omni_accel.tiny_qwenimage_pipeline(seed=0)
    expected = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    omni_accel.accelerate(pipe, native=False)  # the routed path: Diffusers builds a new mask per block
    monkeypatch.setattr(key_padding, "_read", lambda rows: pytest.fail("a mask seen once was read"))
    got = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    assert rel_err(got, expected) <= 1e-5
    component = omni_accel.describe(pipe).components[0]
    assert [request for _, request, *_ in component.selector.decisions()] == [
        "float32, cpu, head_dim=16, masked"
    ]
    omni_accel.restore(pipe)


@pytest.mark.gpu
def test_dropped_keys_on_the_gpu_are_as_accurate_as_the_dense_mask():
    """bf16 on CUDA: the unmasked kernel over the kept keys is no farther from a float32 reference than
    the dense mask's kernel (PyTorch's dispatch, what Diffusers runs)."""
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, 700, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)
    )
    mask = torch.ones(1, 1, 1, 700, dtype=torch.bool, device="cuda")
    mask[..., 100:180] = False
    reference = _dense(q.float(), k.float(), v.float(), mask)
    dense = _dense(q, k, v, mask)
    selector = AttentionSelector()
    token = routing.enter_selector(selector)
    try:
        outputs = [routing.route(q, k, v, attn_mask=mask, scale=None, unsupported=None) for _ in range(2)]
    finally:
        routing.leave_selector(token)
    assert torch.equal(outputs[0], dense)  # the first sighting: the dense mask, through the same dispatch
    assert selector.served_without_mask == {"diffusers.attention": 1}
    dense_err = (dense.float() - reference).abs().max().item()
    assert (outputs[1].float() - reference).abs().max().item() <= 2 * dense_err


class _Holder(DiffusionPipeline):
    def __init__(self, transformer) -> None:
        super().__init__()
        self.register_modules(transformer=transformer)


def test_routed_hunyuan_video_drops_the_padded_keys_of_its_per_forward_mask():
    """HunyuanVideo (routed generically: its module calls ``dispatch_attention_fn``) builds one
    ``[B, 1, 1, N]`` mask per forward and passes it to every block: from the second block on the padded text
    keys are dropped, and the output is Diffusers' with the dense mask."""
    config = dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(4, 6, 6),
    )  # fmt: skip
    torch.manual_seed(0)
    plain = HunyuanVideoTransformer3DModel(**config).eval()
    routed = HunyuanVideoTransformer3DModel(**config).eval()
    routed.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    text_mask = torch.ones(2, 7, dtype=torch.long)
    text_mask[0, 4:] = 0  # the first prompt is shorter: 3 padded text tokens
    inputs = dict(
        hidden_states=torch.randn(2, 4, 1, 8, 8, generator=g),
        timestep=torch.tensor([500.0, 500.0]),
        encoder_hidden_states=torch.randn(2, 7, 16, generator=g),
        encoder_attention_mask=text_mask,
        pooled_projections=torch.randn(2, 8, generator=g),
        guidance=torch.tensor([3500.0, 3500.0]),
        return_dict=False,
    )
    with torch.no_grad():
        expected = plain(**inputs)[0]
        pipe = omni_accel.accelerate(_Holder(routed))
        got = pipe.transformer(**inputs)[0]
    assert rel_err(got, expected) <= 1e-5
    calls = omni_accel.describe(pipe).components[0].selector.served_without_mask
    assert calls == {"generic.attn": 3}, calls  # 4 blocks: the first with the dense mask, then dropped
    omni_accel.restore(pipe)


def _tiny_hunyuan_video15(layers: int = 3):
    from diffusers import HunyuanVideo15Transformer3DModel

    config = dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=layers,
        num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=16, image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
    )  # fmt: skip
    torch.manual_seed(0)
    plain = HunyuanVideo15Transformer3DModel(**config).eval()
    accelerated = HunyuanVideo15Transformer3DModel(**config).eval()
    accelerated.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    text_mask = torch.ones(2, 7, dtype=torch.long)
    text_mask[0, 4:] = 0  # the first prompt is shorter: 3 padded text tokens
    glyph_mask = torch.zeros(2, 3, dtype=torch.long)
    glyph_mask[1, :2] = 1  # glyph text in the second sample only
    inputs = dict(
        hidden_states=torch.randn(2, 4, 2, 8, 8, generator=g),
        timestep=torch.tensor([500.0, 500.0]),
        encoder_hidden_states=torch.randn(2, 7, 16, generator=g),
        encoder_attention_mask=text_mask,
        encoder_hidden_states_2=torch.randn(2, 3, 16, generator=g),
        encoder_attention_mask_2=glyph_mask,
        image_embeds=torch.zeros(2, 4, 16),  # text-to-video: the image tokens are masked out
        return_dict=False,
    )
    return plain, accelerated, inputs


def _block_outputs(model) -> list:
    seen = []
    for block in model.transformer_blocks:
        block.register_forward_hook(lambda module, args, out: seen.append([t.clone() for t in out]))
    return seen


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_hunyuan_video15_attends_over_a_key_mask_and_drops_its_padded_keys(compiled):
    """HunyuanVideo 1.5's processor expands the text padding into a dense [S, S] mask in every block; ours
    passes the key mask built once per forward, so from the second block on the padded keys are dropped.
    Every block's outputs (the padded text rows included: zero attention, as under the dense mask) and the
    model's equal Diffusers'; ``restore`` gives back Diffusers' processors and leaves no hook."""
    torch._dynamo.reset()
    plain, accelerated, inputs = _tiny_hunyuan_video15()
    expected_blocks, got_blocks = _block_outputs(plain), _block_outputs(accelerated)
    compile = {"backend": "eager"} if compiled else False
    with torch.no_grad():
        expected = plain(**inputs)[0]
        pipe = omni_accel.accelerate(_Holder(accelerated), compile=compile, compile_in_background=False)
        got = pipe.transformer(**inputs)[0]
    assert rel_err(got, expected) <= 1e-5
    assert len(got_blocks) == len(expected_blocks) == 3
    for ours, theirs in zip(got_blocks, expected_blocks, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert rel_err(a, b) <= 1e-5
    component = omni_accel.describe(pipe).components[0]
    assert component.selector.served_without_mask == {"generic.attn": 2}  # 3 blocks: the first dense
    assert "3 transformer blocks attend over a key mask built once per forward" in str(
        omni_accel.describe(pipe)
    )
    if compiled:
        assert component.runtime.compiler.summary(), "the blocks compiled"
        assert not component.runtime.fallbacks
    omni_accel.restore(pipe)
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    for block in accelerated.transformer_blocks:
        assert type(block.attn.processor) is HunyuanVideo15AttnProcessor2_0
        assert not block._forward_pre_hooks
    got_blocks.clear()
    with torch.no_grad():
        assert torch.equal(accelerated(**inputs)[0], expected)  # Diffusers' own code again, bitwise


def test_a_hunyuan_video15_key_mask_follows_a_users_attention_backend_and_deepcopy():
    """A Diffusers backend the user sets on the model reaches our processors (and runs Diffusers' own
    attention, as it would); a deep copy of the accelerated pipeline runs on its own masks."""
    import copy

    plain, accelerated, inputs = _tiny_hunyuan_video15(layers=2)
    with torch.no_grad():
        expected = plain(**inputs)[0]
        pipe = omni_accel.accelerate(_Holder(accelerated), compile=False)
        twin = copy.deepcopy(pipe)
        assert rel_err(twin.transformer(**inputs)[0], expected) <= 1e-5
        assert omni_accel.describe(twin).components[0].selector.served_without_mask == {"generic.attn": 1}
        pipe.transformer.set_attention_backend("native")
        assert rel_err(pipe.transformer(**inputs)[0], expected) <= 1e-5
    unrouted = omni_accel.describe(pipe).components[0].selector.unrouted
    assert unrouted, "a backend set on the processors runs Diffusers' attention"


def test_a_backend_set_or_reset_on_hunyuan_video15_while_accelerated_survives_restore():
    """``restore`` gives the blocks Diffusers' processors back with the backend the user set (or reset) on
    the model while it was accelerated, as plain Diffusers would have it."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    _, accelerated, _ = _tiny_hunyuan_video15(layers=1)
    accelerated.set_attention_backend("native")
    pipe = omni_accel.accelerate(_Holder(accelerated), compile=False)
    accelerated.reset_attention_backend()
    omni_accel.restore(pipe)
    processor = accelerated.transformer_blocks[0].attn.processor
    assert type(processor) is HunyuanVideo15AttnProcessor2_0 and processor._attention_backend is None
    pipe = omni_accel.accelerate(_Holder(accelerated), compile=False)
    accelerated.set_attention_backend("_native_math")
    omni_accel.restore(pipe)
    processor = accelerated.transformer_blocks[0].attn.processor
    assert type(processor) is HunyuanVideo15AttnProcessor2_0
    assert processor._attention_backend == "_native_math"


def test_the_hunyuan_video15_mask_hook_is_not_a_users_hook():
    """The pre-hook giving every block the same key mask changes no value a hook could observe, so CUDA
    graphs and the compiled blocks do not treat the blocks as hooked."""
    from omni_accel.forward_hooks import is_hooked

    _, accelerated, _ = _tiny_hunyuan_video15(layers=1)
    pipe = omni_accel.accelerate(_Holder(accelerated), compile=False)
    block = accelerated.transformer_blocks[0]
    assert block._forward_pre_hooks and not is_hooked(block)
    block.register_forward_pre_hook(lambda module, args: None)
    assert is_hooked(block)
    omni_accel.restore(pipe)


def test_hunyuan_video15_key_mask_beside_lora_and_a_step_cache():
    """A LoRA on the joint attention's projections behaves on the adapted blocks as on Diffusers' own, and
    a step cache Diffusers' hooks cannot take on this model (FirstBlockCache: its block class is not
    registered in 0.42) is refused with the very error plain Diffusers gives."""
    from diffusers.hooks import FirstBlockCacheConfig
    from peft import LoraConfig

    plain, accelerated, inputs = _tiny_hunyuan_video15()
    pipe = omni_accel.accelerate(_Holder(accelerated), compile=False)
    errors = []
    for model in (plain, accelerated):
        torch.manual_seed(4)
        config = LoraConfig(r=2, target_modules=["to_q", "add_k_proj", "to_add_out"], init_lora_weights=False)
        model.add_adapter(config, "style")
        try:
            model.enable_cache(FirstBlockCacheConfig(threshold=0.5))
        except ValueError as error:
            errors.append(str(error))
    assert len(errors) in (0, 2) and len(set(errors)) <= 1, errors
    with torch.no_grad():
        for step in range(3):
            timestep = torch.tensor([900.0 - 100 * step] * 2)
            expected = plain(**{**inputs, "timestep": timestep})[0]
            got = accelerated(**{**inputs, "timestep": timestep})[0]
            assert rel_err(got, expected) <= 1e-5, step
    assert omni_accel.describe(pipe).components[0].selector.served_without_mask == {"generic.attn": 6}
    omni_accel.restore(pipe)
