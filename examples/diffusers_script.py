"""A plain Diffusers script with no omni_accel in it: load a pipeline, generate, save the latents.

    python examples/diffusers_script.py <pipeline dir or hub id> <output.pt>
    omni-accel run examples/diffusers_script.py <pipeline dir or hub id> <output.pt>    # accelerated

The second line runs this very file with every pipeline it builds accelerated (see docs/zero-code.md).
"""

import sys

import torch
from diffusers import DiffusionPipeline

pipe = DiffusionPipeline.from_pretrained(sys.argv[1])
result = pipe(
    "a photo of a cat",
    height=32,
    width=32,
    num_inference_steps=2,
    output_type="latent",
    generator=torch.Generator().manual_seed(0),
)
torch.save(result.images, sys.argv[2])
