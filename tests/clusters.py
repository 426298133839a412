"""Clusters the tests plan on.

The tests' models are small (microseconds of H100 compute), and NCCL's collectives cost
10-60 µs each, so on the default H100 cluster most of them are cheapest replicated. Tests
of a mechanism that needs a sharded plan (data parallelism, partial accumulators, a
budget that splits the state) plan on devices 500x slower than an H100, where these
models are compute-bound as the zoo's models are on H100s.
"""

import dataclasses

from shardc.cost.cluster import Cluster

#: H100 links, devices of 1 TFLOP/s
SLOW_DEVICES = Cluster(device_flops=1e12)
#: H100 nodes over InfiniBand, devices of 1 TFLOP/s
SLOW_NODES = dataclasses.replace(Cluster.multi_node(), device_flops=1e12)
