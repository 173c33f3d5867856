"""The environment probe (``atomr probe``), the device preflight, and zero-config Gemma.

    from atomr_infer.provision import probe, require_device, GemmaDefaults, provision_if_ready
    report = probe.probe("google/gemma-4-E4B-it")

The function ``probe`` is not re-exported here: under that name it would hide the module
``atomr_infer.provision.probe`` (``import atomr_infer.provision.probe as m`` would yield the function).
"""

from atomr_infer.provision.facts import GpuFacts, GpuInfo, HfCacheInfo, RayInfo, VllmInfo
from atomr_infer.provision.gemma import (
    ALLOWED_MODELS,
    VARIANTS,
    GemmaDefaults,
    GemmaVariant,
    Ready,
    Skipped,
    provision_if_ready,
)
from atomr_infer.provision.preflight import require_device
from atomr_infer.provision.probe import Check, ProbeEnv, ProbeReport

__all__ = [
    "ALLOWED_MODELS",
    "VARIANTS",
    "Check",
    "GemmaDefaults",
    "GemmaVariant",
    "GpuFacts",
    "GpuInfo",
    "HfCacheInfo",
    "ProbeEnv",
    "ProbeReport",
    "RayInfo",
    "Ready",
    "Skipped",
    "VllmInfo",
    "provision_if_ready",
    "require_device",
]
