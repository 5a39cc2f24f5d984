#!/usr/bin/env bash
# A-vs-A trials of the commit gate on a loaded machine: HOGS CPU-bound processes run beside TRIALS
# `moebench check --against HEAD check-against --on-inconclusive warn` (the gate CI runs, on identical
# code), one line per trial: exit code, seconds, load at start and end, timeouts, retries, the summary.
#   bash scripts/gate_at_load.sh [TRIALS=4] [HOGS=4] [OUT=gate-at-load]   (run from a clean checkout)
set -uo pipefail
trials="${1:-4}"; hogs="${2:-4}"; out="${3:-gate-at-load}"
mkdir -p "$out"
pids=()
for _ in $(seq "$hogs"); do python3 -c "while True: pass" & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
for t in $(seq "$trials"); do
    start=$SECONDS; l0=$(cut -d' ' -f1 /proc/loadavg)
    moebench check --against HEAD check-against --on-inconclusive warn >"$out/t$t.out" 2>"$out/t$t.err"
    rc=$?
    echo "trial $t rc $rc seconds $((SECONDS - start)) load $l0 -> $(cut -d' ' -f1 /proc/loadavg)" \
         "timeouts $(grep -c 'timeout' "$out/t$t.err") retries $(grep -c 'trying each once more' "$out/t$t.err")" \
         "| $(tail -1 "$out/t$t.out")"
done
