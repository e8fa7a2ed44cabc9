"""The package logger: silent by default for a fully accelerated pipeline, a WARNING for whatever is left
to Diffusers, an INFO summary per accelerate, nothing printed."""

import logging
import os
import subprocess
import sys

import pytest
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

import omni_accel
from omni_accel.utils import logging as omni_logging


@pytest.fixture
def records():
    captured = []

    class Keep(logging.Handler):
        def emit(self, record):
            captured.append(record)

    handler = Keep(level=logging.DEBUG)
    root = logging.getLogger("omni_accel")
    previous = omni_logging.get_verbosity()
    root.addHandler(handler)
    omni_logging.set_verbosity_info()
    yield captured
    root.removeHandler(handler)
    omni_logging.set_verbosity(previous)


class _Custom(FluxAttnProcessor):
    pass


def test_native_pipeline_logs_one_info_summary_and_no_warning(records, capsys):
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    pipe("a cat", height=32, width=32, num_inference_steps=1, output_type="latent")
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert infos == [
        "FluxPipeline accelerated: transformer (FluxTransformer2DModel) native (omni_accel.describe(pipe) for details)"
    ]
    assert not [r for r in records if r.levelno >= logging.WARNING]
    assert capsys.readouterr().out == ""  # the library prints nothing


def test_what_is_left_to_diffusers_is_a_warning(records):
    omni_accel.accelerate(omni_accel.tiny_sd3_pipeline(seed=0))
    pipe = omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))
    pipe.transformer.transformer_blocks[0].attn.set_processor(_Custom())
    for _ in range(2):
        pipe("a cat", height=32, width=32, num_inference_steps=1, output_type="latent")
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any("SD3Transformer2DModel) is routed" in w for w in warnings)
    fallbacks = [w for w in warnings if "runs Diffusers' forward" in w]
    assert len(fallbacks) == 1 and "_Custom" in fallbacks[0]  # once per reason, not per call


def test_verbosity_from_the_environment():
    code = "import omni_accel; omni_accel.accelerate(omni_accel.tiny_flux_pipeline(seed=0))"
    env = {**os.environ, "OMNI_ACCEL_VERBOSITY": "info"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "[omni_accel] INFO FluxPipeline accelerated" in done.stderr
    env["OMNI_ACCEL_VERBOSITY"] = "error"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "[omni_accel]" not in done.stderr
