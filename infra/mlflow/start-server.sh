#!/bin/sh
# start-server.sh (installed as /usr/local/bin/bertpipe-mlflow-server in infra/mlflow/Dockerfile):
# `mlflow server --app-name basic-auth "$@"`, MLflow's built-in HTTP basic auth, configured
# from the environment so that no password is in the image or in a file of the repository.
#
#   MLFLOW_AUTH_ADMIN_PASSWORD      required: the admin's password. MLflow creates the admin
#                                   user with it on the first start against an empty user
#                                   store; later it is ignored (change it through the API)
#   MLFLOW_FLASK_SERVER_SECRET_KEY  required: key of the CSRF tokens of the web UI's forms; the
#                                   same on every replica/worker
#   MLFLOW_AUTH_ADMIN_USERNAME      default admin
#   MLFLOW_AUTH_DATABASE_URI        where users and permissions live; default the backend store
#                                   (MLFLOW_BACKEND_STORE_URI): their tables (users, roles, ...,
#                                   alembic_version_auth) do not collide with the tracking ones
#   MLFLOW_AUTH_DEFAULT_PERMISSION  what users get on experiments they did not create: READ
#                                   (default), EDIT, MANAGE or NO_PERMISSIONS
#
# The config file MLflow reads (MLFLOW_AUTH_CONFIG_PATH) holds the database URI with its
# password: it is written into a private mktemp folder, readable by this user only.
# Clients authenticate with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD.
set -eu

: "${MLFLOW_AUTH_ADMIN_PASSWORD:?set MLFLOW_AUTH_ADMIN_PASSWORD (the admin password; infra/README.md)}"
: "${MLFLOW_FLASK_SERVER_SECRET_KEY:?set MLFLOW_FLASK_SERVER_SECRET_KEY (a random string; infra/README.md)}"
database_uri=${MLFLOW_AUTH_DATABASE_URI:-${MLFLOW_BACKEND_STORE_URI:?set MLFLOW_BACKEND_STORE_URI or MLFLOW_AUTH_DATABASE_URI}}
export MLFLOW_AUTH_ADMIN_USERNAME="${MLFLOW_AUTH_ADMIN_USERNAME:-admin}"

umask 077
config_dir=$(mktemp -d "${TMPDIR:-/tmp}/mlflow-auth.XXXXXX")
# configparser reads "%" as interpolation: URL-encoded passwords need it doubled
cat >"$config_dir/basic_auth.ini" <<INI
[mlflow]
default_permission = ${MLFLOW_AUTH_DEFAULT_PERMISSION:-READ}
database_uri = $(printf '%s' "$database_uri" | sed 's/%/%%/g')
admin_username = $MLFLOW_AUTH_ADMIN_USERNAME
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
INI
export MLFLOW_AUTH_CONFIG_PATH="$config_dir/basic_auth.ini"

exec mlflow server --app-name basic-auth "$@"
