#!/usr/bin/env bash
# Stop the single-node test cluster started by slurm/start.sh: cancel its jobs, then stop every daemon by
# the PID recorded in $RELIBRA_SLURM_DIR/pids, in reverse start order (SIGTERM, then SIGKILL after a
# grace period). Safe to run when nothing is running. Never touches processes it did not start.
#
#   RELIBRA_SLURM_DIR    state directory given to start.sh   [/tmp/relibra-slurm]
#   --purge              also delete the state directory (database, logs, spool)
set -uo pipefail

STATE="${RELIBRA_SLURM_DIR:-/tmp/relibra-slurm}"
PIDS="$STATE/pids"
export SLURM_CONF="$STATE/etc/slurm.conf"
PURGE=0
[ "${1:-}" = "--purge" ] && PURGE=1

say() { echo "[relibra-slurm] $*"; }

# recorded_pid NAME: the PID of the live recorded daemon, or nothing. The process name must match, so a
# stale PID file whose number was reused by another program is ignored.
recorded_pid() {
  local name=$1 pidfile="$PIDS/$1.pid" pid comm
  [ -f "$pidfile" ] || return 0
  pid="$(cat "$pidfile")"
  comm="$(cat "/proc/$pid/comm" 2>/dev/null)"
  [ "$name" = mariadb ] && name=mariadbd
  if [ -n "$pid" ] && [ "$comm" = "$name" ]; then echo "$pid"; fi
}

# Jobs first, while slurmctld can still cancel them: their steps run under slurmstepd, which would
# otherwise outlive slurmd.
if [ -n "$(recorded_pid slurmctld)" ] && [ -f "$SLURM_CONF" ]; then
  jobs="$(timeout 10 squeue -h -o %A 2>/dev/null | sort -u | xargs)"
  if [ -n "$jobs" ]; then
    say "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    timeout 10 scancel $jobs 2>/dev/null
    for _ in $(seq 1 50); do
      [ -z "$(timeout 10 squeue -h -o %A 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
fi

for name in slurmd slurmctld slurmdbd mariadb munged; do
  pid="$(recorded_pid "$name")"
  if [ -z "$pid" ]; then
    rm -f "$PIDS/$name.pid"
    continue
  fi
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    say "$name (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$PIDS/$name.pid"
  say "stopped $name (pid $pid)"
done

if [ "$PURGE" = 1 ]; then
  rm -rf "$STATE"
  say "removed $STATE"
fi
