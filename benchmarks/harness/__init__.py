"""What every benchmark shares: the models at their published widths (and tiny, for smoke runs), the
baselines every speed claim needs (Diffusers as built, Diffusers' best switches), and the timing.

Entry scripts put ``benchmarks/`` on the path by being run from it (``python benchmarks/step.py``), so
they import ``harness.<module>``.
"""
