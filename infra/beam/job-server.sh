#!/usr/bin/env bash
# Start Beam's portable job server for Flink or Spark, in a container (docker), in front of an
# existing cluster. infra/beam/portable.sh then submits bertpipe's Beam job to it.
#
#   FLINK_MASTER=flink-jobmanager:8081 infra/beam/job-server.sh flink
#   SPARK_MASTER_URL=spark://spark-master:7077 infra/beam/job-server.sh spark
#
# It listens on 8099 (jobs) and 8098 (artifacts) on all interfaces of this host (--net=host).
# The SDK workers (bertpipe's DoFns) run in infra/beam/Dockerfile.worker's image, either
# started by the task managers (ENVIRONMENT_TYPE=DOCKER: Docker on every Flink/Spark worker)
# or, more often, as a worker pool next to each task manager / Spark worker
# (ENVIRONMENT_TYPE=EXTERNAL):
#   docker run --rm --net=host "$WORKER_IMAGE" --worker_pool     # listens on 50000
#
# Settings: BEAM_VERSION (default 2.77.0: must equal apache-beam in constraints.txt),
# FLINK_VERSION (default 1.20: your cluster's Flink, one of the versions Beam publishes a job
# server for: 1.19, 1.20, 2.0, 2.1, 2.2 with Beam 2.77).
set -euo pipefail

engine=${1:?usage: infra/beam/job-server.sh flink|spark}
BEAM_VERSION=${BEAM_VERSION:-2.77.0}
common=(--job-host=0.0.0.0 --job-port=8099 --artifact-port=8098 --expansion-port=8097)

case "$engine" in
flink)
    : "${FLINK_MASTER:?set FLINK_MASTER (host:port of the Flink JobManager REST endpoint)}"
    exec docker run --rm --net=host \
        "apache/beam_flink${FLINK_VERSION:-1.20}_job_server:$BEAM_VERSION" \
        --flink-master="$FLINK_MASTER" "${common[@]}"
    ;;
spark)
    : "${SPARK_MASTER_URL:?set SPARK_MASTER_URL (spark://host:7077)}"
    exec docker run --rm --net=host \
        "apache/beam_spark3_job_server:$BEAM_VERSION" \
        --spark-master-url="$SPARK_MASTER_URL" "${common[@]}"
    ;;
*)
    echo "job-server.sh: engine must be flink or spark, not $engine" >&2
    exit 2
    ;;
esac
