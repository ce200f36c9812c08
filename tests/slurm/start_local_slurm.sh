#!/usr/bin/env bash
# A one-node Slurm cluster on localhost, for testing sbatch scripts for real.
#
#   tests/slurm/start_local_slurm.sh [STATE_DIR]        start (idempotent); prints STATE_DIR
#   tests/slurm/start_local_slurm.sh --stop [STATE_DIR] stop the daemons it started
#
# Then point Slurm's commands at it:  export SLURM_CONF=STATE_DIR/slurm.conf
# Needs root and: apt-get install -y --no-install-recommends slurm-wlm munge
# STATE_DIR defaults to $RLCLI_SLURM_DIR or /tmp/rlcli-slurm; keep it short (slurmd puts a unix
# socket under it).
set -euo pipefail

stop=0
if [[ "${1:-}" == "--stop" ]]; then
    stop=1
    shift
fi
state_dir=${1:-${RLCLI_SLURM_DIR:-/tmp/rlcli-slurm}}
conf="$state_dir/slurm.conf"

pid_alive() { [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null; }
read_pid() { cat "$1" 2>/dev/null || true; }

stop_pids() {
    # The pids were read before signalling: the daemons delete their pidfiles on exit.
    local pid waited
    for pid in "$@"; do
        pid_alive "$pid" && kill -TERM "$pid"
    done
    for pid in "$@"; do
        waited=0
        while pid_alive "$pid" && ((waited < 100)); do
            sleep 0.1
            waited=$((waited + 1))
        done
        pid_alive "$pid" && kill -KILL "$pid"
    done
    return 0
}

if ((stop)); then
    slurmctld_pid=$(read_pid "$state_dir/run/slurmctld.pid")
    slurmd_pid=$(read_pid "$state_dir/run/slurmd.pid")
    # munged only if this script started it (its pid was recorded then).
    munged_pid=$(read_pid "$state_dir/run/munged.pid")
    stop_pids $slurmd_pid $slurmctld_pid
    stop_pids $munged_pid
    rm -f "$state_dir/run/munged.pid"
    exit 0
fi

for program in slurmctld slurmd munged; do
    if ! command -v "$program" >/dev/null; then
        echo "$program is not installed: apt-get install -y --no-install-recommends slurm-wlm munge" >&2
        exit 3
    fi
done
mkdir -p "$state_dir"/{state,spool,log,run}

# munged refuses to run as root; it needs its key and its socket directory.
if ! munge -n </dev/null >/dev/null 2>&1; then
    [[ -f /etc/munge/munge.key ]] || runuser -u munge -- mungekey --create
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- munged
    for _ in $(seq 50); do
        munge -n </dev/null >/dev/null 2>&1 && break
        sleep 0.1
    done
    read_pid /run/munge/munged.pid >"$state_dir/run/munged.pid"
fi

slurmctld_pid=$(read_pid "$state_dir/run/slurmctld.pid")
slurmd_pid=$(read_pid "$state_dir/run/slurmd.pid")
if ! pid_alive "$slurmctld_pid" || ! pid_alive "$slurmd_pid"; then
    stop_pids $slurmd_pid $slurmctld_pid
    host=$(hostname -s)
    # slurmd -C prints this machine's CPUs, sockets, cores, threads and memory. Slurm drains a
    # node whose RealMemory is above what it finds, so claim a little less.
    read -r -a node_fields < <(slurmd -C | head -n 1)
    node_line=""
    for field in "${node_fields[@]}"; do
        case "$field" in
            NodeName=*) ;;
            RealMemory=*) node_line+=" RealMemory=$((${field#RealMemory=} * 9 / 10))" ;;
            *) node_line+=" $field" ;;
        esac
    done
    cat >"$conf" <<EOF
ClusterName=rlcli-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
StateSaveLocation=$state_dir/state
SlurmdSpoolDir=$state_dir/spool
SlurmctldPidFile=$state_dir/run/slurmctld.pid
SlurmdPidFile=$state_dir/run/slurmd.pid
SlurmctldLogFile=$state_dir/log/slurmctld.log
SlurmdLogFile=$state_dir/log/slurmd.log
NodeName=$host NodeAddr=127.0.0.1$node_line State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF="$conf"
    slurmctld -f "$conf"
    slurmd -f "$conf"
fi

export SLURM_CONF="$conf"
for _ in $(seq 300); do
    if [[ "$(sinfo -h -o %T 2>/dev/null)" =~ ^(idle|mixed|allocated|completing)$ ]]; then
        echo "$state_dir"
        exit 0
    fi
    sleep 0.2
done
echo "the local Slurm node did not become idle within 60 s; see $state_dir/log/" >&2
sinfo >&2 || true
exit 4
