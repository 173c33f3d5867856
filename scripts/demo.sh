#!/usr/bin/env bash
# `make demo`: SmolLM2 on a local Ray, one question streamed, the status table; it keeps running.
# Runs after `make setup`. Each step prints the command it runs, so the output reads like a
# terminal session you can repeat by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

ATOMR="${ATOMR_VENV:-.venv}/bin/atomr"
QUESTION="What is the capital of France?"
if [[ ! -x "$ATOMR" ]]; then
  echo "error: $ATOMR not found (hint: make setup)" >&2
  exit 1
fi
if [[ -t 1 ]]; then bold=$'\e[1m' dim=$'\e[2m' off=$'\e[0m'; else bold="" dim="" off=""; fi
step() { printf '\n%s$ atomr %s%s\n' "$bold" "$*" "$off"; }

step "up --no-gemma"
"$ATOMR" up --no-gemma

step "deploy deployments/smollm2.yaml"
"$ATOMR" deploy deployments/smollm2.yaml

step "chat smollm2 \"$QUESTION\""
"$ATOMR" chat smollm2 "$QUESTION"

step "status"
"$ATOMR" status

cat <<EOF

${bold}smollm2 keeps running.${off} Try:
  $ATOMR chat smollm2                  ${dim}# a conversation; Ctrl-C stops an answer, Ctrl-D leaves${off}
  $ATOMR logs smollm2
  $ATOMR serve                         ${dim}# OpenAI-compatible HTTP API on 127.0.0.1:8000${off}
When you are done:
  $ATOMR down                          ${dim}# removes the deployment and stops the local Ray${off}
EOF
