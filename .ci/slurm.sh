#!/usr/bin/env bash
# A throwaway Slurm cluster for the Slurm executor's tests: installs Slurm and munge if they
# are missing (Debian/Ubuntu, as root), starts munged, slurmctld and two slurmd on this
# machine (nodes vl0 and vl1, two fake GPUs each: a gres on /dev/null and /dev/zero), and
# prints the path of its slurm.conf as the last line of stdout:
#
#     export VISIONLOOP_TEST_SLURM_CONF="$(bash .ci/slurm.sh)"
#
# Idempotent (a lock serialises callers; a cluster that answers `scontrol ping` is reused).
# No accounting (slurmdbd): jobs are read back with squeue and scontrol, as the executor
# does on clusters without it. Everything lives in $VISIONLOOP_SLURM_DIR
# (/tmp/visionloop-slurm); stop it with: kill $(cat /tmp/visionloop-slurm/*.pid) (munged may
# stay).
#
# Settings: VISIONLOOP_SLURM_DIR, VISIONLOOP_SLURM_PORT (56817: slurmctld; the slurmd +1, +2).
set -euo pipefail

DIR="${VISIONLOOP_SLURM_DIR:-/tmp/visionloop-slurm}"
PORT="${VISIONLOOP_SLURM_PORT:-56817}"
CONF="$DIR/slurm.conf"
HOST="$(hostname -s)"

log() { echo "slurm.sh: $*" >&2; }
die() {
  log "$*"
  log "Or point the tests at a Slurm cluster of your own: export VISIONLOOP_TEST_SLURM_CONF=/path/to/slurm.conf (a partition named 'vltest')."
  exit 1
}

mkdir -p "$DIR"
exec 9>"$DIR.lock"
flock -w 300 9 || die "another slurm.sh has held $DIR.lock for 5 minutes."

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "Slurm is not installed: apt-get install slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || die "apt-get update failed."
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >&2 \
      || die "apt-get install of Slurm failed."
  fi
  command -v slurmctld >/dev/null 2>&1 || die "Slurm is not installed and this script cannot install it here (it needs root and apt-get)."
fi
[ "$(id -u)" -eq 0 ] || die "the test cluster runs its daemons as root (SlurmUser=root); run this as root."

if [ -f "$CONF" ] && SLURM_CONF="$CONF" scontrol ping 2>/dev/null | grep -q "is UP" \
  && [ "$(SLURM_CONF="$CONF" sinfo -h -N -o %t 2>/dev/null | grep -cE '^(idle|mix|alloc)$')" = 2 ]; then
  echo "$CONF"
  exit 0
fi

# munge: the package's key, else a new one; the default socket, since Slurm's clients use it.
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  if command -v mungekey >/dev/null 2>&1; then mungekey --create --force >&2; else
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  fi
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 0400 /etc/munge/munge.key
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  rm -f /run/munge/munge.socket.2
  if id munge >/dev/null 2>&1; then
    runuser -u munge -- munged --force 9>&- || die "munged did not start."
  else
    munged --force 9>&- || die "munged did not start."
  fi
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
  munge -n | unmunge >/dev/null || die "munge does not work (munged started, but unmunge fails)."
fi

# A cluster that is down or unwell is started afresh; its daemons (those of this folder, by
# their pid files) must be gone first, or slurmctld would save its old state (a drained node)
# over the fresh folder on its way out.
stop_daemons() {
  local f pids=""
  for f in "$DIR"/*.pid; do
    if [ -s "$f" ]; then pids="$pids $(cat "$f")"; fi
  done
  [ -n "$pids" ] || return 0
  # shellcheck disable=SC2086
  kill $pids 2>/dev/null || true
  for _ in $(seq 100); do
    # shellcheck disable=SC2086
    kill -0 $pids 2>/dev/null || return 0
    sleep 0.2
  done
  # shellcheck disable=SC2086
  kill -9 $pids 2>/dev/null || true
}
stop_daemons
rm -rf "$DIR/state" "$DIR"/spool-* "$DIR"/*.pid
mkdir -p "$DIR/state" "$DIR/spool-vl0" "$DIR/spool-vl1"
# Two nodes on this machine (a slurmd each, on its own port): vl0 owned, vl1 spot, each with
# two fake GPUs (a100 gres on /dev/null and /dev/zero; the feature gpu_type:A100-80GB names
# the price catalog's type), so runs across nodes are tested too. More CPUs than the machine
# has (config_overrides lets slurmd accept it): the tests' jobs are tiny, and two test
# workers submitting at once should not queue behind two cores.
CPUS=8
# Memory likewise: a job asks for 8 GB by default, which real GPU nodes have.
MEM_MB=32768
cat >"$CONF" <<EOF
ClusterName=visionloop-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
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
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,sched_min_interval=0,batch_sched_delay=0
KillWait=5
MinJobAge=300
GresTypes=gpu
NodeName=vl0 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:a100:2 Feature=gpu_type:A100-80GB,owned State=UNKNOWN
NodeName=vl1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:a100:2 Feature=gpu_type:A100-80GB,spot State=UNKNOWN
PartitionName=vltest Nodes=vl0,vl1 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
cat >"$DIR/gres.conf" <<EOF
NodeName=vl0 Name=gpu Type=a100 File=/dev/null,/dev/zero
NodeName=vl1 Name=gpu Type=a100 File=/dev/null,/dev/zero
EOF

# 9>&-: the daemons must not inherit the lock, or they would hold it for as long as they run.
slurmctld -i -f "$CONF" 9>&- || die "slurmctld did not start; see $DIR/slurmctld.log."
for _ in $(seq 100); do SLURM_CONF="$CONF" scontrol ping 2>/dev/null | grep -q "is UP" && break; sleep 0.2; done
for node in vl0 vl1; do
  SLURM_CONF="$CONF" slurmd -f "$CONF" -N "$node" 9>&- || die "slurmd $node did not start; see $DIR/slurmd-$node.log."
done
states=""
for _ in $(seq 150); do
  states="$(SLURM_CONF="$CONF" sinfo -h -N -o %t 2>/dev/null | sort -u | tr '\n' ' ' || true)"
  [ "$states" = "idle " ] && break
  sleep 0.2
done
[ "$states" = "idle " ] || die "the nodes are '$states', not idle, after 30 s; see $DIR/slurmctld.log and $DIR/slurmd-*.log."
log "Slurm $(SLURM_CONF="$CONF" sinfo --version | awk '{print $2}') is up: nodes vl0 and vl1 on this machine ($CPUS CPUs and 2 fake GPUs each; vl1 spot), partition vltest"
echo "$CONF"
