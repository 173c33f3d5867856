"""Model resolution: HF repo ids, local directories and bundled models; size estimates.

Importing this package stays light (no torch, transformers or huggingface_hub): the spec
validator imports ``registry`` through it.
"""

from atomr_infer.models.bundled import cache_root, prepare_bundled
from atomr_infer.models.estimate import kv_cache_bytes_per_token, weights_bytes
from atomr_infer.models.registry import BUNDLED_MODELS, BUNDLED_PREFIX, BundledModel, bundled_name
from atomr_infer.models.resolve import ResolvedModel, hub_cache_dir, is_cached, resolve_model

__all__ = [
    "BUNDLED_MODELS",
    "BUNDLED_PREFIX",
    "BundledModel",
    "ResolvedModel",
    "bundled_name",
    "cache_root",
    "hub_cache_dir",
    "is_cached",
    "kv_cache_bytes_per_token",
    "prepare_bundled",
    "resolve_model",
    "weights_bytes",
]
