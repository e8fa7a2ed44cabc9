"""The user-facing entry points: ``accelerate``, ``restore``, ``describe`` (``entry``).

``accelerate`` reads top to bottom as three phases, one module each:

1. plan (``plan``): check every component and build what it will run with (its runtime, report, graphs,
   and the checks of a layout); any error leaves the pipeline untouched;
2. commit (``commit``): each component's ordered steps (``_NATIVE_STEPS`` or ``_GENERIC_STEPS``: native
   blocks, the runtime bound to each forward, cache sites, compiled regions, graphs);
3. spread, under a layout (``spread``): each component over the ranks with the patches its layout
   declares, the CFG calls paired, the VAE split (``vae``), each rank's shards on its device.
   ``parallel="auto"`` runs this phase at the first pipeline call, once the layout is chosen and checked.

Every step records its own undo (an error in phase 2 or 3 runs those done so far); ``restore`` runs them
in reverse order. ``state`` holds what an accelerated pipeline keeps (its components, their undos, who owns
a module several pipelines share); ``reports`` says how each component runs now, for ``describe``;
``placement`` finds where a transformer computes and which attention provider serves each of its sites.
"""

from .entry import accelerate, describe, restore
from .state import differing_options

__all__ = ["accelerate", "describe", "differing_options", "restore"]
