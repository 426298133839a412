"""Model zoo for exercising shardc: small, pure-JAX training steps built with Flax NNX.

Each model module (``models.mlp``, ``models.gpt``, ``models.moe``, ``models.wrn``,
``models.vit``) exposes a frozen config dataclass with a ``tiny()`` preset (tests) and a
realistic one (benchmarks), ``build_step(config)``, ``make_train_step(config) ->
(train_step, example_args)``, ``abstract_args(config)`` and ``param_axes(path, shape)``, the
logical axis names of each parameter (:mod:`models.logical`). Shared transformer layers
live in :mod:`models.layers`.
"""
