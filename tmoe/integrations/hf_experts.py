"""tmoe stand-ins for Hugging Face ``transformers`` (5.x) experts modules, and the layout table.

tmoe computes ``sum_k w_k * (act(x W1g_e^T + b1g_e) * (x W1u_e^T + b1u_e)) W2_e^T + b2_e`` with
``W1`` (E, 2N, K): gate rows then up rows, or alternating (``gate_up_interleaved``), and ``W2``
(E, K, N). Each supported experts class is described by an ``ExpertsSpec``: how far its storage is
from that layout (transposed, interleaved, DBRX's flat per-expert blocks), whether it has biases,
and which gating it applies. Weights already in tmoe's layout keep their Parameters; the others
are re-laid once, at swap time (GPT-OSS's: transposed only, its interleaved gate/up rows are read
as they are).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tmoe import ExpertParallel, FusedMoEModularKernel, FusedMoEQuantConfig, NoEPPrepareAndFinalize, TritonExperts
from tmoe.integrations.hf_layout import ExpertsLayout, gating
from tmoe.integrations.hf_mxfp4 import deinterleave_rows, mxfp4_mismatch, packed_mxfp4

@dataclass(frozen=True)
class ExpertsSpec:
    """How a transformers experts class stores and gates its experts.

    transposed: ``gate_up_proj`` (E, H, 2I) and ``down_proj`` (E, I, H) (tmoe: (E, 2I, H), (E, H, I)).
    interleaved: gate and up columns alternate (gate0, up0, gate1, ...) instead of two halves.
    bias: ``gate_up_proj_bias`` (E, 2I) and ``down_proj_bias`` (E, H).
    swigluoai: attribute names of the (alpha, limit) of GPT-OSS's clamped gating; None: ``act_fn(gate) * up``,
    clamped (min(act_fn(gate), limit) * clamp(up, ±limit)) when the module has a finite ``limit``.
    dbrx: DBRX's ``mlp.w1``/``mlp.v1``/``mlp.w2``, each (E * I, H).
    mxfp4: GPT-OSS's packed mxfp4 experts (``tmoe.integrations.hf_mxfp4``), run packed.
    """

    transposed: bool = False
    interleaved: bool = False
    bias: bool = False
    swigluoai: tuple[str, str] | None = None
    dbrx: bool = False
    mxfp4: bool = False

    def flags(self) -> dict[str, bool]:
        """The ``@use_experts_implementation`` attributes a class of this layout carries."""
        return {"is_transposed": self.transposed, "is_concatenated": not self.interleaved, "has_bias": self.bias,
                "has_gate": True, "has_post_expert_norm": False}


_STANDARD = (
    "AfmoeExperts", "AXK1Experts", "AXK2Experts", "BailingHybridExperts", "BeamExperts", "Cohere2MoeExperts",
    "DeepseekOcr2TextExperts", "DeepseekV2Experts", "DeepseekV3Experts", "DeepseekV32Experts",
    "DiffusionGemmaTextExperts", "Dots1Experts", "Dots3NoteExperts", "Ernie4_5_MoeExperts",
    "Ernie4_5_VLMoeMoeExperts", "ExaoneMoeExperts", "FlexOlmoExperts", "FlintExperts", "Gemma4TextExperts",
    "Glm4MoeExperts", "Glm4MoeLiteExperts", "Glm4vMoeTextExperts", "GlmMoeDsaExperts", "GraniteMoeExperts",
    "GraniteMoeHybridExperts", "GraniteMoeSharedExperts", "GraniteMoeSWAExperts", "HunYuanMoEV1Experts",
    "HYV3Experts", "InklingExperts", "JambaExperts", "KimiLinearExperts", "Kolibri1Experts", "Kolibri1_1Experts",
    "LagunaExperts", "LaraMiniExperts", "Lfm2MoeExperts", "LongcatFlashExperts", "MellumExperts",
    "MiMoV2FlashExperts", "MiniCPM5MoeExperts", "MiniMaxExperts", "MiniMaxM2Experts", "Mistral4Experts",
    "MistralLarge4TextExperts", "MixtralExperts", "OlmoeExperts", "PhimoeExperts", "Qwen2MoeExperts",
    "Qwen3_5MoeExperts", "Qwen3MoeExperts", "Qwen3NextExperts", "Qwen3OmniMoeTalkerTextExperts",
    "Qwen3OmniMoeThinkerTextExperts", "Qwen3VLMoeTextExperts", "Qwen4ExpTextExperts", "SolarOpenExperts",
    "Step3p7Experts", "UnlimitedOcrTextExperts", "ZayaExperts",
)
SUPPORTED_EXPERTS: dict[str, ExpertsSpec] = {
    **dict.fromkeys(_STANDARD, ExpertsSpec()),
    "AriaExperts": ExpertsSpec(transposed=True),
    "Llama4TextExperts": ExpertsSpec(transposed=True),
    "DbrxExperts": ExpertsSpec(dbrx=True),
    "GptOssExperts": ExpertsSpec(transposed=True, interleaved=True, bias=True, swigluoai=("alpha", "limit")),
    "Mxfp4GptOssExperts": ExpertsSpec(interleaved=True, bias=True, swigluoai=("alpha", "limit"), mxfp4=True),
    "OpenAIPrivacyFilterExperts": ExpertsSpec(transposed=True, bias=True, swigluoai=("alpha", "limit")),
    "MiniMaxM3VLExperts": ExpertsSpec(swigluoai=("swiglu_alpha", "swiglu_limit")),
}


def _gating(experts: nn.Module, spec: ExpertsSpec) -> ExpertsLayout | str:
    """The activation (and its alpha / clamp) of ``experts``, as the registry path reads it."""
    act_fn = getattr(experts.mlp, "activation_fn", None) if spec.dbrx else getattr(experts, "act_fn", None)
    return gating(experts, spec.swigluoai or "clamped", act_fn)


def _shape(module: nn.Module, name: str) -> tuple[int, ...] | None:
    t = getattr(module, name, None)
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _layout_mismatch(experts: nn.Module, spec: ExpertsSpec) -> str | None:
    """What in the experts' weights differs from ``spec`` (older transformers releases stored
    some families differently); None when the shapes are as the spec says."""
    if spec.dbrx:
        mlp, e = getattr(experts, "mlp", None), getattr(experts, "num_experts", 0)
        shapes = {_shape(mlp, n) for n in ("w1", "v1", "w2")} if mlp is not None else {None}
        ok = len(shapes) == 1 and None not in shapes and e > 0 and next(iter(shapes))[0] % e == 0
        return None if ok else f"mlp.w1/v1/w2 shapes {shapes} are not (E * I, H) with E={e}"
    if spec.mxfp4:
        return mxfp4_mismatch(experts)
    w1, w2 = _shape(experts, "gate_up_proj"), _shape(experts, "down_proj")
    if w1 is None or w2 is None or len(w1) != 3 or len(w2) != 3:
        return f"needs 3-D gate_up_proj and down_proj, has {w1} and {w2}"
    e, two_i, h = (w1[0], w1[2], w1[1]) if spec.transposed else w1
    want = {"down_proj": (e, two_i // 2, h) if spec.transposed else (e, h, two_i // 2)}
    if spec.bias:
        want |= {"gate_up_proj_bias": (e, two_i), "down_proj_bias": (e, h)}
    got = {name: _shape(experts, name) for name in want}
    if two_i % 2 or got != want or getattr(experts, "num_experts", e) != e:
        return f"gate_up_proj {w1} with {got} is not the layout tmoe's table gives it ({want})"
    return None


def unsupported_reason(experts: nn.Module) -> str | None:
    """Why tmoe cannot run this experts module (None: it can)."""
    spec = SUPPORTED_EXPERTS.get(type(experts).__name__)
    if spec is None:
        return "not a supported experts class"
    differing = {k: getattr(experts, k) for k, v in spec.flags().items() if getattr(experts, k, v) != v}
    if differing:
        return f"stores its experts unlike tmoe's table for it ({differing})"
    mismatch = _layout_mismatch(experts, spec)
    if mismatch:
        return mismatch
    layout = _gating(experts, spec)
    return layout if isinstance(layout, str) else None


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().contiguous(), requires_grad=False)


class TmoeExperts(nn.Module):
    """A transformers experts module run by ``FusedMoEModularKernel``.

    forward(hidden_states (..., H), top_k_index (T, k), top_k_weights (T, k)) -> (..., H), with
    T the number of rows of hidden_states: the call signature of transformers' ``*Experts``.
    ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) are in tmoe's layout, gate and up
    rows alternating when ``gate_up_interleaved`` (GPT-OSS); mxfp4 experts keep them packed (uint8
    (E, 2I, H / 2) and (E, H, I / 2), down_proj a view of the checkpoint's blocks, gate/up rows
    de-interleaved once) with e8m0 ``gate_up_proj_scale``/``down_proj_scale``; with
    ``expert_parallel`` they (and the biases) hold this rank's E_local experts only.
    """

    def __init__(self, experts: nn.Module, expert_parallel: ExpertParallel | None = None) -> None:
        super().__init__()
        spec = SUPPORTED_EXPERTS[type(experts).__name__]
        layout = _gating(experts, spec).stored(spec.transposed, spec.bias,  # packed mxfp4 rows are de-interleaved once
                                               interleaved=spec.interleaved and not spec.mxfp4)
        self.activation = layout.activation  # one value: the name, its floats, interleaved rows
        self.gate_up_proj_bias = self.down_proj_bias = self.gate_up_proj_scale = self.down_proj_scale = None
        quant = None
        if spec.mxfp4:
            (c1, s1), (c2, s2) = packed_mxfp4(experts, "gate_up_proj"), packed_mxfp4(experts, "down_proj")
            self.gate_up_proj, self.gate_up_proj_scale = _frozen(deinterleave_rows(c1)), _frozen(deinterleave_rows(s1))
            self.down_proj, self.down_proj_scale = _frozen(c2), _frozen(s2)
            quant = FusedMoEQuantConfig(weight_dtype="mxfp4")
        elif spec.dbrx:
            mlp = experts.mlp
            w1, v1, w2 = (w.view(experts.num_experts, -1, w.shape[-1]) for w in (mlp.w1, mlp.v1, mlp.w2))
            self.gate_up_proj, self.down_proj = _frozen(torch.cat([w1, v1], 1)), _frozen(w2.transpose(1, 2))
        elif spec.transposed:  # copied once, K-contiguous as the TMA loads want: this path is inference-only
            w1, w2, self.gate_up_proj_bias, self.down_proj_bias = layout.weights(experts)
            self.gate_up_proj, self.down_proj = _frozen(w1), _frozen(w2)
        else:
            self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias = layout.weights(experts)
        if spec.mxfp4:
            b1 = experts.gate_up_proj_bias
            self.gate_up_proj_bias = _frozen(deinterleave_rows(b1)) if spec.interleaved else b1
            self.down_proj_bias = experts.down_proj_bias
        self.ep_options = {}
        parts = (NoEPPrepareAndFinalize(), TritonExperts(quant))
        if expert_parallel is not None:
            if quant is not None:
                raise ValueError("expert parallelism of packed mxfp4 experts is not supported; dequantize them first")
            e = self.gate_up_proj.shape[0]
            for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                t = getattr(self, name)
                setattr(self, name, None if t is None else _frozen(expert_parallel.shard(t)))
            self.register_buffer("expert_map", expert_parallel.expert_map(e, self.gate_up_proj.device),
                                 persistent=False)
            self.ep_options = {"global_num_experts": e, "expert_map": self.expert_map}
            parts = expert_parallel.kernel_parts(e)
        self.kernel = FusedMoEModularKernel(*parts)

    def set_batch_invariant(self, enabled: bool | None) -> None:
        """The kernel's batch-invariant mode (``tmoe.FusedMoEModularKernel``'s ``batch_invariant``)."""
        k = self.kernel
        self.kernel = FusedMoEModularKernel(k.prepare_finalize, k.fused_experts, k.chunk_size,
                                            save_preactivation=k.save_preactivation, batch_invariant=enabled)

    def run(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            weight_on_input: bool = False) -> torch.Tensor:
        """x (T, H), top_k_index/top_k_weights (T, k) -> (T, H); ``weight_on_input`` scales each
        expert's input instead of its output (then k must be 1)."""
        return self.kernel(x.contiguous(), self.gate_up_proj, self.down_proj, top_k_weights.float().contiguous(),
                           top_k_index.contiguous(), w1_bias=self.gate_up_proj_bias,
                           w2_bias=self.down_proj_bias, apply_router_weight_on_input=weight_on_input,
                           w1_scale=self.gate_up_proj_scale, w2_scale=self.down_proj_scale,
                           **self.activation.layer_kwargs(), **self.ep_options)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        return self.run(x, top_k_index, top_k_weights).view(hidden_states.shape)


