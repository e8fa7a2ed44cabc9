"""A patch of the Diffusers code a native block stands in for runs, as in plain Diffusers: the blocks run
Diffusers' forward while it is there (``models/code_watch.py``)."""

import copy
import functools
import pickle

import diffusers.models.transformers.transformer_flux as transformer_flux
import pytest
import torch
from conftest import flux_inputs, random_flux_transformer, rel_err
from diffusers import FluxPipeline
from diffusers.models.activations import GELU
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxTransformerBlock

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
    GELU modules changes plain Diffusers' output (6e-5 here), and the blocks then run Diffusers' forward."""
    plain = random_flux_transformer()
    pipe = _accelerated(random_flux_transformer())
    inputs = flux_inputs(plain)
    for model in (plain, pipe.transformer):
        for module in model.modules():
            if hasattr(module, "approximate"):
                module.approximate = "none"
    assert torch.equal(pipe.transformer(**inputs)[0], plain(**inputs)[0])
    assert _fallbacks(pipe) == {
        "ff.net.0 has approximate='none' (the native math computes the tanh GELU)": len(
            pipe.transformer.transformer_blocks
        ),
        "act_mlp has approximate='none' (the native math computes the tanh GELU)": len(
            pipe.transformer.single_transformer_blocks
        ),
    }


@torch.no_grad()
def test_a_module_function_replaced_by_a_partial_runs(monkeypatch):
    """Not only plain functions: any callable put in the module's place is a patch."""
    plain = random_flux_transformer()
    pipe = _accelerated(random_flux_transformer())
    inputs = flux_inputs(plain)
    scaled = functools.partial(_recorder(transformer_flux.dispatch_attention_fn, []))
    monkeypatch.setattr(transformer_flux, "dispatch_attention_fn", scaled)
    assert torch.equal(pipe.transformer(**inputs)[0], plain(**inputs)[0])
    assert "dispatch_attention_fn is patched" in next(iter(_fallbacks(pipe)))
