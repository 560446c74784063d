"""A tag of tmoe's op sources in torch.compile's cache keys.

Torch's compile caches (AOTAutograd's and Inductor's) key a graph on what dynamo captured: the
forward. The backward that the layer op's autograd formula traces into the same compiled
artifact, and the schemas of the backward ops it calls, are not part of the key. After an upgrade
that changed them, a warm cache would replay a backward calling ``tmoe::moe_grad_*`` by their old
schemas (a RuntimeError at the first backward). Appending a digest of this package's sources to
``torch.compiler.config.cache_key_tag`` makes a changed tmoe miss the cache instead; other
libraries' entries in the tag are kept.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def ops_digest(root: Path = Path(__file__).parent) -> str:
    """16 hex digits of SHA-256 over ``root/*.py`` (tmoe/ops: the op schemas, fakes and autograd formulas)."""
    sha = hashlib.sha256()
    for path in sorted(root.glob("*.py")):
        sha.update(path.name.encode())
        sha.update(path.read_bytes())
    return sha.hexdigest()[:16]


def tag_compile_caches() -> str | None:
    """Append ``tmoe-ops-<digest>`` to torch.compile's cache key tag (once); returns the tag (None on
    a torch without the setting)."""
    tag = f"tmoe-ops-{ops_digest()}"
    config = torch.compiler.config
    if getattr(config, "cache_key_tag", None) is None:
        return None
    if tag not in config.cache_key_tag.split("|"):
        config.cache_key_tag = f"{config.cache_key_tag}|{tag}" if config.cache_key_tag else tag
    return tag
