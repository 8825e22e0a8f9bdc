"""Tuned decode configs, keyed by shape class, with the heuristic as the fallback.

A shape class rounds the static facts of a call up to powers of two, so that one measured entry
covers its neighbours: ``(cache dtype, head_dim, group, block_size, batch, capacity)``. Entries are
measured on the device named in ``TUNED_ON`` with ``python -m pallas_paged.bench --tune``; on any
other device, or for a shape class not in the table, `lookup` returns the heuristic config.
"""

from __future__ import annotations

from pallas_paged.config import DecodeConfig, DecodeShape, get_heuristic_config
from pallas_paged.platform import next_power_of_2

# (sm_count of the device the table was measured on)
TUNED_ON = 132

# shape class -> config; filled from measurements on the H200.
TUNED: dict[tuple, DecodeConfig] = {}


def shape_class(shape: DecodeShape) -> tuple:
    """The key a shape is looked up under: its static facts rounded up to powers of two."""
    return (shape.cache_dtype, next_power_of_2(shape.head_dim), next_power_of_2(shape.group),
            shape.block_size, next_power_of_2(shape.batch), next_power_of_2(shape.capacity))


def lookup(shape: DecodeShape, sm_count: int) -> DecodeConfig:
    """The tuned config of ``shape``'s class on this device, else the heuristic one."""
    if sm_count == TUNED_ON:
        config = TUNED.get(shape_class(shape))
        if config is not None:
            return config
    return get_heuristic_config(shape, sm_count)
