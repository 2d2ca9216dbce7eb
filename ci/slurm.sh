#!/usr/bin/env bash
# A real one-node Slurm cluster (Debian's slurm-wlm and munge), then the example job script
# apps/examples/train-mnist.sbatch as written, submitted with 2 tasks on this node: srun starts
# the 2 ranks of a short train-mnist run, which find each other through Slurm's variables; then
# the PBS script apps/examples/train-mnist.pbs through Slurm's qsub (slurm-wlm-torque), whose
# mpirun starts the 2 ranks.
# Checks the job's exit state and its output. Needs root (the daemons run as root, as CI does).
#
#     bash ci/slurm.sh [OUT_DIR]     # from the repository root, after the release build
#
# The node's CPU count and memory are its real ones (`slurmd -C`); state lives under OUT_DIR,
# and the daemons are stopped on exit.
set -euo pipefail

out=$(realpath -m "${1:-target/ci-slurm}")
rm -rf "$out"
mkdir -p "$out/state" "$out/spool"

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

# munge: a key if the package left none, then the daemon (it refuses to start twice: fine).
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 status=none
fi
chown -R munge:munge /etc/munge 2>/dev/null || true
chmod 600 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
pgrep -x munged >/dev/null || munged --force
munge -n | unmunge >/dev/null

# slurm.conf for this one node, with what slurmd sees of it.
host=$(hostname -s)
node=$(slurmd -C | head -1 | sed "s/^NodeName=[^ ]*/NodeName=$host/")
mkdir -p /etc/slurm
cat >/etc/slurm/slurm.conf <<EOF
ClusterName=ddp-ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation=$out/state
SlurmdSpoolDir=$out/spool
SlurmctldPidFile=$out/slurmctld.pid
SlurmdPidFile=$out/slurmd.pid
SlurmctldLogFile=$out/slurmctld.log
SlurmdLogFile=$out/slurmd.log
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
$node State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

cleanup() {
  scancel --user=root >/dev/null 2>&1 || true
  [ -f "$out/slurmd.pid" ] && kill "$(cat "$out/slurmd.pid")" 2>/dev/null || true
  [ -f "$out/slurmctld.pid" ] && kill "$(cat "$out/slurmctld.pid")" 2>/dev/null || true
}
trap cleanup EXIT
slurmctld -i
slurmd

# Wait (bounded) for the node to come up idle.
for _ in $(seq 60); do
  state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 1
done
if [ "$state" != idle ]; then
  echo "slurm: node $host is '${state:-unknown}', not idle, after 60 s" >&2
  tail -n 20 "$out/slurmctld.log" "$out/slurmd.log" >&2 || true
  exit 1
fi
sinfo

# The example as written, resized for this node (flags on the command line override the
# script's #SBATCH lines); arguments after the script go to train-mnist.
export DDP_DATA_DIR=${DDP_DATA_DIR:-$HOME/.cache/ddp-rs}
set +e
timeout 900 sbatch --wait --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --time=00:15:00 \
  --output="$out/job-%j.out" apps/examples/train-mnist.sbatch \
  --epochs 1 --max-steps 100 --test-samples 2000 --log-interval 20 \
  --checkpoint-dir "$out/run/checkpoints" --metrics-dir "$out/run/metrics" \
  --export "$out/run/model.safetensors"
