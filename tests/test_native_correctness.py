"""Native blocks never give a different result than Diffusers without saying so: gradients, weights after
inference mode, weights edited through ``state_dict`` aliases, training mode, a user's ``torch.compile``
and what keys a replayed CUDA-graph step (fp32 on CPU, against plain Diffusers doing the same steps)."""

import copy

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import flux_inputs, random_flux_transformer, random_ip_adapter_state, rel_err
from diffusers import FluxPipeline

import omni_accel
from omni_accel.cuda_graphs import Unkeyable, step_key


def _bare(transformer) -> FluxPipeline:
    return FluxPipeline(None, None, None, None, None, None, transformer)


def _pair(**overrides):
    """A plain FLUX transformer and an accelerated twin with the same weights (3 single blocks)."""
    plain = random_flux_transformer(**overrides)
    fast = omni_accel.accelerate(_bare(random_flux_transformer(**overrides))).transformer
    return plain, fast


def _fallbacks(transformer) -> dict:
    block = transformer.single_transformer_blocks[0]
    return dict(block.omni_runtime.fallbacks)


def _input_grads(model, inputs: dict, names=("hidden_states", "encoder_hidden_states", "pooled_projections")):
    inputs = {k: v.clone().requires_grad_(k in names) for k, v in inputs.items()}
    out = model(**inputs, return_dict=False)[0]
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [inputs[name].grad for name in names]


def test_input_gradients_through_frozen_blocks_match_diffusers():
    plain, fast = _pair()
    for model in (plain, fast):
        model.requires_grad_(False)
    inputs = flux_inputs(plain)
    (expected, expected_grads), (got, grads) = _input_grads(plain, inputs), _input_grads(fast, inputs)
    assert rel_err(got, expected) <= 1e-5
    for grad, want in zip(grads, expected_grads, strict=True):
        assert rel_err(grad, want) <= 1e-5
    assert "gradients enabled for inputs that require them" in _fallbacks(fast)
    with torch.no_grad():  # without autograd the same frozen blocks run natively again
        before = sum(_fallbacks(fast).values())
        fast(**inputs)
        assert sum(_fallbacks(fast).values()) == before


@pytest.mark.parametrize("tuned", ["double blocks", "lora on double blocks"])
def test_partial_fine_tuning_gradients_match_diffusers(tuned):
    plain, fast = _pair()
    for model in (plain, fast):
        model.requires_grad_(False)
        if tuned == "double blocks":
            model.transformer_blocks.requires_grad_(True)
        else:
            from peft import LoraConfig

            torch.manual_seed(4)
            config = LoraConfig(r=2, target_modules=["to_q", "add_k_proj"], init_lora_weights=False)
            model.add_adapter(config)
            for name, param in model.named_parameters():
                param.requires_grad_("lora" in name and "transformer_blocks" in name.split(".")[0])
    inputs = flux_inputs(plain)
    for model in (plain, fast):
        out = model(**inputs, return_dict=False)[0]
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    tuned_params = [(n, p) for n, p in plain.named_parameters() if p.requires_grad]
    assert tuned_params
    fast_params = dict(fast.named_parameters())
    for name, param in tuned_params:
        assert rel_err(fast_params[name].grad, param.grad) <= 1e-5, name


def test_weights_stay_ordinary_tensors_after_a_call_in_inference_mode():
    """A LoRA step or input gradients after an inference-mode call work, accelerated and restored."""
    plain, fast = _pair()
    inputs = flux_inputs(plain)
    with torch.inference_mode():
        fast(**inputs)
    assert not any(p.is_inference() for p in fast.parameters())
    fast.requires_grad_(True)
    plain.requires_grad_(True)
    (_, expected_grads), (_, grads) = _input_grads(plain, inputs), _input_grads(fast, inputs)
    for grad, want in zip(grads, expected_grads, strict=True):
        assert rel_err(grad, want) <= 1e-5
    pipe = _bare(fast)
    omni_accel.accelerate(pipe)
    with torch.inference_mode():
        pipe.transformer(**inputs)
    omni_accel.restore(pipe)
    assert not any(p.is_inference() for p in fast.parameters())
    fast.transformer_blocks[0].attn.to_k.weight.requires_grad_(True)


