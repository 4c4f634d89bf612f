#!/usr/bin/env bash
# mpi-setup.sh - Open MPI (Debian 12: openmpi-bin 4.1.4) for distfn's CI as root.
# Adapted from the team's recorded recipe (shared/recipes/mpi-setup.sh).
#
# Usage: mpi-setup.sh [up|env]
#   up   (default) install openmpi-bin if missing, then check that
#        `mpirun -np 2` starts two ranks as root. Idempotent; nothing is left running.
#   env  print the export lines a root CI shell needs:  eval "$(mpi-setup.sh env)"
#
# Root: Open MPI 4.x refuses to run as root unless `--allow-run-as-root` is passed
# or BOTH OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set
# (there is no MCA parameter for it). OMPI_MCA_rmaps_base_oversubscribe=1 is the
# environment form of --oversubscribe (more ranks than cores).
set -euo pipefail

ENV_LINES='export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1'

T0=$EPOCHREALTIME
log() { echo "[mpi-setup +$(awk -v a="$EPOCHREALTIME" -v b="$T0" 'BEGIN{printf "%.1f", a-b}')s] $*" >&2; }

install_pkgs() {
  if dpkg-query -W -f='${Status}' openmpi-bin 2>/dev/null | grep -q 'install ok installed'; then return 0; fi
  log "installing openmpi-bin"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends openmpi-bin >/dev/null
  log "openmpi-bin installed"
}

pmix_fix() {
  # Lets Slurm's `srun --mpi=pmix` load libpmix (its plugin dlopens the unversioned name that
  # only libpmix-dev ships). Takes effect for slurmd processes started after this.
  local d=/usr/lib/x86_64-linux-gnu/pmix2/lib
  if [ -e "$d/libpmix.so.2" ] && [ ! -e "$d/libpmix.so" ]; then
    ln -s libpmix.so.2 "$d/libpmix.so"
    if [ -x /usr/sbin/slurmd ]; then log "created $d/libpmix.so: restart slurmd for srun --mpi=pmix"; fi
  fi
}

check() {
  eval "$ENV_LINES"
  local out
  out=$(timeout 60 mpirun -np 2 sh -c 'echo "$OMPI_COMM_WORLD_RANK/$OMPI_COMM_WORLD_SIZE"' | sort | tr '\n' ' ')
  [ "$out" = "0/2 1/2 " ] || { log "mpirun check failed: '$out'"; exit 1; }
  log "mpirun ok: ranks $out($(mpirun --version | head -1))"
}

case "${1:-up}" in
  up) install_pkgs; pmix_fix; check ;;
  env) echo "$ENV_LINES" ;;
  *) echo "usage: $0 [up|env]" >&2; exit 2 ;;
esac
