#!/usr/bin/env bash
# bertpipe's Beam job on Flink or Spark through Beam's portable job server
# (infra/beam/job-server.sh starts one).
#
#   JOB_ENDPOINT=jobserver.internal:8099 infra/beam/portable.sh \
#       input.paths='[s3://my-bucket/corpus/]' tokenizer=s3://my-bucket/tokenizer \
#       output=s3://my-bucket/shards
#
# Arguments are `bertpipe preprocess` overrides; the Beam options are built here and passed
# after `--`. Settings (environment):
#   JOB_ENDPOINT        host:port of the job server (its port 8099)
#   ARTIFACT_ENDPOINT   its artifact service (default: JOB_ENDPOINT's host, port 8098)
#   ENVIRONMENT_TYPE    where bertpipe's DoFns run: EXTERNAL (default: a worker pool of
#                       infra/beam/Dockerfile.worker's image, started with --worker_pool, next
#                       to every task manager) or DOCKER (the task managers start the image)
#   ENVIRONMENT_CONFIG  EXTERNAL: the worker pool's address as the task managers see it
#                       (default localhost:50000); DOCKER: the image (default WORKER_IMAGE)
#   PARALLELISM         Flink: --parallelism (default: the cluster's)
#   EXTRA_BEAM_ARGS     more Beam options; PREPROCESS_CONFIG (configs/preprocess.yaml)
#   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, FSSPEC_S3_ENDPOINT_URL: for s3:// here; the
#                       worker pool needs the same (docker run -e ...)
#
# Inputs, tokenizer and output must be on storage that this machine and every worker see
# (s3://, gs://, or one shared filesystem mounted at the same path everywhere).
set -euo pipefail

: "${JOB_ENDPOINT:?set JOB_ENDPOINT (host:port of the Beam job server, port 8099)}"
CONFIG=${PREPROCESS_CONFIG:-configs/preprocess.yaml}
ENVIRONMENT_TYPE=${ENVIRONMENT_TYPE:-EXTERNAL}
case "$ENVIRONMENT_TYPE" in
EXTERNAL) ENVIRONMENT_CONFIG=${ENVIRONMENT_CONFIG:-localhost:50000} ;;
DOCKER) ENVIRONMENT_CONFIG=${ENVIRONMENT_CONFIG:-${WORKER_IMAGE:?set WORKER_IMAGE or ENVIRONMENT_CONFIG}} ;;
*)
    echo "portable.sh: ENVIRONMENT_TYPE must be EXTERNAL or DOCKER, not $ENVIRONMENT_TYPE" >&2
    exit 2
    ;;
esac
read -r -a extra <<<"${EXTRA_BEAM_ARGS:-}"
if [[ -n "${PARALLELISM:-}" ]]; then
    extra+=("--parallelism=$PARALLELISM")
fi

exec bertpipe preprocess --config "$CONFIG" "$@" -- \
    --runner=PortableRunner \
    --job_endpoint="$JOB_ENDPOINT" \
    --artifact_endpoint="${ARTIFACT_ENDPOINT:-${JOB_ENDPOINT%:*}:8098}" \
    --environment_type="$ENVIRONMENT_TYPE" \
    --environment_config="$ENVIRONMENT_CONFIG" \
    "${extra[@]}"