rc=$?
set -e
job_out=$(find "$out" -maxdepth 1 -name "job-*.out" | head -1)
[ -n "$job_out" ] && cat "$job_out"
job=${job_out##*/job-}
job=${job%.out}
scontrol show job "$job" | tee "$out/job.txt" | grep -E "JobState|ExitCode|NumTasks" || true
if [ "$rc" -ne 0 ]; then
  echo "slurm: sbatch --wait exited $rc" >&2
  exit 1
fi
grep -q "JobState=COMPLETED" "$out/job.txt" || { echo "slurm: job $job did not complete" >&2; exit 1; }
grep -q "ExitCode=0:0" "$out/job.txt" || { echo "slurm: job $job exit code not 0:0" >&2; exit 1; }
# Both ranks were one group of 2, formed through Slurm's variables, and it learned.
grep -q "world 2" "$job_out" || { echo "slurm: no 'world 2' in the job's output" >&2; exit 1; }
accuracy=$(sed -n 's/.*done:.*test accuracy \([0-9.]*\)%.*/\1/p' "$job_out" | head -1)
python3 -c "import sys; a=float('${accuracy:-0}'); print(f'slurm job {sys.argv[1]}: test accuracy {a}%'); sys.exit(0 if a >= 90 else 1)" "$job" ||
  { echo "slurm: accuracy ${accuracy:-missing} below 90%" >&2; exit 1; }
test -s "$out/run/model.safetensors" || { echo "slurm: no exported model" >&2; exit 1; }
echo "slurm: OK"

# The trainer's own --nproc-per-node (PyTorch's mp.spawn) inside an sbatch script: the batch
# step's SLURM_PROCID/SLURM_NTASKS describe no rank yet, so spawning is allowed there.
printf '#!/bin/bash\ntarget/release/train-mnist --nproc-per-node 2 --epochs 1 --max-steps 20 --threads 1 --test-samples 1000\n' \
  >"$out/spawn.sh"
timeout 600 sbatch --wait --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 \
  --output="$out/spawn.out" "$out/spawn.sh" ||
  { cat "$out/spawn.out" >&2 || true; echo "slurm: spawn in a batch script failed" >&2; exit 1; }
cat "$out/spawn.out"
grep -q "\[rank 0\] training cnn: world 2 (launcher: spawn" "$out/spawn.out" ||
  { echo "slurm: spawn in a batch script did not train on world 2" >&2; exit 1; }
echo "slurm spawn: OK"

# srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE without MPICH's local variables: the ranks take their
# local rank and size from Slurm's.
timeout 600 srun --mpi=pmi2 -N1 -n2 --cpus-per-task=1 target/release/train-mnist --epochs 1 \
  --max-steps 20 --test-samples 1000 | tee "$out/pmi2.out"
grep -q "world 2 (launcher: mpich; 1 compute threads per rank)" "$out/pmi2.out" ||
  { echo "slurm: srun --mpi=pmi2 did not form world 2 through PMI" >&2; exit 1; }
echo "slurm pmi2: OK"

# The PBS script as written, through Slurm's qsub (slurm-wlm-torque: it turns the job into an
# sbatch job, and sbatch reads the #PBS lines), on the same cluster: mpirun starts the 2 ranks.
# -j oe -o: one output file of our choosing (the wrapper reads no #PBS line itself);
# -W block=true: qsub returns when the job has ended. mpirun runs as root here, as CI does.
if ! command -v qsub >/dev/null || ! command -v mpirun >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm-torque openmpi-bin >/dev/null
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
set +e
pbs_job=$(timeout 900 qsub -V -j oe -o "$out/pbs-job.out" -W block=true \
  apps/examples/train-mnist.pbs --epochs 1 --max-steps 100 --threads 1 --test-samples 2000 \
  --log-interval 50 --checkpoint-dir "$out/pbs-run/checkpoints" \
  --metrics-dir "$out/pbs-run/metrics" --export "$out/pbs-run/model.safetensors")
rc=$?
set -e
pbs_job=$(echo "$pbs_job" | head -1)
cat "$out/pbs-job.out" || true
scontrol show job "$pbs_job" | tee "$out/pbs-job.txt" | grep -E "JobState|ExitCode|NumTasks" || true
[ "$rc" -eq 0 ] || { echo "pbs: qsub exited $rc" >&2; exit 1; }
grep -q "JobState=COMPLETED" "$out/pbs-job.txt" || { echo "pbs: job $pbs_job did not complete" >&2; exit 1; }
grep -q "ExitCode=0:0" "$out/pbs-job.txt" || { echo "pbs: job $pbs_job exit code not 0:0" >&2; exit 1; }
# One group of 2 that mpirun's variables formed, and it learned.
grep -q "world 2 (launcher: open-mpi; 1 compute threads per rank)" "$out/pbs-job.out" ||
  { echo "pbs: no 'world 2 (launcher: open-mpi; ...)' in the job's output" >&2; exit 1; }
accuracy=$(sed -n 's/.*done:.*test accuracy \([0-9.]*\)%.*/\1/p' "$out/pbs-job.out" | head -1)
python3 -c "import sys; a=float('${accuracy:-0}'); print(f'pbs job {sys.argv[1]}: test accuracy {a}%'); sys.exit(0 if a >= 90 else 1)" "$pbs_job" ||
  { echo "pbs: accuracy ${accuracy:-missing} below 90%" >&2; exit 1; }
test -s "$out/pbs-run/model.safetensors" || { echo "pbs: no exported model" >&2; exit 1; }
echo "pbs: OK"
