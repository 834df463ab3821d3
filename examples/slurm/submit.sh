#!/bin/bash
# Submit an array of N tasks and a dependent summary job; prints the run id.
#   examples/slurm/submit.sh spec.yaml 4 [BASELINE_RUN]
set -euo pipefail
SPEC=${1:?usage: submit.sh SPEC N_TASKS [BASELINE_RUN]}
N=${2:-4}
here=$(dirname "$0")
jid=$(sbatch --parsable --array=0-$((N - 1)) "$here/generate-array.sbatch" "$SPEC")
sbatch --parsable --dependency=afterany:"$jid" "$here/after-array.sbatch" "slurm-$jid" ${3:-} >/dev/null
echo "slurm-$jid"
