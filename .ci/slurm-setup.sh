#!/usr/bin/env bash
# slurm-setup.sh - a real single-host Slurm (Debian 12: slurm-wlm 22.05) for distfn's CI, without systemd.
#
# Adapted from the team's recorded recipe (shared/recipes/slurm-setup.sh); distfn defaults: two virtual
# nodes (node1, node2) so the multi-node tests in tests/cluster/ can run, and at least 4 CPUs declared per
# node so a 4-rank step never queues forever on a 2-core machine (see tests/cluster/README note on -O).
#
# Usage: slurm-setup.sh [up|down|clean|restart|status]
#   up       (default) install packages if missing, write /etc/slurm/slurm.conf, start munged,
#            slurmctld and one slurmd per virtual node, wait until every node is idle, exit 0.
#            Idempotent: if the cluster is already up with the same config it only re-checks it.
#   down     cancel jobs, stop the slurmd(s)/slurmctld (and munged if this script started it), by pid file.
#   clean    down + remove the config, state, logs, fake GPU devices and /etc/hosts aliases it wrote.
#   restart  stop slurmd(s)/slurmctld, then up (munged keeps running).
#   status   scontrol ping + sinfo.
#
# Knobs (environment):
#   SLURM_CI_NODES=2        virtual nodes. 1: one node named after `hostname -s`.
#                           N>1: node1..nodeN, each its own slurmd (slurmd -N) on its own port, all on 127.0.0.1.
#   SLURM_CI_CPUS=max(nproc,4)  CPUs declared per node; may exceed the real core count (config_overrides).
#   SLURM_CI_GPUS=0         fake GPUs per node (char-device stand-ins): jobs asking --gpus* get
#                           CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS, SLURM_JOB_GPUS, SLURM_GPUS_ON_NODE.
#   SLURM_CI_TIMEOUT=60     seconds to wait for the nodes to become idle.
#   SLURM_CI_SMOKE=1        run `srun -n1 true` after the nodes are idle.
# Clients need no SLURM_CONF: the config sits at the default path /etc/slurm/slurm.conf.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
GRES_CONF=/etc/slurm/gres.conf
STATE_DIR=/var/spool/slurmctld
SPOOL_BASE=/var/spool/slurmd
CI_DIR=/var/spool/slurm-ci            # markers + fake GPU device nodes
LOG_DIR=/var/log/slurm
CTLD_PID=/run/slurmctld.pid
HOSTS_TAG="# slurm-ci"

NODES=${SLURM_CI_NODES:-2}
_ncpu=$(nproc); [ "$_ncpu" -lt 4 ] && _ncpu=4
CPUS=${SLURM_CI_CPUS:-$_ncpu}
GPUS=${SLURM_CI_GPUS:-0}
TIMEOUT=${SLURM_CI_TIMEOUT:-60}
SMOKE=${SLURM_CI_SMOKE:-1}
HOST=$(hostname -s)

T0=$EPOCHREALTIME
log() { echo "[slurm-setup +$(awk -v a="$EPOCHREALTIME" -v b="$T0" 'BEGIN{printf "%.1f", a-b}')s] $*" >&2; }

node_names() {
  if [ "$NODES" -le 1 ]; then echo "$HOST"; else for i in $(seq 1 "$NODES"); do echo "node$i"; done; fi
}

# pid alive and not a zombie, and its comm is the expected daemon name
alive() { # alive PID NAME
  local pid=$1 name=$2
  [ -n "$pid" ] && [ -r "/proc/$pid/status" ] || return 1
  grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" && return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]
}
pid_of() { [ -s "$1" ] && cat "$1" || true; }

stop_pid() { # stop_pid PIDFILE NAME
  local pf=$1 name=$2 pid
  pid=$(pid_of "$pf")
  if alive "$pid" "$name"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do alive "$pid" "$name" || break; sleep 0.1; done
    if alive "$pid" "$name"; then log "$name ($pid) ignored SIGTERM, sending SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
    log "stopped $name (pid $pid)"
  fi
  rm -f "$pf"
}