def test_state_dict_aliases_see_in_place_edits_as_in_diffusers():
    """Tensors taken from ``state_dict()`` after ``accelerate`` and edited in place after the first call
    change the accelerated pipeline as they change plain Diffusers."""
    plain, fast = _pair()
    aliases = [model.state_dict() for model in (plain, fast)]
    inputs = flux_inputs(plain)
    with torch.no_grad():
        fast(**inputs)
        for state in aliases:
            state["single_transformer_blocks.1.attn.to_k.weight"].mul_(-1.5)
            state["transformer_blocks.0.attn.add_v_proj.bias"].add_(0.3)
        expected, got = plain(**inputs, return_dict=False)[0], fast(**inputs, return_dict=False)[0]
    assert rel_err(got, expected) <= 1e-5


def test_training_mode_without_active_dropout_runs_natively():
    """A transformer built from a config is in training mode; its dropouts have p = 0, so with grad off the
    native blocks serve it. A real dropout sends the block to Diffusers' forward."""
    plain, fast = _pair()
    for model in (plain, fast):
        model.train()
    inputs = flux_inputs(plain)
    with torch.no_grad():
        assert rel_err(fast(**inputs)[0], plain(**inputs)[0]) <= 1e-5
    assert not _fallbacks(fast)
    fast.single_transformer_blocks[0].attn.to_out = torch.nn.ModuleList()  # single blocks have none
    fast.transformer_blocks[1].ff.net[1] = torch.nn.Dropout(0.5)
    with torch.no_grad():
        fast(**inputs)
    assert _fallbacks(fast) == {
        "training mode with active dropout": 1,
        "attn.to_out was replaced or changed since accelerate (the native math computes what it was)": 1,
    }


def test_diffusers_compile_idioms_trace_whole_blocks():
    """Diffusers' ``compile_repeated_blocks(fullgraph=True)`` and ``torch.compile(transformer,
    fullgraph=True)`` of an accelerated transformer trace without a graph break and match plain."""
    plain, fast = _pair()
    inputs = flux_inputs(plain)
    twin = copy.deepcopy(fast)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = plain(**inputs)[0]
        fast.compile_repeated_blocks(fullgraph=True, backend="eager")
        assert rel_err(fast(**inputs)[0], expected) <= 1e-5
        compiled = torch.compile(twin, fullgraph=True, backend="eager")
        assert rel_err(compiled(**inputs)[0], expected) <= 1e-5


def _key(transformer, **inputs):
    leaves, spec = pytree.tree_flatten(((), inputs))
    return step_key(transformer, leaves, spec)


@torch.no_grad()
def test_step_key_names_an_ip_adapter_scale_and_fails_closed():
    """Everything a call can change is in the key of a replayed step: an IP-Adapter's scale (Diffusers'
    ``set_ip_adapter_scale`` edits the processor) and any attribute a user sets; an attribute whose value
    cannot be compared makes the call eager instead of replaying a graph that may be wrong."""
    pipe = omni_accel.accelerate(_bare(random_flux_transformer()), cuda_graphs=True)
    transformer = pipe.transformer
    transformer._load_ip_adapter_weights(random_ip_adapter_state(transformer), low_cpu_mem_usage=False)
    inputs = flux_inputs(transformer)
    embeds = {"ip_adapter_image_embeds": [torch.randn(2, 1, 12)]}
    pipe.set_ip_adapter_scale(0.0)
    key = _key(transformer, **inputs, joint_attention_kwargs=embeds)
    assert _key(transformer, **inputs, joint_attention_kwargs=embeds) == key, "the same call, the same key"
    pipe.set_ip_adapter_scale(42.0)
    assert _key(transformer, **inputs, joint_attention_kwargs=embeds) != key
    transformer.transformer_blocks[0].attn.heads += 0  # rewriting a value leaves the key alone
    transformer.transformer_blocks[1].attn.my_flag = 3
    key = _key(transformer, **inputs)
    transformer.transformer_blocks[1].attn.my_flag = 4
    assert _key(transformer, **inputs) != key
    transformer.transformer_blocks[1].attn.my_flag = iter(())
    with pytest.raises(Unkeyable, match="my_flag"):
        _key(transformer, **inputs)
    del transformer.transformer_blocks[1].attn.my_flag
    with pytest.raises(Unkeyable, match="argument"):
        _key(transformer, **inputs, joint_attention_kwargs={"x": object()})
    from diffusers.models.attention_dispatch import attention_backend

    key = _key(transformer, **inputs)
    with attention_backend("_native_math"):
        assert _key(transformer, **inputs) != key, "Diffusers' process-wide backend is in the key"