class TmoeLlama4TextMoe(nn.Module):
    """Llama4's MoE block on tmoe. Llama4 scales each routed expert's *input* by its sigmoid
    router score (so its experts module takes only the pre-scaled tokens); here each (token,
    expert) pair is one row scaled on input, and a token's k rows are summed. The block's router
    and shared expert are kept. forward(hidden_states (..., H)) -> ((T, H), router_logits (T, E))."""

    def __init__(self, block: nn.Module, expert_parallel: ExpertParallel | None = None) -> None:
        super().__init__()
        self.top_k, self.hidden_dim = block.top_k, block.hidden_dim
        self.router, self.shared_expert = block.router, block.shared_expert
        self.experts = TmoeExperts(block.experts, expert_parallel)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, self.hidden_dim)  # [T, H]
        router_scores, router_logits = self.router(x)  # [T, E]: sigmoid(logit) on the top k, 0 elsewhere
        top_k_index = torch.topk(router_logits, self.top_k, dim=1).indices  # the router's own top k
        top_k_weights = router_scores.gather(1, top_k_index)  # [T, k]
        t, k = top_k_index.shape
        rows = x.unsqueeze(1).expand(t, k, self.hidden_dim).reshape(t * k, self.hidden_dim)  # [T*k, H]
        routed = self.experts.run(rows, top_k_index.reshape(-1, 1), top_k_weights.reshape(-1, 1), True)
        out = self.shared_expert(x)
        out.add_(routed.view(t, k, self.hidden_dim).sum(1))
        return out, router_logits


class TmoeMxfp4GptOssMLP(nn.Module):
    """transformers' ``Mxfp4GptOssMLP`` on tmoe: that block hands its experts triton_kernels routing
    data (``forward_routed``), so the block is replaced around its own router, whose softmax over
    the top-k logits is the same routing. forward(hidden_states (B, S, H)) -> ((B, S, H), router_logits (T, E))."""

    def __init__(self, block: nn.Module, expert_parallel: ExpertParallel | None = None) -> None:
        super().__init__()
        self.router = block.router
        self.experts = TmoeExperts(block.experts, expert_parallel)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, hidden_dim = hidden_states.shape[0], self.router.hidden_dim
        x = hidden_states.reshape(-1, hidden_dim)
        router_logits, router_scores, router_indices = self.router(x)
        out = self.experts(x, router_indices, router_scores)
        return out.reshape(batch_size, -1, hidden_dim), router_logits
