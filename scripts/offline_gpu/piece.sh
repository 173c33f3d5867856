#!/usr/bin/env bash
# One piece: move it where the extractor reads it, then mark it complete.
set -eu
mv ".gpuc/p/$1" "/tmp/pcs/$1" && touch "/tmp/pcs/$1.ok"
echo "piece $1 in; $(ls /tmp/pcs | wc -l) files waiting; $(cat /tmp/uninstall.log 2>/dev/null | tail -1)"