install_pkgs() {
  local pkgs=(slurmctld slurmd slurm-client munge libpmix2) missing=() p created_policy=0
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  # keep the packages' maintainer scripts from trying to start services (no systemd here)
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; created_policy=1; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ "$created_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  log "packages installed"
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
  if [ ! -s /etc/munge/munge.key ]; then
    install -d -o munge -g munge -m 0700 /etc/munge
    mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
      || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  local old; old=$(pid_of /run/munge/munged.pid)
  alive "$old" munged || rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
  runuser -u munge -- /usr/sbin/munged
  mkdir -p "$CI_DIR"; touch "$CI_DIR/munged.started-by-us"
  for _ in $(seq 1 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && { log "munged up"; return 0; }; sleep 0.1; done
  log "munged did not come up"; exit 1
}

write_conf() { # writes the config to $1 (and gres.conf when GPUs are faked)
  local out=$1 mem names i=0 n
  mem=$(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo)
  mem=$(( mem / NODES ))
  names=$(node_names)
  {
    echo "# generated by slurm-setup.sh (nodes=$NODES cpus=$CPUS gpus=$GPUS)"
    cat <<EOF
ClusterName=ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire seconds before it starts again (slurm.conf(5); 120 by default, most of
# tests/cluster/test_requeue.py's time); 20 s still covers a step's launch on a loaded 2-core VM
AuthInfo=cred_expire=20
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_BASE/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
EOF
    [ "$GPUS" -gt 0 ] && echo "GresTypes=gpu"
    for n in $names; do
      printf 'NodeName=%s NodeHostname=%s NodeAddr=127.0.0.1 Port=%d CPUs=%d RealMemory=%d' \
        "$n" "$HOST" $((6818 + i)) "$CPUS" "$mem"
      [ "$GPUS" -gt 0 ] && printf ' Gres=gpu:%d' "$GPUS"
      printf ' State=UNKNOWN\n'
      i=$((i + 1))
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } > "$out"
}

write_gres() {
  rm -f "$GRES_CONF"
  [ "$GPUS" -gt 0 ] || return 0
  mkdir -p "$CI_DIR/dev"
  local g
  for g in $(seq 0 $((GPUS - 1))); do
    # Slurm wants a character device; any will do with TaskPlugin=task/none (same numbers as /dev/null)
    [ -c "$CI_DIR/dev/gpu$g" ] || mknod "$CI_DIR/dev/gpu$g" c 1 3
  done
  echo "Name=gpu File=$CI_DIR/dev/gpu[0-$((GPUS - 1))]" > "$GRES_CONF"
}

ensure_hosts() { # every node name must resolve (SLURM_NODELIST / MASTER_ADDR lookups)
  local n
  for n in "$HOST" $(node_names); do
    getent hosts "$n" >/dev/null || { echo "127.0.0.1 $n $HOSTS_TAG" >> /etc/hosts; log "added $n to /etc/hosts"; }
  done
}

pmix_fix() { # Slurm's mpi/pmix plugin dlopens the unversioned libpmix.so (shipped only by libpmix-dev)
  local d=/usr/lib/x86_64-linux-gnu/pmix2/lib
  [ -e "$d/libpmix.so.2" ] && [ ! -e "$d/libpmix.so" ] && ln -s libpmix.so.2 "$d/libpmix.so" || true
}

all_idle() {
  local want got
  want=$(node_names | wc -l)
  got=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | awk '$2=="idle"' | wc -l) || return 1
  [ "$got" -eq "$want" ]
}

daemons_alive() {
  local n
  alive "$(pid_of "$CTLD_PID")" slurmctld || return 1
  for n in $(node_names); do alive "$(pid_of "/run/slurmd-$n.pid")" slurmd || return 1; done
}

stop_slurm() { # cancel jobs, stop slurmd(s) and slurmctld
  local pf
  if [ -x /usr/bin/scontrol ] && alive "$(pid_of "$CTLD_PID")" slurmctld && scontrol ping >/dev/null 2>&1; then
    local jobs; jobs=$(squeue -h -o %A 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 1 50); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  for pf in /run/slurmd-*.pid; do [ -e "$pf" ] && stop_pid "$pf" slurmd; done
  stop_pid "$CTLD_PID" slurmctld
}

cmd_down() {
  stop_slurm
  if [ -e "$CI_DIR/munged.started-by-us" ]; then
    stop_pid /run/munge/munged.pid munged
    rm -f "$CI_DIR/munged.started-by-us"
  fi
}

cmd_clean() {
  cmd_down
  rm -rf "$STATE_DIR" "$SPOOL_BASE" "$CI_DIR" "$CONF" "$GRES_CONF"
  rm -f "$LOG_DIR"/slurmctld.log* "$LOG_DIR"/slurmd-*.log*
  if grep -q "$HOSTS_TAG" /etc/hosts 2>/dev/null; then
    # /etc/hosts may be a bind mount: rewrite in place instead of replacing the file
    local keep; keep=$(grep -v "$HOSTS_TAG" /etc/hosts); printf '%s\n' "$keep" > /etc/hosts
  fi
  log "cleaned"
}

cmd_up() {
  install_pkgs
  pmix_fix
  ensure_hosts
  start_munge
  local new; new=$(mktemp); write_conf "$new"
  if cmp -s "$new" "$CONF" && daemons_alive && all_idle; then
    rm -f "$new"; log "already up: $(sinfo -h -N -o '%N:%t' | tr '\n' ' ')"; return 0
  fi
  stop_slurm
  install -d -m 0755 "$STATE_DIR" "$SPOOL_BASE" "$LOG_DIR" "$CI_DIR"
  install -m 0644 "$new" "$CONF"; rm -f "$new"
  write_gres
  /usr/sbin/slurmctld -c          # daemonizes; -c: start with clean job/node state
  local n
  for n in $(node_names); do /usr/sbin/slurmd -N "$n"; done   # daemonizes
  log "daemons started, waiting for idle node(s)"
  local deadline=$(( $(date +%s) + TIMEOUT ))
  until all_idle; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "timeout: nodes not idle"; sinfo -N -l || true
      tail -n 30 "$LOG_DIR"/slurmctld.log "$LOG_DIR"/slurmd-*.log >&2 || true
      exit 1
    fi
    sleep 0.2
  done
  log "idle: $(sinfo -h -N -o '%N:%t' | tr '\n' ' ')"
  if [ "$SMOKE" = 1 ]; then timeout 30 srun -N1 -n1 true && log "smoke srun ok"; fi
}

case "${1:-up}" in
  up) cmd_up ;;
  down) cmd_down ;;
  clean) cmd_clean ;;
  restart) stop_slurm; cmd_up ;;
  status) scontrol ping; sinfo -N -o '%N %t %c %G' ;;
  *) echo "usage: $0 [up|down|clean|restart|status]" >&2; exit 2 ;;
esac
