#!/usr/bin/env bash
# bertpipe's Beam job on a running Dask cluster (Beam's DaskRunner).
#
#   DASK_SCHEDULER=tcp://dask-scheduler.internal:8786 infra/beam/dask.sh \
#       input.paths='[s3://my-bucket/corpus/]' tokenizer=s3://my-bucket/tokenizer \
#       output=s3://my-bucket/shards
#
# A cluster: `dask scheduler` on one host, `dask worker tcp://HOST:8786 --nworkers N
# --nthreads 1` on each of the others, every one in an environment with bertpipe installed
# (`pip install --constraint constraints.txt '.[dask]'`) and TOKENIZERS_PARALLELISM=false;
# infra/slurm/preprocess.sbatch starts one inside a SLURM allocation. Inputs, tokenizer and
# output must be on storage every worker sees.
#
# bertpipe passes --runner=DaskRunner on as Beam's full class path (Beam itself does not know
# the short name). The Dask runner collects no Beam metrics; bertpipe's manifest statistics are
# computed by the pipeline itself and do not depend on them.
# Settings: DASK_SCHEDULER (the scheduler's address), PREPROCESS_CONFIG, EXTRA_BEAM_ARGS.
set -euo pipefail

: "${DASK_SCHEDULER:?set DASK_SCHEDULER (e.g. tcp://dask-scheduler:8786)}"
CONFIG=${PREPROCESS_CONFIG:-configs/preprocess.yaml}
read -r -a extra <<<"${EXTRA_BEAM_ARGS:-}"

exec bertpipe preprocess --config "$CONFIG" "$@" -- \
    --runner=DaskRunner \
    --dask_client_address="$DASK_SCHEDULER" \
    "${extra[@]}"
