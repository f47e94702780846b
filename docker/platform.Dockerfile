# The team tracking stack as containers: ONE image, three services (deploy/platform/compose.yaml) — PostgreSQL
# (Debian's), SeaweedFS's S3 gateway and an MLflow server, the same three `make platform-up` runs without Docker.
#
# Built by `pipeline platform image` from a staged context (wheels/ for linux/amd64 from uv.lock, entrypoint.sh):
# pip inside the build needs no network. BASE_IMAGE: python:3.11-slim-bookworm where registries are reachable;
# here the debootstrap image of docker/base-image.sh. apt reaches the Debian mirror in both.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- builder: the virtual environment, installed offline (the wheelhouse stays out of the final image) ----
FROM ${BASE_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
COPY wheels/ /wheels/
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --quiet --no-index --find-links /wheels --only-binary=:all: -r /wheels/requirements.txt

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends postgresql-15 >/dev/null \
 && rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/*
COPY --from=builder /opt/venv /opt/venv
# Each service keeps its data under /data (a named volume per service in the compose file); the postgres user
# owns it in the image so that a fresh named volume inherits that ownership.
RUN mkdir -p /data && chown postgres:postgres /data && chmod 700 /data
COPY entrypoint.sh /usr/local/bin/platform-entrypoint
RUN chmod 755 /usr/local/bin/platform-entrypoint
ENV PATH=/opt/venv/bin:/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1
ENTRYPOINT ["platform-entrypoint"]
LABEL org.opencontainers.image.title="gtsrb-platform" \
      org.opencontainers.image.description="Team tracking stack: PostgreSQL 15, SeaweedFS S3, MLflow server" \
      org.opencontainers.image.licenses="Apache-2.0"