def test_ip_adapter_with_replayed_steps_changes_with_its_scale():
    """Diffusers' ``test_ip_adapter`` steps through the CUDA-graph hook (on CPU it passes calls on): a
    non-zero scale changes the output, as in plain Diffusers."""
    plain, fast = random_flux_transformer(), random_flux_transformer()
    pipe = omni_accel.accelerate(_bare(fast), cuda_graphs=True)
    state = random_ip_adapter_state(plain)
    for model in (plain, fast):
        model._load_ip_adapter_weights(copy.deepcopy(state), low_cpu_mem_usage=False)
    inputs = flux_inputs(plain)
    embeds = {"ip_adapter_image_embeds": [torch.randn(2, 1, 12, generator=torch.Generator().manual_seed(6))]}
    outputs = []
    with torch.no_grad():
        for scale in (0.0, 42.0):
            for p in (_bare(plain), pipe):
                p.set_ip_adapter_scale(scale)
            outputs.append(
                [
                    m(**inputs, joint_attention_kwargs=dict(embeds), return_dict=False)[0]
                    for m in (plain, fast)
                ]
            )
    for expected, got in outputs:
        assert rel_err(got, expected) <= 1e-5
    assert not torch.allclose(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize("fused", [False, True])
def test_lora_training_steps_then_inference_match_diffusers(fused):
    """An adapter on the AdaLN modulation trained with an optimizer (a fused one writes the weights without
    moving their version counters), then a no-grad call: the projection cache serves no stale modulation."""
    from peft import LoraConfig

    plain, fast = _pair()
    inputs = flux_inputs(plain)
    optimizers = []
    for model in (plain, fast):
        torch.manual_seed(4)
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=2, target_modules=["norm1.linear", "to_q"], init_lora_weights=False))
        adapters = [param for name, param in model.named_parameters() if "lora" in name]
        optimizers.append(torch.optim.AdamW(adapters, lr=1e-2, fused=fused))
    for _ in range(2):
        for model, optimizer in zip((plain, fast), optimizers, strict=True):
            with torch.no_grad():
                model(**inputs)  # fills the cache
            loss = model(**inputs, return_dict=False)[0].square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            assert rel_err(fast(**inputs)[0], plain(**inputs)[0]) <= 1e-5


@pytest.mark.parametrize("when", ["before", "after"])
def test_gradient_checkpointing_matches_diffusers_and_names_the_gradient(when):
    """Diffusers' gradient checkpointing, enabled before or after ``accelerate``: the same gradients, and the
    blocks recomputed in the backward pass are counted for their gradient, not as calls from outside."""
    plain = random_flux_transformer()
    fast = copy.deepcopy(plain)
    plain.enable_gradient_checkpointing()
    if when == "before":
        fast.enable_gradient_checkpointing()
    omni_accel.accelerate(_bare(fast))
    if when == "after":
        fast.enable_gradient_checkpointing()
    for model in (plain, fast):
        model.train()
    inputs = flux_inputs(plain)
    (expected, expected_grads), (got, grads) = _input_grads(plain, inputs), _input_grads(fast, inputs)
    assert rel_err(got, expected) <= 1e-5
    for grad, want in zip(grads, expected_grads, strict=True):
        assert rel_err(grad, want) <= 1e-5
    for name, param in plain.named_parameters():
        assert rel_err(fast.get_parameter(name).grad, param.grad) <= 1e-5, name
    assert _fallbacks(fast) == {"gradients enabled for parameters that require them": 10}  # 5 blocks, twice
