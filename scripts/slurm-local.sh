#!/usr/bin/env bash
# Start a Slurm cluster of NODES compute nodes (default 2) on this machine, to try
# `moebench run SUITE --slurm [--nodes 2]` locally (and for the Slurm integration tests).
# Debian/Ubuntu, as root. Safe to run again: installed packages, the munge key and running
# daemons are reused; a different NODES rewrites slurm.conf and restarts the daemons.
#
#   scripts/slurm-local.sh [NODES]
#
# Installs slurm-wlm + munge with apt-get when missing, writes a munge key and a slurm.conf
# (SlurmUser root, proctrack/linuxproc, task/none, select/cons_tres, nodes n1..nNODES each
# with this machine's CPUs, one partition "local"), starts munged, slurmctld and one slurmd
# per node, and waits until `sinfo` shows every node idle. Every wait is bounded; it fails
# instead of hanging.
#
# The nodes are several slurmd daemons on this host (`slurmd -N nK`, each on its own port,
# all at 127.0.0.1): Debian's slurm-wlm is built with --enable-multiple-slurmd
# (`scontrol show config` says MULTIPLE_SLURMD = Yes). Jobs, srun steps and rendezvous
# between the nodes are real; the nodes just share this host's CPUs and hostname.
set -euo pipefail

SLURM_ETC=/etc/slurm
CONF="$SLURM_ETC/slurm.conf"
HOST="$(hostname -s)"
LOGDIR=/var/log/slurm
WAIT_S="${SLURM_LOCAL_WAIT_S:-60}"
NODES="${1:-2}"
FIRST_PORT=6819  # n1's slurmd, n2's is the next one...; slurmctld keeps its default 6817

say() { echo "slurm-local: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts daemons)"
case "$NODES" in ''|*[!0-9]*|0) die "NODES must be a whole number >= 1, got '$NODES'" ;; esac
START_S=$SECONDS

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
    || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || die "slurm-wlm and munge are missing and apt-get is not available"
    say "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 apt-get update -qq || say "apt-get update failed; trying the cached package lists"
    timeout 900 apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null \
        || die "apt-get install slurm-wlm munge failed"
fi

# ---------------------------------------------------------------- munge
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    say "writing a munge key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! timeout 10 munge -n </dev/null 2>/dev/null | timeout 10 unmunge >/dev/null 2>&1; then
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged --force </dev/null >>/var/log/munge/start.log 2>&1
    for _ in $(seq 1 "$WAIT_S"); do
        timeout 10 munge -n </dev/null 2>/dev/null | timeout 10 unmunge >/dev/null 2>&1 && break
        sleep 1
    done
    timeout 10 munge -n </dev/null | timeout 10 unmunge >/dev/null || die "munged did not come up"
fi

# ---------------------------------------------------------------- slurm.conf
install -d -m 0755 "$SLURM_ETC" "$LOGDIR" /var/spool/slurmctld /var/spool/slurmd
# `slurmd -C` reports this host's real CPUs/sockets/memory, so no node ever drains for
# claiming more than it has (every node claims all of them: they share the host).
HARDWARE="$(timeout 30 slurmd -C | head -n1 | sed -E 's/^NodeName=[^ ]+ //; s/ UpTime=.*//')"
[ -n "$HARDWARE" ] || die "slurmd -C printed nothing"
NODE_LINES=""
for k in $(seq 1 "$NODES"); do
    NODE_LINES+="NodeName=n$k NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((FIRST_PORT + k - 1)) $HARDWARE State=UNKNOWN"$'\n'
done
WANT_CONF="$(cat <<EOF
# Written by moebench scripts/slurm-local.sh: $NODES node(s) on one host, for local testing.
ClusterName=moebench-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
${NODE_LINES%$'\n'}
PartitionName=local Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
)"
if [ "$(cat "$CONF" 2>/dev/null)" != "$WANT_CONF" ]; then
    say "writing $CONF ($NODES node(s))"
    printf '%s\n' "$WANT_CONF" > "$CONF"
    RESTART=1
else
    RESTART=0
fi

# ---------------------------------------------------------------- daemons
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop() {  # stop the daemon of a pid file and wait (bounded) until it is gone
    running "$1" || return 0
    local pid
    pid="$(cat "$1")"
    kill "$pid"
    for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
}
CTLD_FLAGS=()
if [ "$RESTART" = 1 ]; then
    # /run/slurmd.pid: the one slurmd of an older single-node set-up
    for pidfile in /run/slurmd.pid /run/slurmd-*.pid /run/slurmctld.pid; do
        [ -e "$pidfile" ] && stop "$pidfile"
    done
    CTLD_FLAGS=(-c)  # the node set changed: start clean, not from jobs and nodes saved under the old one
fi
# Daemons get no handle on our stdout/stderr: a caller reading our output through a pipe
# (CI) must see EOF when this script ends.
running /run/slurmctld.pid || { say "starting slurmctld"; slurmctld "${CTLD_FLAGS[@]}" </dev/null >>"$LOGDIR/start.log" 2>&1; }
for k in $(seq 1 "$NODES"); do
    install -d -m 0755 "/var/spool/slurmd/n$k"
    running "/run/slurmd-n$k.pid" || { say "starting slurmd n$k"; slurmd -N "n$k" </dev/null >>"$LOGDIR/start.log" 2>&1; }
done

up=0
states=""
for i in $(seq 1 "$WAIT_S"); do
    states="$(timeout 10 sinfo -h -N -p local -o '%N %T' 2>/dev/null || true)"
    up="$(awk '$2 == "idle" || $2 == "mixed" || $2 == "allocated"' <<<"$states" | wc -l)"
    if [ "$up" -ge "$NODES" ]; then
        say "$NODES node(s) up after $((SECONDS - START_S))s: $(tr '\n' ' ' <<<"$states")"
        exit 0
    fi
    if [ $((i % 5)) = 1 ]; then  # nodes an earlier run left down or drained come back
        for node in $(awk '$2 ~ /^(down|drain|fail)/ {print $1}' <<<"$states"); do
            timeout 10 scontrol update nodename="$node" state=resume 2>/dev/null || true
        done
    fi
    sleep 1
done
say "only $up of $NODES node(s) became idle within ${WAIT_S}s; see $LOGDIR/"
tr '\n' ' ' <<<"$states" >&2
tail -n 20 "$LOGDIR/slurmctld.log" "$LOGDIR"/slurmd-n*.log >&2 2>/dev/null || true
exit 1
