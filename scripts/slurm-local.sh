#!/usr/bin/env bash
# A throwaway single-node Slurm on this machine (Debian's slurm-wlm + munge, no systemd), for
# the real-Slurm test (tests/test_slurm.py) and the measurements in docs/results/slurm.md.
#
#   scripts/slurm-local.sh install      apt-get install slurm-wlm munge (root; skipped if present)
#   scripts/slurm-local.sh start DIR [--gpus N]
#                                       write DIR/slurm.conf, link it at /etc/slurm/slurm.conf,
#                                       start munged, slurmctld and slurmd (pid files in DIR),
#                                       wait until the node is idle. --gpus N: the node has N GPUs
#                                       as GRES (gpu:N), each a stand-in device file
#                                       DIR/dev/fakegpu<i> named in DIR/gres.conf (AutoDetect=off),
#                                       so slurmd hands a job asking --gpus its own index in
#                                       CUDA_VISIBLE_DEVICES; no real card is touched
#   scripts/slurm-local.sh stop DIR     stop the three daemons by their pid files, remove the link
#
# Exit codes: 0 done; 3 cannot be had here (not root, no apt-get, the packages do not install,
# /etc/slurm/slurm.conf belongs to another cluster), with one line on stderr saying why;
# anything else is a failure. Everything the daemons write stays in DIR, except the link
# /etc/slurm/slurm.conf: the job step's `srun` finds the config only at the default path
# (snakemake's job step drops SLURM_CONF, docs/how-to/slurm.md), so one such cluster per machine.
set -euo pipefail

LINK=/etc/slurm/slurm.conf
cannot() { echo "slurm-local: $*" >&2; exit 3; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return 0
  fi
  [ "$(id -u)" = 0 ] || cannot "slurm-wlm/munge are not installed and installing them needs root"
  command -v apt-get >/dev/null || cannot "slurm-wlm/munge are not installed and there is no apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null 2>&1 || cannot "apt-get update failed (no package index reachable?)"
  apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1 \
    || cannot "apt-get install slurm-wlm munge failed"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
  local dir=$1 gpus=${2:-0}
  [ "$(id -u)" = 0 ] || cannot "starting munged/slurmctld/slurmd needs root"
  install
  mkdir -p "$dir"/{state,spool,munge}
  dir=$(cd "$dir" && pwd)
  # A link left dangling by a cluster whose DIR is gone (a killed test) is nobody's config.
  if [ -L "$LINK" ] && [ ! -e "$LINK" ]; then
    rm -f "$LINK"
  fi
  if [ -e "$LINK" ] || [ -L "$LINK" ]; then
    [ "$(readlink "$LINK" 2>/dev/null || true)" = "$dir/slurm.conf" ] \
      || cannot "$LINK exists (another Slurm on this machine); not touching it"
  fi
  chmod 0755 "$dir"   # munged runs as the munge user and must reach DIR/munge (mktemp -d makes 0700)
  local host cpus mem ctld_port slurmd_port
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.85}' /proc/meminfo)
  ctld_port=$(free_port)
  slurmd_port=$(free_port)
  # munged of our own: its socket, pid, seed and log in DIR (the package's key).
  chown munge:munge "$dir/munge"
  chmod 0755 "$dir/munge"
  su -s /bin/sh munge -c "/usr/sbin/munged --socket=$dir/munge/munge.sock --pid-file=$dir/munge/munged.pid \
    --seed-file=$dir/munge/munged.seed --log-file=$dir/munge/munged.log"
  # GPUs as GRES: slurmd reads gres.conf beside slurm.conf. File= must name character devices
  # (slurmd 22.05 drops a plain file: "is not a valid character or block device") and the job is
  # then given no CUDA_VISIBLE_DEVICES: each stand-in is a node with the null device's numbers
  # (1,3: reading or writing it does nothing), in DIR. CUDA_VISIBLE_DEVICES is the GRES index (the
  # line's order), which is what the test reads back.
  local gres_types="" node_gres="" i
  rm -f "$dir/gres.conf"
  if [ "$gpus" -gt 0 ]; then
    mkdir -p "$dir/dev"
    : >"$dir/gres.conf"
    echo "AutoDetect=off" >>"$dir/gres.conf"
    for i in $(seq 0 $((gpus - 1))); do
      rm -f "$dir/dev/fakegpu$i"
      mknod "$dir/dev/fakegpu$i" c 1 3 2>/dev/null || cannot "mknod of a stand-in GPU device failed (no CAP_MKNOD?)"
      echo "NodeName=$host Name=gpu File=$dir/dev/fakegpu$i" >>"$dir/gres.conf"
    done
    gres_types="GresTypes=gpu"
    node_gres="Gres=gpu:$gpus"
  fi
  cat >"$dir/slurm.conf" <<EOF
ClusterName=fedagent-local
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
$gres_types
ReturnToService=2
# Finished jobs stay visible to squeue for an hour (the test reads every submitted job back).
MinJobAge=3600
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$host CPUs=$cpus RealMemory=$mem $node_gres State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  mkdir -p /etc/slurm
  ln -sfn "$dir/slurm.conf" "$LINK"
  slurmctld -f "$dir/slurm.conf" -i
  slurmd -f "$dir/slurm.conf"
  local i
  for i in $(seq 1 60); do
    if sinfo -h -o %t 2>/dev/null | grep -qx idle; then
      return 0
    fi
    sleep 0.5
  done
  echo "slurm-local: the node did not become idle in 30 s:" >&2
  sinfo >&2 || true
  tail -5 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
  exit 1
}

stop_pid() {
  local pidfile=$1 pid i
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || return 0
  for i in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.2
  done
  kill -9 "$pid" 2>/dev/null || true
}

stop() {
  local dir
  dir=$(cd "$1" && pwd)
  stop_pid "$dir/slurmd.pid"
  stop_pid "$dir/slurmctld.pid"
  stop_pid "$dir/munge/munged.pid"
  if [ "$(readlink "$LINK" 2>/dev/null || true)" = "$dir/slurm.conf" ]; then
    rm -f "$LINK"
  fi
}

case "${1:-}" in
  install) install ;;
  start)
    if [ $# = 2 ]; then
      start "$2"
    elif [ $# = 4 ] && [ "$3" = --gpus ] && [[ "$4" =~ ^[0-9]+$ ]]; then
      start "$2" "$4"
    else
      echo "usage: $0 start DIR [--gpus N]" >&2; exit 2
    fi ;;
  stop) [ $# = 2 ] || { echo "usage: $0 stop DIR" >&2; exit 2; }; stop "$2" ;;
  *) echo "usage: $0 install | start DIR [--gpus N] | stop DIR" >&2; exit 2 ;;
esac
