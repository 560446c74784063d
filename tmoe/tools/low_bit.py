"""Weight-only low-bit modes of the layer benchmark: ``--dtype int4|int8|mxfp4``.

int4: group 128 with zero points (AWQ-style checkpoints); int8: group 128, symmetric; mxfp4:
GPT-OSS's e2m1 with one e8m0 scale per 32. Activations stay bf16. The floor reads the scheme's
bytes (codes + scales + zero points); the bf16 tmoe layer on the same weights runs beside it
("tmoe_bf16") so each row shows whether the low-bit layer beats it.
"""
from __future__ import annotations

import torch

import tmoe
from tmoe.tools.inputs import Provider

LOW_BIT_DTYPES = ("int4", "int8", "mxfp4")
GROUP_SIZE = 128
_CHUNK = 8  # experts quantized at a time (the quantizers work in float32)


def value_bytes(dtype: str) -> float:
    """Bytes per weight value read by the layer: codes, bf16 group scales (and int4 zero points),
    or the fp8/bf16 element size."""
    if dtype == "int4":
        return 0.5 + (2 + 0.5) / GROUP_SIZE
    if dtype == "int8":
        return 1 + 2 / GROUP_SIZE
    if dtype == "mxfp4":
        return 0.5 + 1 / 32
    return 2 if dtype == "bf16" else 1


def quantize(w: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scales, zero points or None) of w (E, rows, K), a few experts at a time."""
    parts = []
    for chunk in w.split(_CHUNK):
        if dtype == "mxfp4":
            parts.append((*tmoe.quantize_weight_mxfp4(chunk), None))
        elif dtype == "int4":
            parts.append(tmoe.quantize_weight_int4(chunk, GROUP_SIZE, zero_point=True))
        else:
            parts.append(tmoe.quantize_weight_int8(chunk, GROUP_SIZE, zero_point=False))
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))


def low_bit_providers(w1: torch.Tensor, w2: torch.Tensor, dtype: str, names: tuple[str, ...]) -> list:
    """"tmoe" on ``dtype`` weights quantized from w1/w2 and "tmoe_bf16" on w1/w2 themselves."""
    if "tmoe" not in names:
        return []
    qc = tmoe.FusedMoEQuantConfig(weight_dtype=dtype, group_size=32 if dtype == "mxfp4" else GROUP_SIZE)
    (q1, s1, z1), (q2, s2, z2) = quantize(w1, dtype), quantize(w2, dtype)

    def low_bit(r):
        return tmoe.fused_experts(r.x, q1, q2, r.topk_weights, r.topk_ids, quant_config=qc, w1_scale=s1,
                                  w2_scale=s2, w1_zp=z1, w2_zp=z2)

    def bf16(r):
        return tmoe.fused_experts(r.x, w1, w2, r.topk_weights, r.topk_ids)

    return [Provider("tmoe", low_bit), Provider("tmoe_bf16", bf16)]
