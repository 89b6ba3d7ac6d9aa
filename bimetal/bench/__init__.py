"""Benchmarks and experiments: they measure the layers below on this machine or on the lab, and are
never imported by them.

* ``comm``: bandwidth and latency per message size and transport (``bimetal bench comm``);
* ``engine``: device-direct's transfer engine alone, the ``dd-engine`` row of ``bench comm``;
* ``stripes``: cpu-forward's striping over K lab NICs (``python -m bimetal.bench.stripes``);
* ``ladder``: the throughput ladder on a two-node lab (``bimetal bench ladder``);
* ``ladder_check``: the cost model fed the lab's figures against a measured ladder (``bimetal plan ladder-check``);
* ``calibrate``: planner predictions against lab training runs (``bimetal plan calibrate``);
* ``train``: replicated vs sharded training, tokens/s and state bytes (``bimetal bench train``).
"""
