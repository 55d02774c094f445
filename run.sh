#!/usr/bin/env bash
# Launch a training script of this collection with torchrun: one node, several nodes, or inside SLURM.
#
#   ./run.sh SCRIPT [SCRIPT ARGS...]
#
# Environment (defaults): NNODES (1; MIN:MAX such as 1:2 for an elastic job), NODE_RANK (0), NPROC_PER_NODE
# (GPUs, else 3), MASTER_ADDR (needed for NNODES > 1 or MIN:MAX), MASTER_PORT (29500), MAX_RESTARTS (0; 3 when
# elastic), SHUTDOWN_TIMEOUT (120: seconds the processes get to finish their step and save when torchrun stops
# the rest of a failed job), LOG_DIR (none: one log file per rank when set), RDZV_ID (SLURM_JOB_ID, else
# "pipeline": the nodes of a job meet under it), RDZV_CONF (none: torchrun's --rdzv-conf, e.g. last_call_timeout=5
# to restart sooner after a node is lost), PYTHON (python3), DRY_RUN (1: print the command, start nothing). Under
# SLURM, NNODES, NODE_RANK and MASTER_ADDR default to what the allocation says; set ones win.
#
# Each launch gets an id of its own, RUN_SH_LAUNCH_ID (under SLURM the job's, which a requeue keeps): the processes
# record their nodes' ids in the run lock and in the checkpoints, so that an attempt of the job (a torchrun
# restart) knows the checkpoints it saved and the lock an earlier attempt left, and another job, whatever its
# RDZV_ID, is never taken for one. A mistake that every process finds (a flag, an input, another job using
# --checkpoint-dir) ends the job at once, with its one line and status 1 (2 for the command line): no restart.
#
# Elastic (NNODES=MIN:MAX): the nodes meet at MASTER_ADDR:MASTER_PORT; a node lost (or back) restarts the job
# on the processes there are, and the script resumes its newest checkpoint at a layout that fits them (the same
# run: see docs/launching.md). The node at MASTER_ADDR hosts the meeting point and must survive; beyond that,
# an etcd rendezvous (torchrun --rdzv-backend etcd-v2).
#
# 2 nodes x 4 GPUs, the pipeline across the nodes and 4 data-parallel replicas inside each (one stage per node):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC_PER_NODE=4 ./run.sh train_pipeline_gpipe.py --dp 4 ...  # node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 NPROC_PER_NODE=4 ./run.sh train_pipeline_gpipe.py --dp 4 ...  # node1
# 4 nodes x 8 GPUs, all three: tensor parallel inside a node (--tp 8), 4 pipeline stages, one per node:
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=node0 NPROC_PER_NODE=8 ./run.sh train_pipeline_gpipe.py --tp 8 ...
# or 2 pipeline stages of 2 nodes each, 2 replicas x tp 8: --dp 2 --tp 8. python plan.py --gpus 32 ... ranks them.
# torchrun gives each node a contiguous block of ranks, and the scripts' mesh is (pp, dp, tp) with tp
# innermost: a stage's tensor-parallel ranks, then its replicas, are neighbouring ranks. With --tp dividing
# NPROC_PER_NODE, tp's per-layer all-reduces stay inside a node; with --dp x --tp dividing it, the replicas'
# collectives too; only the pipeline's activations cross nodes.
set -euo pipefail

die() { echo "run.sh: error: $*" >&2; exit 2; }

# The first host of a SLURM node list such as "node[07-08,10],login1" is node07. scontrol knows every
# syntax; the fallback covers plain names and bracket ranges, so the launcher also works where scontrol is
# missing (and in tests).
first_host() {
    local list=$1 hosts
    if command -v scontrol >/dev/null 2>&1 && hosts=$(scontrol show hostnames "$list" 2>/dev/null) \
        && [[ -n $hosts ]]; then
        echo "${hosts%%$'\n'*}"
        return
    fi
    local first="" depth=0 i c re='^([^[]*)\[([^],-]*)[^]]*\](.*)$'
    for ((i = 0; i < ${#list}; i++)); do
        c=${list:i:1}
        case $c in
            '[') depth=1 ;;
            ']') depth=0 ;;
            ',') ((depth)) || break ;;
            *) ;;
        esac
        first+=$c
    done
    while [[ $first =~ $re ]]; do
        first=${BASH_REMATCH[1]}${BASH_REMATCH[2]}${BASH_REMATCH[3]}
    done
    echo "$first"
}

