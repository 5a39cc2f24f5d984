#!/usr/bin/env bash
# Start a single-node Slurm cluster on this machine, to try `moebench run SUITE --slurm`
# locally (and for the Slurm integration test). Debian/Ubuntu, as root. Safe to run again:
# installed packages, the munge key and running daemons are reused.
#
# Installs slurm-wlm + munge with apt-get when missing, writes a munge key and a slurm.conf
# (SlurmUser root, proctrack/linuxproc, task/none, select/cons_tres, one node with this
# machine's CPUs, one partition "local"), starts munged, slurmctld and slurmd, and waits
# until `sinfo` shows the node idle. Every wait is bounded; it fails instead of hanging.
set -euo pipefail

SLURM_ETC=/etc/slurm
CONF="$SLURM_ETC/slurm.conf"
HOST="$(hostname -s)"
LOGDIR=/var/log/slurm
WAIT_S="${SLURM_LOCAL_WAIT_S:-60}"

say() { echo "slurm-local: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts daemons)"

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
# `slurmd -C` reports this node's real CPUs/sockets/memory, so the node never drains for
# claiming more than it has.
NODE_LINE="$(timeout 30 slurmd -C | head -n1 | sed -E 's/ UpTime=.*//')"
[ -n "$NODE_LINE" ] || die "slurmd -C printed nothing"
WANT_CONF="$(cat <<EOF
# Written by moebench scripts/slurm-local.sh: a single-node cluster for local testing.
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
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
$NODE_LINE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
)"
if [ "$(cat "$CONF" 2>/dev/null)" != "$WANT_CONF" ]; then
    say "writing $CONF"
    printf '%s\n' "$WANT_CONF" > "$CONF"
    RESTART=1
else
    RESTART=0
fi

# ---------------------------------------------------------------- daemons
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$RESTART" = 1 ]; then
    for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
        if running "$pidfile"; then kill "$(cat "$pidfile")"; sleep 1; fi
    done
fi
# Daemons get no handle on our stdout/stderr: a caller reading our output through a pipe
# (CI) must see EOF when this script ends.
running /run/slurmctld.pid || { say "starting slurmctld"; slurmctld </dev/null >>"$LOGDIR/start.log" 2>&1; }
running /run/slurmd.pid || { say "starting slurmd"; slurmd </dev/null >>"$LOGDIR/start.log" 2>&1; }

state=""
for i in $(seq 1 "$WAIT_S"); do
    state="$(timeout 10 sinfo -h -n "$HOST" -o '%T' 2>/dev/null | head -n1 || true)"
    case "$state" in
        idle|mixed|allocated) say "node $HOST is $state"; exit 0 ;;
        down*|drain*|fail*)
            [ $((i % 5)) = 1 ] && timeout 10 scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
done
say "node $HOST did not become idle within ${WAIT_S}s (state: ${state:-unknown}); see $LOGDIR/"
tail -n 20 "$LOGDIR/slurmctld.log" "$LOGDIR/slurmd.log" >&2 2>/dev/null || true
exit 1
