"""tmoe in Hugging Face ``transformers`` (5.x).

Importing this module registers ``"tmoe"`` in transformers' experts registry
(``tmoe.integrations.hf_registry``): ``from_pretrained(..., experts_implementation="tmoe")``,
``from_config(...)`` and ``model.set_experts_implementation("tmoe")`` then run every experts class
that carries ``@use_experts_implementation`` on tmoe, for inference and training; and in its FP8
experts registry (``tmoe.integrations.hf_fp8``): fine-grained fp8 checkpoints run tmoe's block-fp8
layer, for inference.

``set_batch_invariant(model, True)`` (or ``replace_moe_blocks(..., batch_invariant=True)``) runs the
model's tmoe experts in the batch-invariant mode: a token's MoE output is the same bits in
``generate`` at any batch size and in the training forward (``docs/huggingface.md``).

``replace_moe_blocks`` covers what the registry does not (families without the decorator, fused
router blocks) by swapping modules in place, for inference. ``SUPPORTED_EXPERTS``
(in ``tmoe.integrations.hf_experts``) lists the classes tmoe runs and how each is laid out. The
swap keeps each model's own router and shared experts, so routing is unchanged, and replaces
only the routed expert computation with ``FusedMoEModularKernel``. Llama4, whose experts take
router-scaled inputs rather than routing tensors, has its MoE block replaced around its own
router and shared expert, as has GPT-OSS loaded in mxfp4 (``Mxfp4GptOssMLP`` routes with
triton_kernels), whose experts stay packed. transformers older than 5.15 (4.x: experts as ``nn.ModuleList``) is refused.
"""
from __future__ import annotations

import importlib

import re
import warnings

import transformers
from torch import nn

from tmoe import ExpertParallel
from tmoe.integrations.hf_experts import (
    SUPPORTED_EXPERTS, TmoeExperts, TmoeLlama4TextMoe, TmoeMxfp4GptOssMLP, unsupported_reason,
)
from tmoe.integrations.hf_fp8 import register as register_fp8
from tmoe.fused import optional_bool
from tmoe.integrations.hf_registry import BATCH_INVARIANT, register

register()
register_fp8()

__all__ = ["SUPPORTED_EXPERTS", "TmoeExperts", "TmoeLlama4TextMoe", "TmoeMxfp4GptOssMLP", "replace_moe_blocks",
           "set_batch_invariant"]
# The oldest release on which tests/integrations/test_transformers.py found every supported family it ships either
# matching stock or refused with a reason (run on 5.15.1 to 5.25.0). Older: 5.0 passes PhiMoE and
# HunYuan-MoE experts dense (T, E) routing weights; 4.x keeps experts as per-expert modules.
MIN_TRANSFORMERS = (5, 15)


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``5.25.0`` or ``5.16.0.dev0``."""
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def _looks_like_experts(name: str, module: nn.Module) -> bool:
    """Routed experts: a ``*Experts`` class, or a container of per-expert MLPs named ``experts``
    (transformers 4.x); shared experts (``shared_expert*`` attributes) stay the model's own, and
    experts swapped by an earlier call are left as they are."""
    attr = name.rpartition(".")[2]
    if attr.startswith("shared") or isinstance(module, TmoeExperts):
        return False
    return type(module).__name__.endswith("Experts") or (
        attr == "experts" and isinstance(module, (nn.ModuleList, nn.ModuleDict)))


def set_batch_invariant(model: nn.Module, enabled: bool | None = True) -> int:
    """Run ``model``'s experts in tmoe's batch-invariant mode (True), never (False), or as
    ``tmoe.batch_invariant()`` / ``TMOE_BATCH_INVARIANT`` say at each call (None); returns how many
    experts modules it set. Covers the registry's experts (``experts_implementation="tmoe"``) and
    the modules ``replace_moe_blocks`` swapped in."""
    enabled = optional_bool("enabled", enabled)
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, TmoeExperts):
            module.set_batch_invariant(enabled)
        elif _looks_like_experts(name, module):
            setattr(module, BATCH_INVARIANT, enabled)
        else:
            continue
        count += 1
    return count


def _swap(model: nn.Module, name: str, module: nn.Module, expert_parallel: ExpertParallel | None,
          batch_invariant: bool | None) -> None:
    parent = name.rpartition(".")[0]
    if type(module).__name__ == "Llama4TextExperts":  # the block, not the experts, takes the routing
        name, module, make = parent, model.get_submodule(parent), TmoeLlama4TextMoe
    elif parent and type(model.get_submodule(parent)).__name__ == "Mxfp4GptOssMLP":  # it routes with triton_kernels
        name, module, make = parent, model.get_submodule(parent), TmoeMxfp4GptOssMLP
    else:
        make = TmoeExperts
    parent_name, _, child = name.rpartition(".")
    swapped = make(module, expert_parallel)
    if batch_invariant is not None:
        set_batch_invariant(swapped, batch_invariant)
    setattr(model.get_submodule(parent_name) if parent_name else model, child, swapped)


def _report(model: nn.Module, left: dict[str, list[str]]) -> str:
    supported = ", ".join(sorted(SUPPORTED_EXPERTS))
    if not left:
        return (f"replace_moe_blocks: {type(model).__name__} has no MoE experts modules (no *Experts class and no "
                f"'experts' ModuleList); nothing was replaced. tmoe supports: {supported}")
    lines = [f"  {why} ({len(names)}x, e.g. {names[0]})" for why, names in left.items()]
    return ("replace_moe_blocks could not replace these experts modules:\n" + "\n".join(lines)
            + f"\ntmoe supports: {supported}")


def replace_moe_blocks(model: nn.Module, strict: bool = False, expert_parallel: ExpertParallel | None = None,
                       batch_invariant: bool | None = None) -> int:
    """Replace every supported experts module of ``model`` in place; returns how many.

    Every routed-experts module left in place (an unknown class, a 4.x ``ModuleList``, an
    activation or clamp tmoe lacks) is named in one warning with the reason, as is a model
    without MoE layers; ``strict=True`` raises ValueError instead. Raises RuntimeError on
    transformers older than ``MIN_TRANSFORMERS`` (4.x stores experts as per-expert modules).
    ``expert_parallel`` (``tmoe.ExpertParallel``): every swapped module keeps only this rank's
    experts (its placement) and runs the mode's expert-parallel kernel (Llama4, which scales
    inputs by router weight, needs mode "allgather"). ``batch_invariant``: the swapped modules' mode
    (``set_batch_invariant``; None: the context's at each call). Example::

        model = transformers.AutoModelForCausalLM.from_pretrained("allenai/OLMoE-1B-7B-0924")
        replace_moe_blocks(model, strict=True)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    installed = importlib.import_module("transformers").__version__  # the live module: loading can re-register it
    if _version(installed) < MIN_TRANSFORMERS:
        raise RuntimeError(f"replace_moe_blocks needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}; "
                           f"found {installed}")
    targets, left = [], {}
    for name, module in model.named_modules():
        if not _looks_like_experts(name, module):
            continue
        why = unsupported_reason(module)
        if why is None:
            targets.append((name, module))
        else:
            left.setdefault(f"{type(module).__name__}: {why}", []).append(name)
    swapped_before = any(isinstance(m, TmoeExperts) for m in model.modules())
    if left or not (targets or swapped_before):
        if strict:
            raise ValueError(_report(model, left))
        warnings.warn(_report(model, left), stacklevel=2)
    for name, module in targets:
        _swap(model, name, module, expert_parallel, optional_bool("batch_invariant", batch_invariant))
    return len(targets)
