import collections
import contextlib
import threading

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def first_counts_meet(monkeypatch, counts: collections.Counter) -> None:
    """A first count in ``counts`` waits for another thread's first count (``Counter``'s ``counts[r] += 1``
    runs ``__missing__`` there) before it stores: two threads count a new reason at the same time."""
    barrier = threading.Barrier(2, timeout=2)
    missing = collections.Counter.__missing__

    def meeting(self, key):
        if self is counts:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait()
        return missing(self, key)

    monkeypatch.setattr(collections.Counter, "__missing__", meeting)


def random_flux_transformer(seed: int = 0, **overrides):
    """A small Diffusers FLUX transformer whose every weight is random (none left at a zero init)."""
    from diffusers import FluxTransformer2DModel

    config = dict(
        patch_size=1,
        in_channels=8,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=24,
        pooled_projection_dim=12,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return randomized(FluxTransformer2DModel(**config).eval())


_WAN_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=24,
    freq_dim=32,
    ffn_dim=48,
    num_layers=2,
    cross_attn_norm=False,
    rope_max_seq_len=64,
)


def random_wan_transformer(seed: int = 0, **overrides):
    """A small Diffusers Wan transformer whose every weight is random (none left at a zero init)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return randomized(WanTransformer3DModel(**{**_WAN_CONFIG, **overrides}).eval())


def random_wan_vace_transformer(seed: int = 0, **overrides):
    """A small Diffusers Wan VACE transformer (control blocks at layers 0 and 2 of 3), every weight random."""
    from diffusers import WanVACETransformer3DModel

    vace = dict(num_layers=3, cross_attn_norm=True, vace_layers=[0, 2], vace_in_channels=6)
    torch.manual_seed(seed)
    return randomized(WanVACETransformer3DModel(**{**_WAN_CONFIG, **vace, **overrides}).eval())


def random_qwenimage_transformer(seed: int = 0, **overrides):
    """A small Diffusers Qwen-Image transformer whose every weight is random (none left at a zero init)."""
    from diffusers import QwenImageTransformer2DModel

    config = dict(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(seed)
    return randomized(QwenImageTransformer2DModel(**{**config, **overrides}).eval())


def random_flux2_transformer(seed: int = 0, **overrides):
    """A small Diffusers FLUX.2 transformer whose every weight is random."""
    from diffusers import Flux2Transformer2DModel

    config = dict(
        in_channels=8,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=24,
        timestep_guidance_channels=16,
        mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4),
    )
    torch.manual_seed(seed)
    return randomized(Flux2Transformer2DModel(**{**config, **overrides}).eval())


def random_zimage_transformer(seed: int = 0, **overrides):
    """A small Diffusers Z-Image transformer whose every weight is random (the pad tokens too)."""
    from diffusers import ZImageTransformer2DModel

    config = dict(
        in_channels=4,
        dim=48,  # its MLP is int(dim / 3 * 8) wide: 128, which tp=2 divides
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=24,
        axes_dims=[8, 8, 8],
        axes_lens=[256, 32, 32],
    )
    torch.manual_seed(seed)
    return randomized(ZImageTransformer2DModel(**{**config, **overrides}).eval())


def random_minimax_h3_transformer(seed: int = 0, **overrides):
    """A small Diffusers MiniMax-H3 transformer whose every weight is random."""
    from diffusers import MiniMaxH3Transformer3DModel

    config = dict(
        num_attention_heads=2,
        attention_head_dim=32,
        hidden_size=48,
        num_layers=2,
        num_refiner_layers=1,
        ffn_dim=64,
        in_channels=4,
        audio_in_channels=6,
        text_dim=24,
        freq_dim=32,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=4,  # 24 of the 32 channels of each head rotated
    )
    torch.manual_seed(seed)
    return randomized(MiniMaxH3Transformer3DModel(**{**config, **overrides}).eval())


def randomized(model):
    """``model`` with every parameter drawn from N(0, 0.1): no zero-initialised layer hides a path."""
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    return model


def flux_inputs(model, batch: int = 2, image_tokens: int = 12, text_tokens: int = 5, seed: int = 1):
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_tokens, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
        timestep=torch.rand(batch, generator=g),
        img_ids=torch.randint(0, 8, (image_tokens, 3), generator=g).float(),
        txt_ids=torch.zeros(text_tokens, 3),
    )
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3.5)
    return inputs


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def random_lora(transformer, targets: list[str], seed: int) -> dict:
    """A random rank-2 LoRA for ``targets`` of ``transformer`` (which it leaves untouched: the adapter is
    added to a copy), in the format a pipeline's ``load_lora_weights`` takes. Every B is nonzero, so every
    adapter changes the output."""
    import copy

    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    source = copy.deepcopy(transformer)
    source.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False), "x")
    return {f"transformer.{k}": v for k, v in get_peft_model_state_dict(source, adapter_name="x").items()}


def random_ip_adapter_state(transformer, clip_dim: int = 12) -> dict:
    """A random FLUX IP-Adapter in the layout Diffusers' loader takes (4 image tokens)."""
    g = torch.Generator().manual_seed(5)
    cfg = transformer.config
    context, inner = cfg.joint_attention_dim, transformer.inner_dim

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    image_proj = {
        "proj.weight": rand(4 * context, clip_dim),
        "proj.bias": rand(4 * context),
        "norm.weight": rand(context),
        "norm.bias": rand(context),
    }
    ip_adapter = {}
    for block in range(cfg.num_layers):
        for name in ("to_k_ip", "to_v_ip"):
            ip_adapter[f"{block}.{name}.weight"] = rand(inner, context)
            ip_adapter[f"{block}.{name}.bias"] = rand(inner)
    return {"image_proj": image_proj, "ip_adapter": ip_adapter}


@pytest.fixture(autouse=True)
def _kernels_compile_in_the_call(request, monkeypatch):
    """GPU tests check our Triton kernels, so their first launches compile in the call instead of being
    served by the references (tests/test_gpu_triton_builds.py tests that, in fresh processes)."""
    if "gpu" in request.keywords:
        from omni_accel.utils import triton_builds

        monkeypatch.setattr(triton_builds, "_knobs", lambda: None)


@pytest.fixture(autouse=True)
def _diffusers_backend_left_as_found():
    """``set_attention_backend`` on a model sets Diffusers' process-wide backend too (and
    ``reset_attention_backend`` does not undo that): a test doing it leaves the next ones as it found them."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry._active_backend = active
