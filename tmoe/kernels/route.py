"""``Route``: every way the experts run one chunk of a layer call, one vocabulary from the public
``tmoe.override_route("sorted")`` strings down to the kernels' ``ROUTE`` constexpr (the int of
the enum). The call plan decides it once per call signature (``FusedMoEPermuteExpertsUnpermute.route``)."""
from __future__ import annotations

from enum import IntEnum


class Route(IntEnum):
    """A chunk's route; its ``label`` is the public string (``tmoe.override_route``)."""

    SORTED = 0  # align, then both GEMMs over expert-sorted slots, rows gathered by pointers: per-slot outputs (M, topk, K)
    GROUPED = 1  # align, copy the rows into expert-sorted order, both GEMMs on the grouped core (TMA): per-slot outputs
    SLOTS = 2  # no align, one row block per slot in both GEMMs: per-slot outputs
    DIRECT = 3  # no align; the up GEMM per slot, the down GEMM sums each token's slots: the layer output (M, K)
    FUSED = 4  # up, activation and down in one kernel per slot, then a fixed-order sum: (M, K)
    BATCHED = 5  # (E_local, capacity, K) batches with per-expert token counts in device memory

    @property
    def label(self) -> str:
        """The public name ("sorted", "grouped", ...)."""
        return self.name.lower()

    @classmethod
    def of(cls, label: str) -> Route:
        """The route a public name stands for; ValueError naming the known ones."""
        for route in cls:
            if route.label == label:
                return route
        raise ValueError(f"route must be one of {tuple(r.label for r in cls)}, got {label!r}")

    @property
    def reduces_topk(self) -> bool:
        """Whether the experts write the weighted top-k sum (M, K) themselves."""
        return self in (Route.DIRECT, Route.FUSED)

    @property
    def gemm_rows(self) -> Route:
        """The row layout of ``moe_gemm``'s programs on this route, as its ``ROUTE`` constexpr:
        SORTED (aligned row blocks), SLOTS (one row block per slot: DIRECT's up GEMM too) or BATCHED."""
        return Route.SLOTS if self is Route.DIRECT else self
