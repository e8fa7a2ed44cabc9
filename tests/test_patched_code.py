"""A patch of the Diffusers code a native block stands in for runs, as in plain Diffusers: the blocks run
Diffusers' forward while it is there (``models/code_watch.py``)."""

import copy
import functools
import pickle
import types

import diffusers.models.transformers.transformer_flux as transformer_flux
import pytest
import torch
from conftest import flux_inputs, random_flux_transformer, rel_err
from diffusers import FluxPipeline
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.activations import GELU
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxTransformerBlock,
)

import omni_accel


def _accelerated(transformer) -> FluxPipeline:
    return omni_accel.accelerate(FluxPipeline(None, None, None, None, None, None, transformer))


def _fallbacks(pipe) -> dict:
    return dict(omni_accel.describe(pipe).components[0].runtime.fallbacks)


def _recorder(original, calls: list):
    """An attention-map recorder's kind of patch: it counts the calls and changes the output a little."""

    def patched(*args, **kwargs):
        calls.append(1)
        out = original(*args, **kwargs)
        return tuple(o * 1.01 for o in out) if isinstance(out, tuple) else out * 1.01

    return patched


@torch.no_grad()
@pytest.mark.parametrize(
    ("holder", "name"),
    [
        (FluxAttnProcessor, "__call__"),
        (FluxTransformerBlock, "forward"),
        (GELU, "forward"),  # a submodule's class
        (transformer_flux, "dispatch_attention_fn"),  # a function the processor calls by name
    ],
)
def test_a_patch_after_accelerate_runs_as_in_diffusers(monkeypatch, holder, name):
    plain = random_flux_transformer()
    pipe = _accelerated(random_flux_transformer())
    inputs = flux_inputs(plain)
    assert rel_err(pipe.transformer(**inputs)[0], plain(**inputs)[0]) <= 1e-6
    assert _fallbacks(pipe) == {}
    calls = []
    monkeypatch.setattr(holder, name, _recorder(getattr(holder, name), calls))
    want = plain(**inputs)[0]
    plain_calls, calls[:] = len(calls), []
    assert torch.equal(pipe.transformer(**inputs)[0], want)
    assert len(calls) == plain_calls > 0
    (reason,) = _fallbacks(pipe)
    assert f"{name} is patched" in reason
    assert reason in str(omni_accel.describe(pipe))
    monkeypatch.undo()  # the patch gone, the blocks are native again
    counted = sum(_fallbacks(pipe).values())
    assert rel_err(pipe.transformer(**inputs)[0], plain(**inputs)[0]) <= 1e-6
    assert sum(_fallbacks(pipe).values()) == counted


@torch.no_grad()
def test_a_patch_from_before_accelerate_wrapped_with_functools_wraps_runs(monkeypatch):
    original, calls = FluxTransformerBlock.forward, []

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FluxTransformerBlock, "forward", forward)
    plain = random_flux_transformer()
    pipe = _accelerated(random_flux_transformer())
    inputs = flux_inputs(plain)
    want = plain(**inputs)[0]
    plain_calls, calls[:] = len(calls), []
    assert torch.equal(pipe.transformer(**inputs)[0], want)
    assert len(calls) == plain_calls == len(plain.transformer_blocks)


@torch.no_grad()
def test_a_forward_set_on_a_submodule_runs_and_a_removed_hook_leaves_none():
    """``block.attn.forward = MethodType(record, block.attn)`` (an attention-map recorder) runs as in plain
    Diffusers; the class's forward that a removed Diffusers hook leaves on the instance keeps blocks native."""
    plain = random_flux_transformer()
    pipe = _accelerated(random_flux_transformer())
    inputs = flux_inputs(plain)
    calls: list = []

    def record(self, *args, **kwargs):
        calls.append(1)
        return tuple(o * 1.01 for o in FluxAttention.forward(self, *args, **kwargs))

    for model in (plain, pipe.transformer):
        model.transformer_blocks[0].attn.forward = types.MethodType(record, model.transformer_blocks[0].attn)
    want, plain_calls = plain(**inputs)[0], len(calls)
    assert torch.equal(pipe.transformer(**inputs)[0], want) and len(calls) == 2 * plain_calls == 2
    assert "a forward set on the module" in next(iter(_fallbacks(pipe)))

    for model in (plain, pipe.transformer):
        del model.transformer_blocks[0].attn.forward
        registry = HookRegistry.check_if_exists_or_initialize(model.transformer_blocks[0].attn)
        registry.register_hook(ModelHook(), "probe")
        registry.remove_hook("probe")
    assert "forward" in pipe.transformer.transformer_blocks[0].attn.__dict__  # the bound class forward
    counted = sum(_fallbacks(pipe).values())
    assert rel_err(pipe.transformer(**inputs)[0], plain(**inputs)[0]) <= 1e-6
    assert sum(_fallbacks(pipe).values()) == counted


