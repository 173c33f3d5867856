"""Refuse a deployment this host and cluster cannot run, before anything is started.

``device: cuda`` needs a usable CUDA GPU here or in a reachable Ray cluster. ``device: cpu``
always passes, and so does ``device: auto``: it resolves to ``cpu`` when there is no GPU (as
``engine.device.resolve_device`` does), so a spec that wants a GPU must say ``cuda``.
Whether there are *enough* GPUs, and enough memory on them, is the manager's budget check.
"""

from __future__ import annotations

import functools

from atomr_infer.errors import DeviceUnavailable
from atomr_infer.provision.facts import gather_ray
from atomr_infer.provision.probe import ProbeEnv, ProbeReport, probe
from atomr_infer.spec import Deployment


def require_device(
    deployment: Deployment, report: ProbeReport | None = None, *, env: ProbeEnv | None = None,
    address: str | None = None,
) -> None:
    """Raise ``DeviceUnavailable`` (with the probe's reason and a hint) when ``deployment`` needs
    CUDA and no usable GPU can be had. ``report``: a probe already taken; otherwise only the GPU
    and Ray facts are gathered, Ray's from the cluster at ``address`` (default: the one atomr
    joins); ``env`` fakes them in tests."""
    if deployment.device != "cuda":
        return
    if report is None or report.gpu is None:
        if env is None:
            env = ProbeEnv(ray=functools.partial(gather_ray, address))
        report = probe(env=env, sections=("gpu", "ray"))
    if report.gpu_available:
        return
    raise DeviceUnavailable(deployment.name, f"device is 'cuda' but there is {report.no_gpu_reason}")
