#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for lmtrace's integration test and for trying the
# examples in examples/slurm/. Needs root and Debian's slurmctld, slurmd, slurm-client, munge
# (`scripts/slurm-cluster.sh install` installs them without starting services).
#
#   scripts/slurm-cluster.sh install           apt-get the packages (no services are started)
#   scripts/slurm-cluster.sh up   [STATE_DIR]  start munged, slurmctld, slurmd; print `export SLURM_CONF=...`
#   scripts/slurm-cluster.sh down [STATE_DIR]  stop them by their pid files (never by name)
#
# No systemd and no cgroups here: proctrack/linuxproc, task/none, no accounting (so `sacct`
# does not work; poll squeue / scontrol instead).
set -euo pipefail
cmd=${1:-}
state=${2:-/tmp/lmtrace-slurm}
conf="$state/slurm.conf"

install() {
  # policy-rc.d exiting 101 stops package scripts from trying to start services
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
  fi
}

up() {
  mkdir -p "$state"/{ctld,d,log}
  mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then mungekey --create --keyfile=/etc/munge/munge.key; fi
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  if ! { [ -s /run/munge/munged.pid ] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; }; then
    rm -f /run/munge/munged.pid /run/munge/munge.socket.2*
    runuser -u munge -- /usr/sbin/munged --pid-file="/run/munge/munged.pid"
  fi
  local host node
  host=$(hostname -s)
  node=$(slurmd -C | head -n 1 | sed -E "s/^NodeName=[^ ]+/NodeName=$host/")
  cat > "$conf" <<CONF
ClusterName=lmtrace
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MailProg=/bin/true
ReturnToService=2
KillWait=30
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF="$conf"
  slurmctld -c -f "$conf"
  slurmd -f "$conf"
  for _ in $(seq 60); do
    if sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
      echo "export SLURM_CONF=$conf"
      return 0
    fi
    sleep 0.5
  done
  echo "slurm did not come up; logs in $state/log" >&2
  return 1
}

stop_pidfile() {
  local f=$1
  [ -s "$f" ] || return 0
  local pid; pid=$(cat "$f")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$f"
}

down() {
  stop_pidfile "$state/slurmd.pid"
  stop_pidfile "$state/slurmctld.pid"
  stop_pidfile /run/munge/munged.pid
}

case "$cmd" in
  install) install ;;
  up) up ;;
  down) down ;;
  *) echo "usage: $0 install|up|down [STATE_DIR]" >&2; exit 2 ;;
esac
