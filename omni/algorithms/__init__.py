"""Training algorithms, one module each (`omni/algorithms/<name>.py` defines `ALGORITHM`,
see `omni.algorithms.base`), chosen by `algorithm.name`."""

from __future__ import annotations

from omni.registry import Registry

ALGORITHMS = Registry(__name__, "ALGORITHM", "algorithm", "algorithm.name")


def get_algorithm(name: str):
    return ALGORITHMS.get(name)
