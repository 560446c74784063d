"""Device queries, read once per device index: streaming multiprocessors, the shared memory a
tile config may stage, whether the GPU is sm_90+, and the persistent GEMMs' program count."""
from __future__ import annotations

import functools

import torch

from tmoe.runtime.interpreter import INTERPRETED


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device when it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm90(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def is_sm90(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or later (Hopper), read once per device index."""
    return _sm90(device_index(device))


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes off a GPU (the interpreter); Hopper's 227 KB minus the margin


EPILOGUE_MARGIN = 27 * 1024  # of a device's per-block limit, left for the epilogue's own shared memory


@functools.cache
def _device_budget(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin - EPILOGUE_MARGIN


def shared_memory_budget(device: torch.device) -> int:
    """Bytes a tile config may stage on ``device``: its opt-in shared memory per block minus
    EPILOGUE_MARGIN (227 KB -> 200 KB on H100/H200, 99 KB -> 72 KB on Ada), read once per
    device index; SHARED_MEMORY_BUDGET off a GPU."""
    if device.type != "cuda":
        return SHARED_MEMORY_BUDGET
    return _device_budget(device_index(device))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device``, read once per device index."""
    return _sm_count(device_index(device))


INTERPRETER_PROGRAMS = 4  # persistent programs under the interpreter: few, so each walks several tiles


def persistent_programs(device: torch.device, num_tiles: int) -> int:
    """Programs of a persistent GEMM of at most ``num_tiles`` tiles: min(SMs, num_tiles), the
    SM count read once per device index; INTERPRETER_PROGRAMS off a GPU."""
    if device.type != "cuda" or INTERPRETED:
        return min(INTERPRETER_PROGRAMS, num_tiles)
    return min(sm_count(device), num_tiles)
