"""Model zoo for exercising shardc: small, pure-JAX training steps built with Flax NNX (the
``bench`` extra brings Flax and Optax; shardc's core imports neither).

Each model module (``shardc.models.mlp``, ``gpt``, ``moe``, ``wrn``, ``vit``, ``llama``)
exposes a frozen config dataclass with a ``tiny()`` preset (tests) and a realistic one
(benchmarks), ``build_step(config)``, ``make_train_step(config) -> (train_step,
example_args)``, ``abstract_args(config)`` and ``param_axes(path, shape)``, the logical axis
names of each parameter (:mod:`shardc.models.logical`). Shared transformer layers live in
:mod:`shardc.models.layers`.
"""
