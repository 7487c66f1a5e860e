#!/usr/bin/env bash
# bertpipe's Beam job (`bertpipe preprocess`) on Google Cloud Dataflow.
#
#   export GCP_PROJECT=my-project GCP_REGION=europe-west4 GCS_BUCKET=my-bucket
#   export WORKER_IMAGE=europe-west4-docker.pkg.dev/my-project/bertpipe/bertpipe-beam-worker:0.1.0
#   infra/beam/dataflow.sh input.paths='[gs://my-bucket/corpus/]' \
#       tokenizer=gs://my-bucket/tokenizer output=gs://my-bucket/shards
#
# Arguments are `bertpipe preprocess` overrides; the Beam options are built here and passed
# after `--`. Settings (environment):
#   GCP_PROJECT, GCP_REGION  the Dataflow project and region (site-specific)
#   GCS_BUCKET               bucket for Beam's staging and temp files (site-specific)
#   WORKER_IMAGE             infra/beam/Dockerfile.worker, built and pushed where Dataflow can
#                            pull it: the workers run bertpipe's DoFns, so they need bertpipe
#                            installed (its Python major.minor must be the one running this)
#   MAX_WORKERS (50), MACHINE_TYPE (n2-standard-8), JOB_NAME, PREPROCESS_CONFIG
#   EXTRA_BEAM_ARGS          more Beam options, e.g. "--subnetwork=regions/.../subnetworks/x
#                            --service_account_email=...@....iam.gserviceaccount.com"
#   MLFLOW_TRACKING_URI      where the preprocess run and its manifests are logged
#
# The machine running this needs bertpipe with `apache-beam[gcp]` and gcsfs (pip install
# --constraint constraints.txt 'apache-beam[gcp]' gcsfs) and Google credentials (`gcloud auth
# application-default login` or GOOGLE_APPLICATION_CREDENTIALS). `bertpipe preprocess` stays
# attached until the job finishes (it then reads the manifests the job wrote, checks them and
# logs them to MLflow): run it where it can stay up that long (a VM, tmux).
set -euo pipefail

: "${GCP_PROJECT:?set GCP_PROJECT (the Google Cloud project)}"
: "${GCP_REGION:?set GCP_REGION (e.g. europe-west4)}"
: "${GCS_BUCKET:?set GCS_BUCKET (a bucket for Beam staging/temp files)}"
: "${WORKER_IMAGE:?set WORKER_IMAGE (infra/beam/Dockerfile.worker, pushed)}"
CONFIG=${PREPROCESS_CONFIG:-configs/preprocess.yaml}
JOB_NAME=${JOB_NAME:-bertpipe-preprocess-$(date -u +%Y%m%d-%H%M%S)}
read -r -a extra <<<"${EXTRA_BEAM_ARGS:-}"

exec bertpipe preprocess --config "$CONFIG" "$@" -- \
    --runner=DataflowRunner \
    --project="$GCP_PROJECT" \
    --region="$GCP_REGION" \
    --temp_location="gs://$GCS_BUCKET/beam/temp" \
    --staging_location="gs://$GCS_BUCKET/beam/staging" \
    --job_name="$JOB_NAME" \
    --sdk_container_image="$WORKER_IMAGE" \
    --max_num_workers="${MAX_WORKERS:-50}" \
    --machine_type="${MACHINE_TYPE:-n2-standard-8}" \
    --experiments=use_runner_v2 \
    "${extra[@]}"
