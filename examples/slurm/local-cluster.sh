#!/bin/bash
# A real Slurm cluster on one Linux machine, for trying resihp.sbatch: one slurmd per
# network namespace ("host", own address on a bridge), slurmctld in the root namespace.
# Needs root and Debian's slurmctld, slurmd and munge packages.
#
#   examples/slurm/local-cluster.sh up 2      # nodes n0, n1; prints the SLURM_CONF to export
#   SLURM_CONF=/tmp/resihp-slurm/slurm.conf sbatch --nodes=2 examples/slurm/resihp.sbatch job.toml
#   examples/slurm/local-cluster.sh cut 1     # partition node n1 (its link down) ... heal 1
#   examples/slurm/local-cluster.sh down
#
# slurmd is entered into its namespace with nsenter (network only): `ip netns exec` would
# remount /sys and hide the cgroup mounts slurmd needs.
set -euo pipefail
DIR=${RESIHP_SLURM_DIR:-/tmp/resihp-slurm}
NET=${RESIHP_SLURM_NET:-10.231.17}
TAG=slm
conf=$DIR/slurm.conf

up() {
    local n=${1:-2}
    mkdir -p "$DIR/state"
    if ! pgrep -x munged >/dev/null; then
        mkdir -p /run/munge && chown munge:munge /run/munge
        runuser -u munge -- /usr/sbin/munged
    fi
    ip link add rb$TAG type bridge
    ip addr add $NET.1/24 dev rb$TAG
    ip link set rb$TAG up
    {
        cat <<CONF
ClusterName=resihplocal
SlurmctldHost=$(hostname)($NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
SlurmctldPort=6917
SlurmdPort=6918
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/linear
ReturnToService=2
MpiDefault=none
CONF
        for i in $(seq 0 $((n - 1))); do
            echo "NodeName=n$i NodeAddr=$NET.$((i + 2)) CPUs=$(nproc) Sockets=1 CoresPerSocket=$(nproc) ThreadsPerCore=1 State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=n[0-$((n - 1))] Default=YES MaxTime=INFINITE State=UP"
    } > "$conf"
    for i in $(seq 0 $((n - 1))); do
        ip netns add rh$TAG$i
        ip link add rv$TAG$i type veth peer name eth0 netns rh$TAG$i
        ip link set rv$TAG$i master rb$TAG up
        ip -n rh$TAG$i addr add $NET.$((i + 2))/24 dev eth0
        ip -n rh$TAG$i link set eth0 up
        ip -n rh$TAG$i link set lo up
        mkdir -p "$DIR/spool-n$i"
    done
    SLURM_CONF=$conf slurmctld -f "$conf"
    sleep 1
    for i in $(seq 0 $((n - 1))); do
        nsenter --net=/run/netns/rh$TAG$i env SLURM_CONF="$conf" slurmd -N n$i -f "$conf"
    done
    sleep 2
    SLURM_CONF=$conf sinfo
    echo "export SLURM_CONF=$conf"
}

down() {
    for f in "$DIR"/slurmd-*.pid "$DIR"/slurmctld.pid; do
        [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
    done
    sleep 1
    for ns in $(ip netns list | awk '{print $1}' | grep "^rh$TAG" || true); do
        for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns"
    done
    ip link del rb$TAG 2>/dev/null || true
}

case "${1:-}" in
    up) up "${2:-2}" ;;
    down) down ;;
    cut) ip link set rv$TAG"${2:?node}" down ;;
    heal) ip link set rv$TAG"${2:?node}" up ;;
    *) echo "usage: $0 up [NODES] | down | cut NODE | heal NODE" >&2; exit 2 ;;
esac
