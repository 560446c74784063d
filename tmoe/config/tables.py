"""Tuned tile tables: vLLM's file names, JSON rows by M, the shipped directory."""
from __future__ import annotations

import functools
import json
from dataclasses import asdict
from pathlib import Path

from tmoe.kernels.gemm_config import GemmConfig, MoEConfig

SHIPPED_CONFIGS = Path(__file__).parent / "tuned"


def config_file_name(e: int, n: int, device_name: str, dtype: str | None,
                     block_shape: tuple[int, int] | None = None) -> str:
    """vLLM's naming: ``E=8,N=14336,device_name=NVIDIA_H200,dtype=fp8_w8a8[,block_shape=[128,128]].json``."""
    name = f"E={e},N={n},device_name={device_name.replace(' ', '_')}"
    if dtype:
        name += f",dtype={dtype}"
    if block_shape:
        name += f",block_shape=[{block_shape[0]},{block_shape[1]}]"
    return name + ".json"


@functools.lru_cache(maxsize=None)
def load_table(file_name: str, dirs: tuple[Path, ...]) -> dict[int, MoEConfig] | None:
    for d in dirs:
        path = d / file_name
        if path.is_file():
            return read_table(path)
    return None


def read_table(path: Path) -> dict[int, MoEConfig]:
    """A tuned table ``{"M": {"up": {...}, "down": {...}[, "direct_down": {...}]}}`` by M."""
    table = {}
    for m, row in json.loads(path.read_text()).items():
        direct = row.get("direct_down")
        table[int(m)] = MoEConfig(GemmConfig(**row["up"]), GemmConfig(**row["down"]),
                                  GemmConfig(**direct) if direct else None)
    return table


def save_table(path: Path, table: dict[int, MoEConfig]) -> None:
    """Write a tuned table: ``{"M": {"up": {...}, "down": {...}[, "direct_down": {...}]}}`` sorted by M."""
    rows = {}
    for m, c in sorted(table.items()):
        rows[str(m)] = {"up": asdict(c.up), "down": asdict(c.down)}
        if c.direct_down is not None:
            rows[str(m)]["direct_down"] = asdict(c.direct_down)
    path.write_text(json.dumps(rows, indent=1) + "\n")