# Must be a whole number; prints it without leading zeros (which bash arithmetic would read as octal).
count() {
    local name=$1 value=$2 min=$3
    [[ $value =~ ^[0-9]+$ ]] || die "$name='$value' is not a whole number; set $name to an integer >= $min"
    value=$((10#$value))
    ((value >= min)) || die "$name=$value is too small; set $name to an integer >= $min"
    echo "$value"
}

(($# >= 1)) || die "no script given; usage: ./run.sh SCRIPT [SCRIPT ARGS...]"
script=$1 && shift
# Relative to the current directory first, else next to run.sh, so `srun /path/run.sh train_x.py` works
# from any working directory (where checkpoints and metrics then go).
if [[ ! -f $script && $script != /* && -f "$(dirname "${BASH_SOURCE[0]}")/$script" ]]; then
    script="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$script"
fi
[[ -f $script ]] || die "no such script '$script'; give a training script such as train_pipeline_gpipe.py"
# Anything but 0 or 1 (true, yes, ...) is refused: a mistyped dry run must not start the real job.
[[ ${DRY_RUN:-0} =~ ^[01]$ ]] || die "DRY_RUN='$DRY_RUN' is neither 1 (print the command, start nothing) nor 0; set DRY_RUN=1"

slurm=""
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    nodelist=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
    : "${NNODES:=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}}"
    : "${NODE_RANK:=${SLURM_NODEID:-${SLURM_PROCID:-0}}}"
    if [[ -z ${MASTER_ADDR:-} && -n $nodelist ]]; then
        MASTER_ADDR=$(first_host "$nodelist")
    fi
    slurm="SLURM job $SLURM_JOB_ID"
fi

if [[ -z ${NPROC_PER_NODE:-} ]]; then
    # One process per visible GPU. CUDA_VISIBLE_DEVICES first: nvidia-smi ignores it, so it can list GPUs a
    # scheduler did not give us.
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
        IFS=, read -ra gpus <<<"$CUDA_VISIBLE_DEVICES"
        NPROC_PER_NODE=${#gpus[@]}
    elif command -v nvidia-smi >/dev/null 2>&1 && gpu_list=$(nvidia-smi -L 2>/dev/null) && [[ -n $gpu_list ]]; then
        NPROC_PER_NODE=$(grep -c '^GPU' <<<"$gpu_list" || true)
    fi
    ((${NPROC_PER_NODE:-0} > 0)) || NPROC_PER_NODE=3 # CPU: the collection's default of 3 stages
fi

NNODES=${NNODES:-1}
elastic=""
if [[ $NNODES == *:* ]]; then # MIN:MAX nodes
    min_nodes=$(count "NNODES' minimum" "${NNODES%%:*}" 1)
    max_nodes=$(count "NNODES' maximum" "${NNODES#*:}" 1)
    ((min_nodes <= max_nodes)) || die "NNODES=$NNODES: the minimum is above the maximum; set NNODES=MIN:MAX with MIN <= MAX"
    NNODES=$min_nodes:$max_nodes
    elastic=1
else
    NNODES=$(count NNODES "$NNODES" 1)
fi
NODE_RANK=$(count NODE_RANK "${NODE_RANK:-0}" 0)
NPROC_PER_NODE=$(count NPROC_PER_NODE "$NPROC_PER_NODE" 1)
MASTER_PORT=$(count MASTER_PORT "${MASTER_PORT:-29500}" 1)
restarts=0 && [[ -n $elastic ]] && restarts=3
MAX_RESTARTS=$(count MAX_RESTARTS "${MAX_RESTARTS:-$restarts}" 0)
SHUTDOWN_TIMEOUT=$(count SHUTDOWN_TIMEOUT "${SHUTDOWN_TIMEOUT:-120}" 1)
((MASTER_PORT <= 65535)) || die "MASTER_PORT=$MASTER_PORT is not a port; set MASTER_PORT between 1 and 65535"
[[ -n $elastic ]] || ((NODE_RANK < NNODES)) || die "NODE_RANK=$NODE_RANK but NNODES=$NNODES; set NODE_RANK between 0 and $((NNODES - 1))"
if [[ -n $elastic || $NNODES -gt 1 ]] && [[ -z ${MASTER_ADDR:-} ]]; then
    die "NNODES=$NNODES needs MASTER_ADDR; set MASTER_ADDR to the host name or IP of one of the nodes"
fi
PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON='$PYTHON' not found; set PYTHON to a Python with torch"

# torchrun via the interpreter, not the `torchrun` entry point, so it is the torch of $PYTHON (e.g. a venv).
# It leaves SIGTERM, SIGINT and SIGHUP to run.sh (below).
cmd=("$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS"
    --shutdown-timeout "$SHUTDOWN_TIMEOUT" --signals-to-handle SIGQUIT)
if [[ -n $elastic || $NNODES -gt 1 ]]; then
    # Several nodes: each attempt's processes meet in a store of their own. torchrun's shared one keeps the dead
    # processes' addresses, and a per-attempt prefix cannot serve: restart counts differ between the nodes.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
if [[ -n $elastic ]]; then
    # Any node may be lost or come back: no fixed node ranks.
    cmd+=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
        --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-pipeline}}" ${RDZV_CONF:+--rdzv-conf "$RDZV_CONF"})
    where="NNODES=$NNODES (elastic), rendezvous at $MASTER_ADDR:$MASTER_PORT"
elif ((NNODES > 1)); then
    # c10d: the agents meet at MASTER_ADDR:MASTER_PORT and, unlike the static backend, notice a failed
    # node, so MAX_RESTARTS restarts the whole job. Global ranks are assigned by the rendezvous.
    cmd+=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-backend c10d
        --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-pipeline}}")
    where="NNODES=$NNODES NODE_RANK=$NODE_RANK, rendezvous at $MASTER_ADDR:$MASTER_PORT"
else
    cmd+=(--standalone) # a free local port: several single-node jobs can share a machine
    where="one node"
fi
if [[ -n ${LOG_DIR:-} ]]; then
    if [[ ${DRY_RUN:-0} != 1 ]] && ! mkdir -p "$LOG_DIR" 2>/dev/null; then
        die "LOG_DIR='$LOG_DIR' cannot be created; set LOG_DIR to a writable directory"
    fi
    cmd+=(--log-dir "$LOG_DIR" --tee 3) # per-rank files, and still on the console
fi
cmd+=("$script" "$@")

report="run.sh: ${slurm:+$slurm: }$where, NPROC_PER_NODE=$NPROC_PER_NODE, MAX_RESTARTS=$MAX_RESTARTS"
if [[ ${DRY_RUN:-0} == 1 ]]; then
    echo "$report" >&2 && printf '%q ' "${cmd[@]}" && echo && exit 0
fi
# This launch: the node's part of the job's identity (host, pid and time: no two launches share it).
export RUN_SH_LAUNCH_ID=${SLURM_JOB_ID:+slurm-$SLURM_JOB_ID}
: "${RUN_SH_LAUNCH_ID:=$HOSTNAME-$$-$(date +%s)}"
state=$(mktemp -d "${TMPDIR:-/tmp}/run.sh.XXXXXX") ||
    die "cannot create a folder in ${TMPDIR:-/tmp}; set TMPDIR to a writable directory"
trap 'rm -rf "$state"' EXIT
# torchrun restarts a job whenever a process fails, whatever its status. A process ending on a mistake that every
# process finds writes its status here and exits 0 instead (checkpoint.final_status): torchrun ends the job. The
# file names this launch (run.sh's pid, the parent of torchrun, so of no other job's processes): a process of
# another launch that inherited the variable (a job started by one of this job's processes) leaves it alone.
export RUN_SH_STATUS_FILE=$state/status
echo $$ >"$RUN_SH_STATUS_FILE"
# A collective that waits past --timeout on a GPU: NCCL's watchdog dumps its flight recorder and ends the process
# (docs/launching.md). torchrun would set 1, which first aborts the communicators (and can hang in that); 3,
# torch's own default and torchtitan's, ends the process without. A value set before run.sh wins.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
# Stopping. A SIGTERM (SLURM's sbatch --signal=TERM@120, a preemption, a scheduler), SIGINT (Ctrl-C) or SIGHUP (a
# closed terminal, a dropped ssh) asks the job to stop after its step, with a checkpoint (the processes say so);
# another one, more than 2 s later, ends it at once. run.sh records the request in a file whose path it exports,
# which the training processes read when they start and after every step (so a request made while torchrun
# starts them, or restarts them, is kept), and passes the signal on to them. torchrun, and the processes it
# starts until they listen (checkpoint.run), ignore the three signals: torchrun would stop the processes and end
# with an error of its own, and a process importing torch would die (and be restarted, with MAX_RESTARTS, to
# train on). Its status is ours.
export PIPELINE_STOP_FILE=$state/stop
asked="" torchrun=""
# shellcheck disable=SC2329 # called by the traps below
stop() { # SIGNAL
    local now=${EPOCHREALTIME/[.,]/}
    now=${now:-$((SECONDS * 1000000))} # bash < 5: whole seconds
    if [[ -z $asked ]]; then
        asked=$now
        echo "SIG$1 $$" >"$PIPELINE_STOP_FILE" # this launch's request: kept by the processes it starts later
        [[ -z $torchrun ]] || pkill "-$1" -P "$torchrun" || true
    elif ((now - asked > 2000000)); then
        printf '\nrun.sh: SIG%s again: stopped at once, %s\n' "$1" \
            "without saving this step; the same command resumes from the newest checkpoint" >&2 || true
        if [[ -n $torchrun ]]; then
            mapfile -t workers < <(pgrep -P "$torchrun")
            kill -KILL "$torchrun" "${workers[@]}" 2>/dev/null || true
        fi
        exit $((128 + $(kill -l "$1")))
    fi
}
trap 'stop TERM' TERM
trap 'stop INT' INT
trap 'stop HUP' HUP
echo "$report" >&2
(
    trap '' TERM INT HUP
    exec "${cmd[@]}"
) &
torchrun=$!
status=0
wait "$torchrun" || status=$?
while kill -0 "$torchrun" 2>/dev/null; do # a signal ended `wait` early: torchrun's own status comes next
    status=0
    wait "$torchrun" || status=$?
done
mistake=$(sed -n 2p "$RUN_SH_STATUS_FILE" 2>/dev/null) || true # under the pid: a status the processes wrote
if ((status == 0)) && [[ $mistake =~ ^[0-9]+$ ]]; then
    status=$mistake # the processes ended on a mistake (they exited 0 so that torchrun would not restart)
fi
exit "$status"
