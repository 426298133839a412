"""The training runtime around a planned step: several hosts on ``jax.distributed`` and
Orbax checkpoints that reshard."""
