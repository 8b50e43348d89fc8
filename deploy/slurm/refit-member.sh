#!/usr/bin/env bash
# One elastic-refit member inside a Slurm step: `srun ... refit-member.sh ROLE COMMAND...`.
#
# Derives the member's identity from Slurm's variables into ELASTIC_REFIT_* (read by
# RefitConfig.from_env), runs COMMAND, and restarts it in place when it is killed by a
# signal (a new process, so a new incarnation). A member that finished writes a marker
# under REFIT_STATE_DIR; a relaunched step skips members that are done. See README.md in
# this folder for every variable.
set -u

role=${1:?usage: refit-member.sh trainer|inference COMMAND...}
shift
if [[ $role != trainer && $role != inference ]]; then
    echo "refit-member: role must be trainer or inference, got '$role'" >&2
    exit 2
fi
if (($# == 0)); then
    echo "refit-member: no command given" >&2
    exit 2
fi

# Identity: the rank within this role's step. REFIT_RANK replaces SLURM_PROCID for a
# member relaunched by hand as a one-task step (`srun -n1 --export=ALL,REFIT_RANK=1 ...`).
rank=${REFIT_RANK:-${SLURM_PROCID:?SLURM_PROCID is not set: run this under srun}}
node=${SLURMD_NODENAME:-$(hostname -s)}
export ELASTIC_REFIT_ROLE=$role
export ELASTIC_REFIT_LAYOUT_RANK=$rank
export ELASTIC_REFIT_MEMBER_ID=$role-$rank
export ELASTIC_REFIT_HOST=${ELASTIC_REFIT_HOST:-$node}
export ELASTIC_REFIT_DOMAIN=${ELASTIC_REFIT_DOMAIN:-$node}
: "${ELASTIC_REFIT_JOB:?ELASTIC_REFIT_JOB is not set (refit.sbatch sets it)}"
: "${ELASTIC_REFIT_ETCD:?ELASTIC_REFIT_ETCD is not set (refit.sbatch sets it)}"
# GPU members: one device per task. With --gpus-per-task=1 Slurm leaves one visible
# device (cuda:0); otherwise the task's local id picks it.
if [[ -z ${ELASTIC_REFIT_DEVICE:-} && ${ELASTIC_REFIT_BACKEND:-gloo} == nccl* ]]; then
    if [[ -n ${CUDA_VISIBLE_DEVICES:-} && ${CUDA_VISIBLE_DEVICES} != *,* ]]; then
        export ELASTIC_REFIT_DEVICE=cuda:0
    else
        export ELASTIC_REFIT_DEVICE=cuda:${SLURM_LOCALID:-0}
    fi
fi
# ELASTIC_REFIT_INCARNATION is left unset: every process draws a fresh random one.
unset ELASTIC_REFIT_INCARNATION

member=$ELASTIC_REFIT_MEMBER_ID
where="job ${SLURM_JOB_ID:-?} step ${SLURM_STEP_ID:-?} node $node (${SLURM_NODEID:-?}) local ${SLURM_LOCALID:-?} restart ${SLURM_RESTART_COUNT:-0}"
state=${REFIT_STATE_DIR:-}
if [[ -n $state ]]; then
    mkdir -p "$state/done" "$state/failed"
    if [[ -e $state/done/$member ]]; then
        echo "refit-member: $member already done ($where)" >&2
        exit 0
    fi
    if [[ -e $state/failed/$member ]]; then
        echo "refit-member: $member failed before (exit $(cat "$state/failed/$member")); not restarted ($where)" >&2
        exit "$(cat "$state/failed/$member")"
    fi
fi

stopping=0
trap 'stopping=1' TERM INT  # Slurm signals every process of the step; the child exits too
max_restarts=${REFIT_MAX_RESTARTS:-3}
restarts=0
while :; do
    echo "refit-member: start $member rank $rank ($where, restarts $restarts)" >&2
    "$@"
    rc=$?
    if ((rc == 0)); then
        [[ -n $state ]] && : >"$state/done/$member"
        exit 0
    fi
    # A signal death (>= 128: SIGKILL, OOM kill, a crash) and exit 1 (a runtime fault the
    # worker gave up on) are restarted (exit 1 unless REFIT_RESTART_ON_FAILURE=0); exit 2
    # (bad input) and 3 (a wrong byte was served) never: a restart would not fix them.
    restartable=0
    ((rc >= 128)) && restartable=1
    ((rc == 1)) && [[ ${REFIT_RESTART_ON_FAILURE:-1} == 1 ]] && restartable=1
    if ((stopping || !restartable || restarts >= max_restarts)); then
        echo "refit-member: $member exited $rc; giving up ($where)" >&2
        ((!stopping)) && [[ -n $state ]] && echo "$rc" >"$state/failed/$member"
        exit "$rc"
    fi
    restarts=$((restarts + 1))
    echo "refit-member: $member exited $rc; restarting in place ($restarts/$max_restarts)" >&2
    sleep "${REFIT_RESTART_DELAY_S:-1}"
done
