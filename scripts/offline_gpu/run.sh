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
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
while [ ! -f /tmp/extract.rc ]; do
  [ "$(left)" -gt 0 ] || { echo "extractor not done in ${LIMIT}s"; tail -3 /tmp/extract.log; exit 124; }
  sleep 0.5
done
RC=$(cat /tmp/extract.rc)
echo "extracted (rc $RC) after waiting $(( $(date +%s) - T0 ))s"
[ "$RC" = "0 0 0" ] || { tail /tmp/uninstall.log /tmp/extract.log; exit 1; }
$PYH -m pip install -q --no-deps --no-build-isolation --no-index -e . > /tmp/install.log 2>&1 || tail /tmp/install.log
if ! $PYH -c "import torch" 2> /tmp/torch.err; then
  grep -o "undefined symbol: [a-zA-Z]*" /tmp/torch.err | head -1
  printf 'int %s(void){return 5;}\n' ncclCommSuspend ncclCommResume ncclCommMemStats ncclPutSignal ncclSignal \
    ncclWaitSignal ncclGetLsaMultimemDevicePointer ncclGetPeerDevicePointer > /tmp/ncclstub.c
  gcc -shared -fPIC -o /tmp/ncclstub.so /tmp/ncclstub.c && export LD_PRELOAD=/tmp/ncclstub.so && echo "NCCL stub preloaded"
fi
$PYH -c "import torch, vllm, ray; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'vllm', vllm.__version__, 'ray', ray.__version__)" || exit 1
L=$(left)
[ "$L" -gt 0 ] || { echo "no time left of ${LIMIT}s"; exit 124; }   # timeout 0 would mean no limit
timeout -k 10 "$L" "$@"
