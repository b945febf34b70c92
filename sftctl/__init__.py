"""sftctl: run a training job on the cheapest accelerator that can run it.

Importing this package is deliberately cheap: no torch, jax, triton or cloud SDK is imported here.
"""

__version__ = "0.1.0"
