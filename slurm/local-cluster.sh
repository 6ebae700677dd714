#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try slurm/train.sbatch before a real cluster.
#
#   sudo slurm/local-cluster.sh          # install (Debian/Ubuntu, apt) if missing, then start
#   sudo slurm/local-cluster.sh stop     # stop the daemons it started
#
# It installs Debian's slurm-wlm packages (slurmctld, slurmd, munge, slurm-wlm-basic-plugins,
# slurm-client) when they are missing, writes /etc/slurm/slurm.conf for one node (this host,
# all its CPUs, one partition "debug") and starts munged, slurmctld and slurmd. Running it again
# starts only what is not running. It never overwrites a slurm.conf it did not write. Jobs run
# as the user who submits them, in plain processes (no cgroups, nothing changed system-wide);
# the logs are in /var/log/slurm/.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# written by slurm/local-cluster.sh"

if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null && exec sudo "$0" "$@"
    echo "error: slurm/local-cluster.sh needs root (to install packages and start daemons)" >&2
    exit 2
fi

running() {  # running PIDFILE: the daemon that wrote it is alive
    [ -s "$1" ] && kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null
}

if [ "${1:-start}" = stop ]; then
    for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
        if running "$pidfile"; then kill "$(cat "$pidfile")"; fi
        while running "$pidfile"; do sleep 0.2; done
    done
    exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
    if ! command -v apt-get >/dev/null; then
        echo "error: SLURM is not installed and there is no apt-get to install it" >&2
        exit 2
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge >/dev/null
fi

if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    echo "error: $CONF exists and was not written by this script: not touching a real" \
         "cluster's configuration" >&2
    exit 2
fi
PLUGINS=$(echo /usr/lib/*/slurm-wlm)  # /usr/lib/x86_64-linux-gnu/slurm-wlm on a PC
host=$(hostname -s)
# This machine's CPUs, sockets, cores and memory, as slurmd itself sees them.
node=$(slurmd -C | head -n 1 | sed 's/^NodeName=[^ ]*//')
mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
cat > "$CONF.new" <<EOF
$MARK: a one-node cluster on $host
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
PluginDir=$PLUGINS
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host NodeAddr=127.0.0.1$node State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
changed=0
if ! cmp -s "$CONF.new" "$CONF"; then mv "$CONF.new" "$CONF"; changed=1; else rm "$CONF.new"; fi

mkdir -p /run/munge && chown munge:munge /run/munge
[ -s /etc/munge/munge.key ] || runuser -u munge -- /usr/sbin/mungekey --create
if ! running /run/munge/munged.pid; then runuser -u munge -- /usr/sbin/munged; fi
for daemon in slurmctld slurmd; do
    if running "/run/$daemon.pid" && [ "$changed" = 1 ]; then
        kill "$(cat "/run/$daemon.pid")"
        while running "/run/$daemon.pid"; do sleep 0.2; done
    fi
    if ! running "/run/$daemon.pid"; then "/usr/sbin/$daemon"; fi
done

for _ in $(seq 60); do  # the node registers within seconds
    if sinfo -h -n "$host" -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
        echo "SLURM $(sinfo -V | cut -d' ' -f2) is up: node $host, $(sinfo -h -o %c) CPUs," \
             "partition debug (sinfo, squeue, sbatch; logs in /var/log/slurm/)"
        exit 0
    fi
    sleep 0.5
done
echo "error: the node did not come up; see /var/log/slurm/slurmctld.log and slurmd.log" >&2
exit 1
