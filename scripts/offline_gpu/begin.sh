#!/usr/bin/env bash
# First call (bash .gpuc/host/begin.sh PIECES, carrying .gpuc/host and .gpuc/p/00): note the host,
# start a detached extractor that uninstalls the host's copies of the
# packages we bring, then unpacks the pieces (one xz stream) into the venv as they arrive.
set -u
N=$1   # number of pieces
PYH=/opt/torch/.venv/bin/python3
VENV=$($PYH -c 'import sys; print(sys.prefix)')
echo "venv $VENV; $($PYH -V); $(ls -d $VENV/lib/python3*/site-packages)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc; free -g | head -2; df -h /tmp | tail -1; which gcc cc nvcc
# A rerun on a warm host: stop the earlier extractor and drop its markers (stale .ok files and
# extract.rc would feed it missing pieces and let run.sh start at once).
[ -f /tmp/extract.pid ] && kill -- -"$(cat /tmp/extract.pid)" 2>/dev/null
rm -rf /tmp/pcs /tmp/extract.rc /tmp/extract.pid /tmp/uninstall.log
mkdir -p /tmp/pcs
bash .gpuc/host/piece.sh 00 || exit 1
cat > /tmp/extract.sh <<EOS
set -x
$PYH -m pip uninstall -y -q \$(cat $PWD/.gpuc/host/names.txt) torchvision torchaudio torchcodec > /tmp/uninstall.log 2>&1
echo "uninstall rc \$?" >> /tmp/uninstall.log
for i in \$(seq 0 $((N-1)) | xargs printf "%02d "); do
  while [ ! -f /tmp/pcs/\$i.ok ]; do sleep 0.2; done
  cat /tmp/pcs/\$i; rm -f /tmp/pcs/\$i
done | xz -dc -T0 | tar -x -C $VENV
echo "\${PIPESTATUS[@]}" > /tmp/extract.rc.tmp; mv /tmp/extract.rc.tmp /tmp/extract.rc
EOS
setsid nohup bash /tmp/extract.sh > /tmp/extract.log 2>&1 < /dev/null &
echo $! > /tmp/extract.pid
echo "extractor started"
