"""``lora:`` on a deployment: LoRA adapters of its base model, served by every replica.

    lora:
      adapters:                  # name -> a PEFT adapter: an absolute path, or an HF repo id
        french: /srv/adapters/smollm2-french
        sql: acme/smollm2-sql-lora     # fetched into the hub cache by each replica, as models are
      max_loras: 2               # vLLM's: adapters in one batch
      max_lora_rank: 16          # vLLM's: the largest rank it allocates for
      max_cpu_loras: 4           # vLLM's: adapters cached in host memory

A request names an adapter as ``"<deployment>:<adapter>"`` (or the adapter's bare name where no
other deployment has one of that name). Turning LoRA on or changing vLLM's limits is an engine
setting (a rolling restart); adding, changing or removing adapters is not: every replica loads
or unloads them while it serves (spec/hashing.py keeps ``lora.adapters`` out of what restarts).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, StrictInt, StrictStr, field_validator, model_validator

from atomr_infer.models.registry import HF_REPO_ID_RE
from atomr_infer.spec.base import FieldValueError, Strict, int_choice

ADAPTER_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9_.]{0,62}[a-z0-9])?$")
# The ranks vLLM allocates for (its MaxLoRARanks, vllm/config/lora.py); kept here so that the
# manager checks a spec without importing vLLM (a unit test compares the two).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class Lora(Strict):
    """LoRA adapters of the deployment's model, and vLLM's limits for them."""

    adapters: dict[StrictStr, StrictStr] = Field(
        default_factory=dict,
        description="Adapter name -> a PEFT adapter: an absolute path or a Hugging Face repo id; changed in place."
    )
    max_loras: Annotated[StrictInt, Field(ge=1, le=256)] | None = Field(
        None, description="Adapters in one batch (vLLM's max_loras, default 1)."
    )
    max_lora_rank: int_choice(*MAX_LORA_RANKS) | None = Field(  # type: ignore[valid-type]
        None, description="The largest adapter rank served (vLLM's max_lora_rank, default 16): 1, 8, 16, 32, 64, "
        "128, 256, 320 or 512."
    )
    max_cpu_loras: Annotated[StrictInt, Field(ge=1, le=4096)] | None = Field(
        None, description="Adapters cached in host memory (vLLM's max_cpu_loras, default max_loras)."
    )

    @field_validator("adapters")
    @classmethod
    def _names_and_sources(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name, source in adapters.items():
            if not ADAPTER_NAME_RE.fullmatch(name):
                raise ValueError(
                    f"{name!r} is not a valid adapter name: use 1-64 lowercase letters, digits, '-', '_' and '.'"
                )
            # Absolute: the spec is read by the manager and the replicas, on other nodes and in
            # other directories than the file it came from.
            if not source.startswith(("/", "~")) and not ("/" in source and HF_REPO_ID_RE.fullmatch(source)):
                raise ValueError(
                    f"adapter {name!r}: {source!r} is neither an absolute path of a local directory "
                    "nor a Hugging Face repo id (org/name)"
                )
        return adapters

    @model_validator(mode="after")
    def _cache_holds_a_batch(self) -> Lora:
        if self.max_cpu_loras is not None and self.max_cpu_loras < (self.max_loras or 1):
            raise FieldValueError(
                "max_cpu_loras", f"{self.max_cpu_loras} is below max_loras ({self.max_loras or 1}): vLLM refuses it"
            )
        return self
