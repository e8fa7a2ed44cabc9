"""The native FLUX transformer against Diffusers' on the same random weights (fp32, CPU)."""

import pytest
import torch
from conftest import flux_inputs, random_flux_transformer, rel_err

from omni_accel.models.flux_legacy import FluxTransformer
from omni_accel.weights import WeightLoadError, export_weights, load_weights


def _native(model):
    native = FluxTransformer.from_diffusers_config(dict(model.config))
    load_weights(native, model.state_dict(), native.weight_map)
    return native.eval()


@pytest.mark.parametrize(
    "overrides, shapes",
    [
        ({}, dict(batch=2, image_tokens=12, text_tokens=5)),
        ({"guidance_embeds": True}, dict(batch=1, image_tokens=7, text_tokens=3)),
        (
            {
                "num_attention_heads": 5,
                "attention_head_dim": 8,
                "axes_dims_rope": (2, 2, 4),
                "in_channels": 12,
            },
            dict(batch=3, image_tokens=9, text_tokens=11),
        ),
        (
            {"out_channels": 4, "num_layers": 1, "num_single_layers": 1},
            dict(batch=2, image_tokens=16, text_tokens=1),
        ),
    ],
)
def test_native_matches_diffusers(overrides, shapes):
    model = random_flux_transformer(**overrides)
    native = _native(model)
    inputs = flux_inputs(model, **shapes)
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)[0]
        got = native(**inputs)
    assert got.shape == expected.shape
    assert rel_err(got, expected) <= 1e-5


def test_native_matches_diffusers_with_controlnet_residuals():
    model = random_flux_transformer()
    native = _native(model)
    inputs = flux_inputs(model)
    g = torch.Generator().manual_seed(3)
    inputs["controlnet_block_samples"] = [torch.randn(2, 12, 48, generator=g)]
    inputs["controlnet_single_block_samples"] = [torch.randn(2, 12, 48, generator=g) for _ in range(2)]
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)[0]
        got = native(**inputs)
    assert rel_err(got, expected) <= 1e-5


def test_every_weight_matters():
    """Guards the parity test itself: perturbing any single native tensor must change the output."""
    model = random_flux_transformer(num_layers=1, num_single_layers=1)
    native = _native(model)
    inputs = flux_inputs(model)
    with torch.no_grad():
        base = native(**inputs)
        for name, param in native.named_parameters():
            saved = param.detach().clone()
            param.add_(0.5)
            assert not torch.equal(native(**inputs), base), f"{name} does not influence the output"
            param.copy_(saved)


def test_export_gives_back_the_exact_diffusers_tensors():
    model = random_flux_transformer(guidance_embeds=True)
    source = {k: v.clone() for k, v in model.state_dict().items()}
    native = _native(model)
    exported = export_weights(native, source, native.weight_map)
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name


def test_load_shares_storage_instead_of_copying():
    model = random_flux_transformer()
    native = _native(model)
    assert native.x_embedder.weight.data_ptr() == model.x_embedder.weight.data_ptr()


def test_strict_load_reports_missing_and_unexpected_keys():
    model = random_flux_transformer()
    state = dict(model.state_dict())
    del state["transformer_blocks.0.attn.to_k.weight"]
    state["transformer_blocks.0.attn.extra.weight"] = torch.zeros(3)
    native = FluxTransformer.from_diffusers_config(dict(model.config))
    with pytest.raises(WeightLoadError) as info:
        load_weights(native, state, native.weight_map)
    message = str(info.value)
    assert "double_blocks.0.img_qkv.weight[k]" in message
    assert "transformer_blocks.0.attn.extra.weight" in message


def test_strict_load_rejects_wrong_shapes():
    model = random_flux_transformer()
    state = dict(model.state_dict())
    state["proj_out.weight"] = torch.zeros(5, 5)
    native = FluxTransformer.from_diffusers_config(dict(model.config))
    with pytest.raises(WeightLoadError, match=r"proj_out.weight.*shape \(5, 5\)"):
        load_weights(native, state, native.weight_map)


def test_strict_load_rejects_mixed_dtypes_in_one_packed_tensor():
    model = random_flux_transformer()
    state = dict(model.state_dict())
    state["transformer_blocks.0.attn.to_v.weight"] = state["transformer_blocks.0.attn.to_v.weight"].double()
    native = FluxTransformer.from_diffusers_config(dict(model.config))
    with pytest.raises(WeightLoadError, match="to_v.weight.*float64"):
        load_weights(native, state, native.weight_map)


def test_guidance_mismatch_is_a_clear_error():
    model = random_flux_transformer(guidance_embeds=True)
    native = _native(model)
    inputs = flux_inputs(model)
    del inputs["guidance"]
    with pytest.raises(ValueError, match="pass `guidance`"):
        native(**inputs)


def test_joint_attention_kwargs_are_refused_not_ignored():
    model = random_flux_transformer()
    native = _native(model)
    with pytest.raises(NotImplementedError, match="scale"):
        native(**flux_inputs(model), joint_attention_kwargs={"scale": 0.5})
