#!/usr/bin/env bash
# Start a real single-node Slurm cluster (munged, MariaDB, slurmdbd, slurmctld, slurmd) for tests and
# for trying the Slurm launcher on one machine. No systemd: every daemon is started by hand, in the
# foreground of its own session, and its PID is written to $RELIBRA_SLURM_DIR/pids/<daemon>.pid so
# slurm/stop.sh can stop each one by PID.
#
# Idempotent: a daemon whose recorded PID is alive is left alone; configs are rewritten only when their
# content changes. Installs the Debian packages when a binary is missing (needs root and apt-get).
#
# Environment (all optional):
#   RELIBRA_SLURM_DIR       state directory: configs, logs, spool, database, PIDs   [/tmp/relibra-slurm]
#   RELIBRA_SLURM_CLUSTER   cluster name registered with the accounting database    [relibra]
#   RELIBRA_SLURM_PORT      first of four TCP ports on 127.0.0.1: slurmctld, slurmd, slurmdbd, MariaDB
#                           use PORT, PORT+1, PORT+2, PORT+3                         [6817]
#   RELIBRA_SLURM_CPUS      CPUs the node advertises (may exceed the real count)    [max(nproc, 4)]
#   RELIBRA_SLURM_NO_INSTALL=1   never run apt-get; fail if a binary is missing
#
# Exit status: 0 cluster up; 3 Slurm is not installed and cannot be installed here, or the script is
# not run as root (callers may skip);
# anything else: a start-up failure, with the failing daemon's log printed.
#
# After it succeeds:   export SLURM_CONF=$RELIBRA_SLURM_DIR/etc/slurm.conf   (or: source .../env.sh)
set -euo pipefail

STATE="${RELIBRA_SLURM_DIR:-/tmp/relibra-slurm}"
CLUSTER="${RELIBRA_SLURM_CLUSTER:-relibra}"
PORT="${RELIBRA_SLURM_PORT:-6817}"
CTLD_PORT=$PORT
SLURMD_PORT=$((PORT + 1))
DBD_PORT=$((PORT + 2))
DB_PORT=$((PORT + 3))
NODE=localhost
NPROC="$(nproc)"
CPUS="${RELIBRA_SLURM_CPUS:-$((NPROC > 4 ? NPROC : 4))}"
MEM_MB="$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)"
CTLD_HOST="$(hostname -s)"
DB_USER=slurm
DB_PASS=relibra-slurm-test
DB_NAME=slurm_acct_db

ETC="$STATE/etc"
LOG="$STATE/log"
RUN="$STATE/run"
PIDS="$STATE/pids"
# NOTE: the client commands (sacctmgr, sacct) reach munged only at its compiled-in socket path, whatever
# AuthInfo says, so every daemon uses that path.
MUNGE_SOCKET=/run/munge/munge.socket.2
DB_SOCKET="$RUN/mysqld.sock"
export SLURM_CONF="$ETC/slurm.conf"

say() { echo "[relibra-slurm] $*"; }
die() {
  echo "[relibra-slurm] ERROR: $*" >&2
  exit 1
}

# --- 1. packages ---------------------------------------------------------------------------------
REQUIRED_BINARIES=(munged mungekey mariadbd mariadb-install-db mariadb slurmdbd slurmctld slurmd sbatch sacct sacctmgr)
missing_binaries() {
  local b
  for b in "${REQUIRED_BINARIES[@]}"; do command -v "$b" >/dev/null 2>&1 || echo "$b"; done
}
if [ -n "$(missing_binaries)" ]; then
  if [ "${RELIBRA_SLURM_NO_INSTALL:-0}" = 1 ]; then
    echo "[relibra-slurm] Slurm is not installed (missing: $(missing_binaries | xargs)) and RELIBRA_SLURM_NO_INSTALL=1" >&2
    exit 3
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "[relibra-slurm] Slurm is not installed (missing: $(missing_binaries | xargs)); installing it needs root and apt-get" >&2
    exit 3
  fi
  say "installing slurm-wlm munge slurmdbd mariadb-server with apt-get (takes a minute or two)"
  mkdir -p "$STATE"
  # NOTE: policy-rc.d on container images refuses to start services at install time, which is what we want.
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    slurm-wlm munge slurmdbd mariadb-server; } >"$STATE/apt.log" 2>&1; then
    tail -20 "$STATE/apt.log" >&2
    echo "[relibra-slurm] apt-get could not install Slurm (log: $STATE/apt.log)" >&2
    exit 3
  fi
  [ -z "$(missing_binaries)" ] || { echo "[relibra-slurm] still missing after install: $(missing_binaries | xargs)" >&2; exit 3; }
fi
if [ "$(id -u)" != 0 ]; then
  echo "[relibra-slurm] the test cluster runs its daemons as root (SlurmUser=root); run this script as root" >&2
  exit 3
fi

mkdir -p "$ETC" "$LOG" "$RUN" "$PIDS" "$STATE/spool/ctld" "$STATE/spool/slurmd" "$STATE/munge" "$STATE/mysql"
# munged refuses directories that others may write to; keep the state tree private.
chmod 0755 "$STATE"
chmod 0700 "$STATE/munge"

# write_if_changed FILE MODE: copy stdin to FILE only when the content differs.
write_if_changed() {
  local file=$1 mode=$2 tmp
  tmp="$(mktemp "$file.XXXX")"
  cat >"$tmp"
  chmod "$mode" "$tmp"
  if [ -f "$file" ] && cmp -s "$tmp" "$file"; then rm -f "$tmp"; else mv -f "$tmp" "$file"; fi
}

