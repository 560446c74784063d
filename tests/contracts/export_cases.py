"""Every layer composition in one module, for torch.export + AOTInductor (one package, one C++
compile: CI time). ``python export_cases.py compile DIR`` exports it with a dynamic M, packages it
and saves eager outputs at ``MS``; ``python export_cases.py load DIR`` (a fresh process: nothing
traced or compiled there) runs the package at ``MS`` and checks it against them."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tmoe

E, K, N, TOPK = 4, 128, 64, 2
MS = (1, 7, 19)  # three token counts; the batched kernel's capacity covers the largest
CAPACITY = 32
FP8 = torch.float8_e4m3fn
FP8_SCHEMES = {
    "fp8_tensor": tmoe.FusedMoEQuantConfig(FP8),
    "fp8_token": tmoe.FusedMoEQuantConfig(FP8, per_act_token_quant=True, per_out_ch_quant=True),
    "fp8_block": tmoe.FusedMoEQuantConfig(FP8, block_shape=(64, 64)),
}
LOW_BIT = {"int4": 32, "int8": 32, "mxfp4": 32}  # scheme -> group size


def _fp8_weights(w: torch.Tensor, config: tmoe.FusedMoEQuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    if config.block_shape is not None:
        return tmoe.quantize_weight_per_block_fp8(w, config.block_shape)
    if config.per_out_ch_quant:
        return tmoe.quantize_weight_per_channel_fp8(w)
    return tmoe.quantize_weight_per_tensor_fp8(w)


def _low_bit_weights(w: torch.Tensor, scheme: str, group: int) -> dict[str, torch.Tensor]:
    if scheme == "mxfp4":
        q, s = tmoe.quantize_weight_mxfp4(w)
        return {"w": q, "scale": s}
    quantizer = tmoe.quantize_weight_int4 if scheme == "int4" else tmoe.quantize_weight_int8
    q, s, zp = quantizer(w, group, zero_point=True)
    return {"w": q, "scale": s, "zp": zp}


class Composition(nn.Module):
    """One modular kernel with its own weights and a fixed softmax router: x (M, K) -> (M, K)."""

    def __init__(self, kernel: tmoe.FusedMoEModularKernel, w1: torch.Tensor, w2: torch.Tensor,
                 **options: torch.Tensor) -> None:
        super().__init__()
        self.kernel = kernel
        self.register_buffer("router", torch.randn(E, K) / K**0.5)
        self.register_buffer("w1", w1)
        self.register_buffer("w2", w2)
        for name, t in options.items():
            self.register_buffer(name, t)
        self.option_names = tuple(options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch.topk(torch.softmax(F.linear(x, self.router), -1), TOPK)
        options = {name: getattr(self, name) for name in self.option_names}
        return self.kernel(x, self.w1, self.w2, weights, ids.to(torch.int32), **options)


def _tiny_mixtral_block() -> nn.Module:
    """The sparse MoE block of a random one-layer Mixtral after ``replace_moe_blocks``."""
    import transformers

    from tmoe.integrations.transformers import replace_moe_blocks

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=K, intermediate_size=N, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                                        num_experts_per_tok=TOPK, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    assert replace_moe_blocks(model, strict=True) == 1
    return model.model.layers[0].mlp


class MixtralBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _tiny_mixtral_block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x[None])
        return (out[0] if isinstance(out, tuple) else out)[0]


class AllCompositions(nn.Module):
    """x (M, K) float32 -> one (M, K) output per composition, in ``names`` order."""

    def __init__(self) -> None:
        super().__init__()
        w1, w2 = torch.randn(E, 2 * N, K) / K**0.5, torch.randn(E, K, N) / N**0.5
        noep = (tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts())
        parts: dict[str, nn.Module] = {
            "noep": Composition(tmoe.FusedMoEModularKernel(*noep), w1, w2),
            "batched": Composition(tmoe.FusedMoEModularKernel(tmoe.BatchedPrepareAndFinalize(CAPACITY, E),
                                                              tmoe.BatchedTritonExperts(CAPACITY)), w1, w2),
        }
        for name, config in FP8_SCHEMES.items():
            (q1, s1), (q2, s2) = _fp8_weights(w1, config), _fp8_weights(w2, config)
            kernel = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(config))
            parts[name] = Composition(kernel, q1, q2, w1_scale=s1, w2_scale=s2)
        for scheme, group in LOW_BIT.items():
            config = tmoe.FusedMoEQuantConfig(weight_dtype=scheme, group_size=group)
            a, b = _low_bit_weights(w1, scheme, group), _low_bit_weights(w2, scheme, group)
            extra = {"w1_zp": a["zp"], "w2_zp": b["zp"]} if "zp" in a else {}
            kernel = tmoe.FusedMoEModularKernel(tmoe.NoEPPrepareAndFinalize(), tmoe.TritonExperts(config))
            parts[scheme] = Composition(kernel, a["w"], b["w"], w1_scale=a["scale"], w2_scale=b["scale"], **extra)
        parts["fused_moe"] = tmoe.FusedMoE(E, K, N, TOPK, dtype=torch.float32)
        parts["replace_moe_blocks"] = MixtralBlock()
        self.parts = nn.ModuleDict(parts)
        self.names = tuple(parts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.parts[name](x) for name in self.names)


def inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(m, K, generator=g) for m in MS]


def compile_package(out_dir: Path) -> None:
    """Export with a dynamic M, package, and save the eager outputs at ``MS`` (``eager.pt``)."""
    torch.manual_seed(0)
    model = AllCompositions().eval()
    start = time.perf_counter()
    program = torch.export.export(model, (inputs()[1],),
                                  dynamic_shapes=({0: torch.export.Dim("m", min=1, max=CAPACITY)},))
    exported = time.perf_counter()
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(out_dir / "layers.pt2"),
        inductor_configs={"aot_inductor.compile_wrapper_opt_level": "O0"},  # the wrapper only calls ops: CI time
    )
    with torch.no_grad():
        eager = [model(x) for x in inputs()]
    torch.save({"names": model.names, "eager": eager}, out_dir / "eager.pt")
    print(f"export {exported - start:.1f} s, compile {time.perf_counter() - exported:.1f} s")


def load_and_check(out_dir: Path) -> None:
    """Run the package at ``MS`` and compare each composition with eager (float32 tolerance)."""
    from tmoe.testing import assert_close

    saved = torch.load(out_dir / "eager.pt")
    run = torch._inductor.aoti_load_package(str(out_dir / "layers.pt2"))
    for x, eager in zip(inputs(), saved["eager"]):
        for name, got, want in zip(saved["names"], run(x), eager):
            assert_close(got, want, torch.float32, name=f"{name} at M={x.shape[0]}")
    print("ok", len(saved["names"]), "compositions at M =", MS)


if __name__ == "__main__":
    {"compile": compile_package, "load": load_and_check}[sys.argv[1]](Path(sys.argv[2]))
