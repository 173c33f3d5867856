#!/usr/bin/env bash
# Last call: wait for the extractor, install the project, preload an NCCL stub where the host's
# NCCL lacks what torch 2.13 links against, then run the command given, within SECONDS.
#
#   bash .gpuc/host/run.sh SECONDS COMMAND...   e.g. 500 scripts/gpu_smoke.sh --device cuda
set -u
LIMIT=$1; shift
PYH=/opt/torch/.venv/bin/python3
export PY=$PYH PATH=/opt/torch/.venv/bin:$PATH PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$(date +%s)
while [ ! -f /tmp/extract.rc ]; do sleep 0.5; done
echo "extracted (rc $(cat /tmp/extract.rc)) after waiting $(( $(date +%s) - T0 ))s"
$PYH -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || tail /tmp/install.log
if ! $PYH -c "import torch" 2> /tmp/torch.err; then
  grep -o "undefined symbol: [a-zA-Z]*" /tmp/torch.err | head -1
  printf 'int %s(void){return 5;}\n' ncclCommSuspend ncclCommResume ncclCommMemStats ncclPutSignal ncclSignal \
    ncclWaitSignal ncclGetLsaMultimemDevicePointer ncclGetPeerDevicePointer > /tmp/ncclstub.c
  gcc -shared -fPIC -o /tmp/ncclstub.so /tmp/ncclstub.c && export LD_PRELOAD=/tmp/ncclstub.so && echo "NCCL stub preloaded"
fi
$PYH -c "import torch, vllm, ray; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'vllm', vllm.__version__, 'ray', ray.__version__)"
timeout -k 10 $(( LIMIT - ($(date +%s) - T0) )) "$@"
