"""The search compiler: a traced training step in, a plan (kernels, schedules, times) out.

Knows nothing of clouds, state or the CLI. Import is light; torch, jax and numpy are imported by
the modules that use them.
"""
