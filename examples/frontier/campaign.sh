# shellcheck shell=bash
# Job chains: one `sbatch` trains a run to its end over as many jobs as it takes (docs/campaigns.md).
# Sourced by every training script, which then calls, in this order:
#     campaign_begin "$@"       before env.sh (the successor must get the submitter's environment, not the modules'):
#                               names the run folder, exits 0 at once on a finished run, stops a crash loop,
#                               submits the successor (sbatch --dependency=afterany:<this job>)
#     campaign_run srun ...     runs the job step in the background and forwards USR1/TERM to it (a trap fires only
#                               while the shell waits), then: a finished run cancels its successor, hosts that lost
#                               ranks are excluded from the successor, a crash loop cancels it; exits with the step's code
#
# Settings (environment, default):
#   RUN_NAME              the run; one name, one folder, any number of jobs (the job name, #SBATCH -J / sbatch -J)
#   RUN_DIR               $MEGATRON_DIR/runs/$RUN_NAME: logs, TensorBoard, campaign.tsv (one line per job)
#   CKPT_DIR              $RUN_DIR/checkpoints: --save and --load (checkpoints, finished, save_time.json, failures.jsonl)
#   CAMPAIGN_CHAIN        1: submit a successor; 0: this job runs alone
#   CAMPAIGN_MAX_STALLED  2: after this many jobs in a row without a new checkpoint, no successor runs
#   CAMPAIGN_MIN_NODES    unset: the successor asks for this job's node count; MIN: for MIN up to this job's
#                         (sbatch -N MIN-MAX), so it starts on the nodes left when some are excluded or busy and
#                         resumes at the smaller data-parallel size (the trainer refuses a range with a node count
#                         that cannot serve the run, in one line before training)
# Set by the chain itself: CAMPAIGN_PREV (the job this one follows).

# shellcheck disable=SC2034  # RUN_NAME / RUN_DIR / CKPT_DIR are read by the scripts that source this file
campaign_begin() {
    RUN_NAME=${RUN_NAME:-${SLURM_JOB_NAME:-run}}
    RUN_DIR=${RUN_DIR:-$MEGATRON_DIR/runs/$RUN_NAME}
    CKPT_DIR=${CKPT_DIR:-$RUN_DIR/checkpoints}
    CAMPAIGN_LEDGER=$RUN_DIR/campaign.tsv
    CAMPAIGN_SUCCESSOR=
    mkdir -p "$RUN_DIR"
    if [[ -f $CKPT_DIR/finished ]]; then
        echo "campaign: run $RUN_NAME is finished at iteration $(campaign_finished_iteration) ($CKPT_DIR/finished):" \
             "nothing to do; to train further, raise the target and remove that file" >&2
        exit 0
    fi
    campaign_check_min_nodes
    local job=${SLURM_JOB_ID:-manual} latest stalled
    latest=$(campaign_latest)
    CAMPAIGN_START_LATEST=$latest
    if [[ -n ${CAMPAIGN_PREV:-} ]]; then
        stalled=$(campaign_stalled "$latest")
        if (( stalled >= ${CAMPAIGN_MAX_STALLED:-2} )); then
            echo "campaign: stopping run $RUN_NAME: the last $stalled jobs ended without a new checkpoint in" \
                 "$CKPT_DIR (latest: $latest); job $job exits without training or a successor: fix the cause" \
                 "(see those jobs' logs), then sbatch again" >&2
            exit 1
        fi
    fi
    local prior
    prior=$(campaign_successor_of "$job")
    if [[ -n $prior ]]; then  # a requeued job: its successor is already in the queue
        CAMPAIGN_SUCCESSOR=$prior
    elif [[ ${SLURM_JOB_QOS:-} == debug ]]; then
        echo "campaign: -q debug: OLCF prohibits job chains there, so this job runs alone (no successor)" >&2
    elif [[ ${CAMPAIGN_CHAIN:-1} == 0 || -z ${SLURM_JOB_ID:-} ]]; then
        :  # asked to run alone, or not a batch job
    else
        campaign_submit "$@"
    fi
    [[ -n $prior ]] || printf '%s\t%s\t%s\t%s\n' "$job" "${CAMPAIGN_PREV:--}" "$latest" "${CAMPAIGN_SUCCESSOR:--}" \
        >> "$CAMPAIGN_LEDGER"
    local lead
    lead=$(campaign_signal_lead)
    if [[ -n $lead ]]; then  # the trainer warns at start when its predicted save would not fit in this lead
        export MEGATRON_SIGNAL_LEAD_SECS=$lead
    fi
}