# alive NAME: the recorded daemon is running (the process name must match, so a stale PID file whose
# number was reused by another program does not count).
alive() {
  local name=$1 pidfile="$PIDS/$1.pid" pid
  [ -f "$pidfile" ] || return 1
  pid="$(cat "$pidfile")"
  [ "$name" = mariadb ] && name=mariadbd
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]
}

# launch NAME CMD...: start a foreground daemon in its own session and record its PID.
launch() {
  local name=$1
  shift
  # NOTE: without job control a background job is not a process-group leader, so setsid execs in place
  # and $! is the daemon's own PID.
  setsid "$@" >>"$LOG/$name.out" 2>&1 </dev/null &
  echo $! >"$PIDS/$name.pid"
}

# wait_for NAME SECONDS 'SHELL CHECK': poll the check until it succeeds; on failure print the log and stop.
# NOTE: every try is bounded by `timeout`, since Slurm clients retry for minutes when a daemon is down.
wait_for() {
  local name=$1 secs=$2 check=$3 i
  for ((i = 0; i < secs * 5; i++)); do
    if timeout 10 bash -c "$check" >/dev/null 2>&1; then return 0; fi
    if ! alive "$name"; then break; fi
    sleep 0.2
  done
  echo "[relibra-slurm] $name did not come up; last lines of its logs:" >&2
  tail -n 30 "$LOG/$name".* >&2 || true
  exit 1
}

# --- 2. configs ----------------------------------------------------------------------------------
write_if_changed "$ETC/slurm.conf" 0644 <<EOF
# Single-node test cluster written by slurm/start.sh; regenerated on every start.
ClusterName=$CLUSTER
SlurmctldHost=$CTLD_HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120); 10 keeps tests short.
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# proctrack/cgroup fails in containers without a writable cgroup tree and drains the node.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=300
SchedulerParameters=sched_interval=1,bf_interval=1
SlurmdParameters=config_overrides
# Job accounting is required: submitit reads job states with sacct to notice jobs that died.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

# slurmdbd refuses a config readable by others (it holds the database password).
write_if_changed "$ETC/slurmdbd.conf" 0600 <<EOF
# Accounting daemon of the single-node test cluster; written by slurm/start.sh.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF

write_if_changed "$STATE/env.sh" 0644 <<EOF
# source this file to use the test cluster's client commands (sbatch, squeue, sacct, scancel).
export SLURM_CONF=$ETC/slurm.conf
EOF

# --- 3. munged -----------------------------------------------------------------------------------
MUNGE_KEY="$STATE/munge/munge.key"
[ -f "$MUNGE_KEY" ] || mungekey --create --keyfile="$MUNGE_KEY"
chmod 0600 "$MUNGE_KEY"
MUNGE_OK="munge --socket=$MUNGE_SOCKET -n | unmunge --socket=$MUNGE_SOCKET"
if ! alive munged; then
  if timeout 5 bash -c "$MUNGE_OK" >/dev/null 2>&1; then
    # A munged that this script did not start already serves the socket: use it, never stop it.
    say "using the munged already listening on $MUNGE_SOCKET"
    rm -f "$PIDS/munged.pid"
  else
    mkdir -p "$(dirname "$MUNGE_SOCKET")"
    chmod 0755 "$(dirname "$MUNGE_SOCKET")"
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    launch munged munged --foreground --force --socket="$MUNGE_SOCKET" --key-file="$MUNGE_KEY" \
      --pid-file="$RUN/munged.pid" --log-file="$LOG/munged.log" --seed-file="$STATE/munge/munged.seed"
  fi
fi
[ ! -f "$PIDS/munged.pid" ] || wait_for munged 10 "$MUNGE_OK"

# --- 4. MariaDB ----------------------------------------------------------------------------------
DB_ARGS=(--no-defaults --user=root --datadir="$STATE/mysql" --socket="$DB_SOCKET"
  --pid-file="$RUN/mysqld.pid" --port="$DB_PORT" --bind-address=127.0.0.1
  --innodb-buffer-pool-size=64M --innodb-log-file-size=16M --log-error="$LOG/mariadb.log")
if [ ! -d "$STATE/mysql/mysql" ]; then
  say "initialising the accounting database in $STATE/mysql"
  mariadb-install-db --no-defaults --user=root --datadir="$STATE/mysql" --auth-root-authentication-method=socket \
    >"$LOG/mariadb-install.log" 2>&1 || { tail -20 "$LOG/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
fi
alive mariadb || launch mariadb mariadbd "${DB_ARGS[@]}"
wait_for mariadb 30 "mariadb --no-defaults --socket=$DB_SOCKET -uroot -e 'SELECT 1'"
mariadb --no-defaults --socket="$DB_SOCKET" -uroot <<EOF
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'127.0.0.1';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
EOF

# --- 5. slurmdbd, then the cluster's registration ------------------------------------------------
alive slurmdbd || launch slurmdbd slurmdbd -D
wait_for slurmdbd 30 "sacctmgr -n list cluster"
# NOTE: registration goes through slurm.conf's AccountingStorageHost, so it can only happen now.
if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
  sacctmgr -i add cluster "$CLUSTER" >/dev/null
fi

# --- 6. slurmctld and slurmd ---------------------------------------------------------------------
alive slurmctld || launch slurmctld slurmctld -D
wait_for slurmctld 30 "scontrol ping | grep -q UP"
alive slurmd || launch slurmd slurmd -D -N "$NODE"
wait_for slurmd 30 "sinfo -h -n $NODE -o %t | grep -Eq '^(idle|mix|alloc)'"

say "cluster '$CLUSTER' is up: $CPUS CPUs, ${MEM_MB} MB on node $NODE (state in $STATE)"
say "use it with: export SLURM_CONF=$SLURM_CONF"
