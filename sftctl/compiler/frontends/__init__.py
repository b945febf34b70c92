"""Frontends trace a whole training step (forward, loss, backward, optimizer) into the IR."""