@torch.no_grad()
@pytest.mark.parametrize(
    ("path", "change"),
    [
        ("norm1.silu", lambda block: setattr(block.norm1, "silu", torch.nn.Identity())),
        ("act_mlp", lambda block: setattr(block, "act_mlp", torch.nn.SiLU())),  # no ``approximate``
        ("attn.norm_k", lambda block: setattr(block.attn.norm_k, "eps", 0.5)),
        ("norm1.norm", lambda block: setattr(block.norm1.norm, "eps", 0.5)),
    ],
)
def test_a_submodule_replaced_or_changed_after_accelerate_runs_in_diffusers(path, change):
    """What the native math computes without reading it (an activation, a norm's eps) replaced or changed
    after ``accelerate``: the block runs Diffusers' forward, which computes the new one, and names it."""
    plain = random_flux_transformer()
    pipe = _accelerated(random_flux_transformer())
    inputs = flux_inputs(plain)
    for model in (plain, pipe.transformer):
        block = model.single_transformer_blocks[0] if path == "act_mlp" else model.transformer_blocks[0]
        change(block)
    assert rel_err(pipe.transformer(**inputs)[0], plain(**inputs)[0]) <= 1e-6
    (reason,) = _fallbacks(pipe)
    assert reason.startswith(f"{path} was replaced or changed since accelerate")


@torch.no_grad()
def test_a_lora_added_after_accelerate_keeps_the_blocks_native():
    """The projections the math reads at every call are not part of the structure: peft wrapping them
    in LoRA layers keeps the blocks native."""
    from peft import LoraConfig

    plain = random_flux_transformer()
    pipe = _accelerated(random_flux_transformer())
    inputs = flux_inputs(plain)
    for model in (plain, pipe.transformer):
        torch.manual_seed(1)
        model.add_adapter(LoraConfig(r=2, target_modules=["to_q", "to_out.0", "proj_mlp", "norm1.linear"]))
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    assert rel_err(pipe.transformer(**inputs)[0], plain(**inputs)[0]) <= 1e-5
    assert _fallbacks(pipe) == {}


class _UserProcessor(FluxAttnProcessor):
    """A user's processor (a subclass, computing as Diffusers' does)."""


@torch.no_grad()
def test_the_processor_the_math_computes_is_watched_whatever_is_set_at_accelerate(monkeypatch):
    """A user's processor on every block at ``accelerate``, Diffusers' own set back afterwards: a patch of
    Diffusers' processor then runs, as in plain Diffusers."""
    plain, fast = random_flux_transformer(), random_flux_transformer()
    inputs = flux_inputs(plain)
    fast.set_attn_processor(_UserProcessor())
    pipe = _accelerated(fast)
    fast.set_attn_processor(FluxAttnProcessor())
    counted = sum(_fallbacks(pipe).values())
    assert torch.equal(pipe.transformer(**inputs)[0], plain(**inputs)[0])
    assert sum(_fallbacks(pipe).values()) == counted
    calls: list = []
    monkeypatch.setattr(FluxAttnProcessor, "__call__", _recorder(FluxAttnProcessor.__call__, calls))
    want, plain_calls = plain(**inputs)[0], len(calls)
    assert torch.equal(pipe.transformer(**inputs)[0], want) and len(calls) == 2 * plain_calls


_original_call = FluxAttnProcessor.__call__
_recorded: list = []


