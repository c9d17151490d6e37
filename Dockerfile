# geserve on CPU: docker build -t geserve:cpu .
# Installs exactly as the README does, with scripts/bootstrap.sh, in its serving-only form (no test tools, no
# example repository); the model repository comes from a volume at run time:
#   docker run -p 8000-8002:8000-8002 -v "$PWD/examples/model_repository:/models:ro" geserve:cpu
# The CUDA build is Dockerfile.cuda.
FROM python:3.12-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/geserve/.venv/bin:$PATH \
    GESERVE_CACHE_DIR=/tmp/geserve-cache \
    HOME=/tmp
WORKDIR /opt/geserve
COPY . .
# geserve's own modules are compiled here because the running container's root filesystem may be read-only.
RUN GESERVE_SERVE_ONLY=1 bash scripts/bootstrap.sh \
    && .venv/bin/python -m compileall -q geserve \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp geserve

USER 10001:10001
EXPOSE 8000 8001 8002
ENTRYPOINT ["geserve"]
CMD ["serve", "--model-repository=/models"]
