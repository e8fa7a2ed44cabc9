import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
    model = FluxTransformer2DModel(**config).eval()
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
