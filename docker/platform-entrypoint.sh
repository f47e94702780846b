#!/bin/sh
# The team stack's services, one per container (deploy/platform/compose.yaml): `postgres`, `s3` or `mlflow`.
# Credentials come from the environment (the compose file requires them); nothing is baked into the image.
set -eu
service=${1:?usage: platform-entrypoint postgres|s3|mlflow}
case "$service" in
postgres)
  : "${TEAM_DB_PASSWORD:?TEAM_DB_PASSWORD is required}"
  if [ "$(id -u)" = 0 ]; then
    chown postgres:postgres /data && chmod 700 /data
    exec runuser -u postgres -- "$0" "$@"
  fi
  if [ ! -s /data/PG_VERSION ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$TEAM_DB_PASSWORD" >"$pwfile"
    initdb -D /data -U mlflow -A scram-sha-256 --pwfile="$pwfile" -E UTF8 >/dev/null
    rm -f "$pwfile"
    # Other containers of the compose network connect over TCP, with the password.
    echo "host all all all scram-sha-256" >>/data/pg_hba.conf
    echo "CREATE DATABASE mlflow" | postgres --single -D /data postgres >/dev/null
  fi
  exec postgres -D /data -c listen_addresses='*' -c unix_socket_directories=/tmp
  ;;
s3)
  : "${AWS_ACCESS_KEY_ID:?AWS_ACCESS_KEY_ID is required}" "${AWS_SECRET_ACCESS_KEY:?AWS_SECRET_ACCESS_KEY is required}"
  # master, volume and filer stay internal (127.0.0.1 in the container); only the S3 gateway is published.
  exec weed mini -dir=/data -ip=127.0.0.1 -ip.bind=0.0.0.0 -s3.port="${S3_PORT:-8333}" -s3.port.iceberg=0 -s3.port.lance=0 \
    -webdav=false -admin.ui=false -bucket=mlflow,dvc
  ;;
mlflow)
  : "${TEAM_DB_PASSWORD:?TEAM_DB_PASSWORD is required}"
  # The backend URI (with the password) through the environment, never on a command line that `ps` shows.
  export MLFLOW_BACKEND_STORE_URI="postgresql+psycopg2://mlflow:${TEAM_DB_PASSWORD}@postgres:5432/mlflow"
  # Clients get presigned URLs of this endpoint: an address they reach as well (compose.yaml says why).
  export MLFLOW_S3_ENDPOINT_URL="${S3_PUBLIC_URL:-http://127.0.0.1:${S3_PORT:-8333}}"
  # MLflow's job runner (GenAI evaluation jobs): polling processes the pipeline never uses, off unless set.
  export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"
  exec mlflow server --host 0.0.0.0 --port 5000 --artifacts-destination s3://mlflow/artifacts \
    --workers "${MLFLOW_WORKERS:-2}" ${MLFLOW_SERVER_ARGS:-}
  ;;
*)
  echo "unknown service $service (postgres, s3 or mlflow)" >&2
  exit 2
  ;;
esac