# The successor: same script, arguments, name, nodes, account, partition, QOS and time limit; the submitter's
# environment (CAMPAIGN_PREV added); the nodes earlier jobs of the run failed on excluded.
campaign_submit() {
    local -a opts=(--parsable --dependency="afterany:$SLURM_JOB_ID" --export="ALL,CAMPAIGN_PREV=$SLURM_JOB_ID")
    local limit exclude out
    [[ -z ${SLURM_JOB_NAME:-} ]] || opts+=(-J "$SLURM_JOB_NAME")
    [[ -z ${SLURM_JOB_NUM_NODES:-} ]] || opts+=(-N "$(campaign_node_range)")
    [[ -z ${SLURM_JOB_ACCOUNT:-} ]] || opts+=(-A "$SLURM_JOB_ACCOUNT")
    [[ -z ${SLURM_JOB_PARTITION:-} ]] || opts+=(-p "$SLURM_JOB_PARTITION")
    [[ -z ${SLURM_JOB_QOS:-} ]] || opts+=(-q "$SLURM_JOB_QOS")
    limit=$(squeue -h -j "$SLURM_JOB_ID" -o %l 2>/dev/null || true)
    [[ ! $limit =~ ^[0-9][0-9:-]*$ ]] || opts+=(-t "$limit")
    exclude=$(cat "$RUN_DIR/campaign.exclude" 2>/dev/null || true)
    [[ -z $exclude ]] || opts+=(--exclude="$exclude")
    # $0 is the batch script (Slurm's copy of it); sbatch reads it now, so the copy may vanish later.
    if out=$(cd "${SLURM_SUBMIT_DIR:-$PWD}" && sbatch "${opts[@]}" "$0" "$@"); then
        CAMPAIGN_SUCCESSOR=${out%%;*}
        echo "campaign: run $RUN_NAME: submitted job $CAMPAIGN_SUCCESSOR to continue after job $SLURM_JOB_ID" >&2
    else
        echo "campaign: sbatch of the successor failed: this job runs alone (resubmit by hand to continue)" >&2
    fi
}

# CAMPAIGN_MIN_NODES, when set in a job: a node count from 1 to this job's, else one line and exit before training.
campaign_check_min_nodes() {
    local min=${CAMPAIGN_MIN_NODES:-} nodes=${SLURM_JOB_NUM_NODES:-}
    [[ -n $min && -n $nodes ]] || return 0
    if [[ ! $min =~ ^[1-9][0-9]*$ ]] || (( min > nodes )); then
        echo "campaign: CAMPAIGN_MIN_NODES=$min is not a node count from 1 to this job's $nodes: set it to one" \
             "(the successor then asks for -N MIN-$nodes) or unset it; job ${SLURM_JOB_ID:-manual} exits without" \
             "training or a successor" >&2
        exit 1
    fi
}

# What the successor asks Slurm for: this job's node count, or with CAMPAIGN_MIN_NODES the range MIN-that (Slurm
# grants as many as it can without delaying the start).
campaign_node_range() {
    local min=${CAMPAIGN_MIN_NODES:-$SLURM_JOB_NUM_NODES}
    if (( min < SLURM_JOB_NUM_NODES )); then
        echo "$min-$SLURM_JOB_NUM_NODES"
    else
        echo "$SLURM_JOB_NUM_NODES"
    fi
}

campaign_run() {
    "$@" &
    CAMPAIGN_STEP_PID=$!
    trap 'campaign_forward USR1' USR1
    trap 'campaign_forward TERM' TERM
    local rc=0 status have=0
    while :; do
        CAMPAIGN_SIGNALLED=0
        if wait "$CAMPAIGN_STEP_PID"; then status=0; else status=$?; fi
        if (( status == 127 && have )); then
            break  # reaped by the previous wait: keep its status
        fi
        rc=$status
        have=1
        if (( ! CAMPAIGN_SIGNALLED || status <= 128 )); then
            break  # the step ended; otherwise a forwarded signal interrupted `wait`: wait again
        fi
    done
    trap - USR1 TERM
    campaign_end "$rc"
}

campaign_forward() {
    CAMPAIGN_SIGNALLED=1
    echo "campaign: SIG$1 received by the batch shell: forwarded to the job step (every rank saves and exits)" >&2
    kill -s "$1" "$CAMPAIGN_STEP_PID" 2>/dev/null || true
}