def _recording_call(self, *args, **kwargs):
    """The usual monkeypatch idiom: a module-level replacement that calls the original kept in a global
    (``_original_call``) and a helper of its own (``_record``)."""
    _record()
    return _original_call(self, *args, **kwargs)


def _record() -> None:
    _recorded.append(1)


@torch.no_grad()
def test_the_globals_of_a_patch_from_before_accelerate_are_not_watched(monkeypatch):
    """The functions a user's patch calls by name are the patch's, not Diffusers': once the patch is gone
    the blocks are native again, and the functions the unpatched processor calls are watched again."""
    plain = random_flux_transformer()
    inputs = flux_inputs(plain)
    want = plain(**inputs)[0]
    monkeypatch.setattr(FluxAttnProcessor, "__call__", _recording_call)
    pipe = _accelerated(random_flux_transformer())
    _recorded.clear()
    assert torch.equal(pipe.transformer(**inputs)[0], want)
    assert _recorded and "FluxAttnProcessor.__call__ is patched" in next(iter(_fallbacks(pipe)))
    monkeypatch.undo()
    counted = sum(_fallbacks(pipe).values())
    for _ in range(2):
        assert rel_err(pipe.transformer(**inputs)[0], want) <= 1e-6
    assert sum(_fallbacks(pipe).values()) == counted

    calls: list = []
    monkeypatch.setattr(
        transformer_flux, "dispatch_attention_fn", _recorder(transformer_flux.dispatch_attention_fn, calls)
    )
    pipe.transformer(**inputs)
    assert calls and any("dispatch_attention_fn is patched" in reason for reason in _fallbacks(pipe))


@torch.no_grad()
def test_our_own_patches_and_copies_keep_the_blocks_native():
    """A routed model's patches (``patches/attention_roles.py`` wraps ``Attention.forward``) are ours, not
    a user's: a native model accelerated beside one stays native, and so do its deep copy and pickle."""
    routed = omni_accel.accelerate(omni_accel.tiny_sd3_pipeline(seed=0))
    pipe = _accelerated(random_flux_transformer())
    inputs = flux_inputs(pipe.transformer)
    for copied in (pipe, copy.deepcopy(pipe), pickle.loads(pickle.dumps(pipe))):
        copied.transformer(**inputs)
        assert _fallbacks(copied) == {}
    omni_accel.restore(routed)


@torch.no_grad()
def test_a_gelu_set_to_another_approximation_runs_in_diffusers():
    """The native math computes the tanh GELU Diffusers' FLUX builds; ``approximate="none"`` set on its
    GELU modules before ``accelerate`` changes plain Diffusers' output (6e-5 here), and the blocks then run
    Diffusers' forward (set after it, the structure check names it: the test above)."""
    plain, fast = random_flux_transformer(), random_flux_transformer()
    inputs = flux_inputs(plain)
    for model in (plain, fast):
        for module in model.modules():
            if hasattr(module, "approximate"):
                module.approximate = "none"
    pipe = _accelerated(fast)
    assert torch.equal(pipe.transformer(**inputs)[0], plain(**inputs)[0])
    assert _fallbacks(pipe) == {
        "ff.net.0 is not a tanh GELU (approximate='none'), which the native math computes": len(
            pipe.transformer.transformer_blocks
        ),
        "act_mlp is not a tanh GELU (approximate='none'), which the native math computes": len(
            pipe.transformer.single_transformer_blocks
        ),
    }


@torch.no_grad()
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_module_function_replaced_by_a_partial_runs(monkeypatch, when):
    """Not only plain functions: any callable put in the module's place is a patch, before ``accelerate``
    or after it."""
    plain, fast = random_flux_transformer(), random_flux_transformer()
    inputs = flux_inputs(plain)
    scaled = functools.partial(_recorder(transformer_flux.dispatch_attention_fn, []))
    if when == "before":
        monkeypatch.setattr(transformer_flux, "dispatch_attention_fn", scaled)
    pipe = _accelerated(fast)
    monkeypatch.setattr(transformer_flux, "dispatch_attention_fn", scaled)
    assert torch.equal(pipe.transformer(**inputs)[0], plain(**inputs)[0])
    assert "dispatch_attention_fn is patched" in next(iter(_fallbacks(pipe)))
