"""The vLLM backend over the emulated engine, for a spec served where ``ATOMR_EMULATED_STEP_MS``
is set (engine/device.py): the replica runs as for a real engine (vLLM's serving layer, the
step loop, the router's transport) while a core that computes nothing keeps GPU time."""

from __future__ import annotations

from typing import Any

from atomr_infer.engine.backend import BackendContext
from atomr_infer.engine.device import emulated_step_s
from atomr_infer.engine.vllm.backend import VllmBackend
from atomr_infer.spec import Deployment


def _emulated_engine(deployment: Deployment, progress: Any) -> Any:
    """The spec's model resolved as for a real engine, then the emulated engine's factory."""
    from atomr_infer.engine.vllm.emulated import emulated_engine_factory
    from atomr_infer.models.resolve import resolve_for

    step_s = emulated_step_s() or 0.01  # set: the backend is only chosen where it is
    resolved = resolve_for(deployment, progress=progress)
    max_len = deployment.runtime_config.max_model_len or 2048
    return emulated_engine_factory(str(resolved.path), step_s, max_model_len=max_len)(deployment, progress)


class EmulatedVllmBackend(VllmBackend):
    def __init__(self, context: BackendContext) -> None:
        super().__init__(context, _emulated_engine)