campaign_end() {
    local rc=$1 latest stalled
    latest=$(campaign_latest)
    if [[ -f $CKPT_DIR/finished ]]; then
        if [[ -n $CAMPAIGN_SUCCESSOR ]]; then
            scancel "$CAMPAIGN_SUCCESSOR" || true
            echo "campaign: run $RUN_NAME finished at iteration $(campaign_finished_iteration): cancelled the" \
                 "pending successor job $CAMPAIGN_SUCCESSOR" >&2
        else
            echo "campaign: run $RUN_NAME finished at iteration $(campaign_finished_iteration)" >&2
        fi
        exit "$rc"
    fi
    campaign_exclude_failed_nodes
    if [[ -n $CAMPAIGN_SUCCESSOR && $latest == "$CAMPAIGN_START_LATEST" ]]; then
        stalled=$(campaign_stalled "$latest")
        if (( stalled >= ${CAMPAIGN_MAX_STALLED:-2} )); then
            scancel "$CAMPAIGN_SUCCESSOR" || true
            echo "campaign: stopping run $RUN_NAME: $stalled jobs in a row ended without a new checkpoint in" \
                 "$CKPT_DIR (latest: $latest): cancelled the successor job $CAMPAIGN_SUCCESSOR; fix the cause" \
                 "(see those jobs' logs), then sbatch again" >&2
        fi
    fi
    exit "$rc"
}

# Hosts with a hardware failure, or two failures of any kind, in the run's records: kept away from the successor
# (and, through campaign.exclude, from every later one; deleting a host's records gives it another chance).
campaign_exclude_failed_nodes() {
    local found="" host why hosts="" named=""
    if [[ -s $CKPT_DIR/failures.jsonl ]]; then
        found=$("${PYTHON:-python3}" "$MEGATRON_DIR/tools/campaign_nodes.py" "$CKPT_DIR/failures.jsonl") || found=""
    fi
    while IFS=$'\t' read -r host why; do
        [[ -n $host ]] || continue
        hosts+=${hosts:+,}$host
        named+=${named:+; }"$host ($why)"
    done <<< "$found"
    if [[ -z $hosts ]]; then
        rm -f "$RUN_DIR/campaign.exclude"
        return 0
    fi
    printf '%s\n' "$hosts" > "$RUN_DIR/campaign.exclude"
    if [[ -n $CAMPAIGN_SUCCESSOR ]]; then
        if scontrol update "JobId=$CAMPAIGN_SUCCESSOR" "ExcNodeList=$hosts"; then
            echo "campaign: successor job $CAMPAIGN_SUCCESSOR excludes $named" >&2
        else
            echo "campaign: could not update successor job $CAMPAIGN_SUCCESSOR's excluded nodes ($hosts)" >&2
        fi
    fi
}

campaign_latest() {
    local tag=-
    if [[ -f $CKPT_DIR/latest ]]; then
        read -r tag < "$CKPT_DIR/latest" || true
    fi
    echo "${tag:--}"
}

campaign_finished_iteration() {
    sed -n 's/.*"iteration": *\([0-9][0-9]*\).*/\1/p' "$CKPT_DIR/finished" 2>/dev/null || true
}

# How many of the latest jobs (ledger lines) started on checkpoint $1 and so wrote none after it, counting back to
# and including the last job submitted by hand (a new start resets the count).
campaign_stalled() {
    local latest=$1 n=0 i job prev at succ
    local -a lines=()
    [[ ! -f $CAMPAIGN_LEDGER ]] || mapfile -t lines < "$CAMPAIGN_LEDGER"
    for (( i = ${#lines[@]} - 1; i >= 0; i-- )); do
        IFS=$'\t' read -r job prev at succ <<< "${lines[i]}"
        [[ $at == "$latest" ]] || break
        n=$((n + 1))
        [[ $prev != - ]] || break
    done
    echo "$n"
}

campaign_successor_of() {
    local job prev at succ
    [[ -f $CAMPAIGN_LEDGER ]] || return 0
    while IFS=$'\t' read -r job prev at succ; do
        if [[ $job == "$1" && $succ != - ]]; then
            echo "$succ"
        fi
    done < "$CAMPAIGN_LEDGER"
}

# The lead of this script's `#SBATCH --signal=[B:]SIG@<lead>` (the trainer compares its predicted save with it).
campaign_signal_lead() {
    sed -n 's/^#SBATCH[[:space:]][[:space:]]*--signal=\(B:\)\{0,1\}[A-Z0-9]*@\([0-9][0-9]*\).*/\2/p' "$0" 2>/dev/null \
        | head -n 1
}
