# KVSERVE_BASE_IMAGE in compose: a Python 3.11 image of your own (one that trusts your proxy's CA, or
# scripts/docker-local-base's, made from Debian's packages where no registry is reachable).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS install
# The CPU build of torch by default; a bare `pip install torch` pulls the multi-GB CUDA build, which is
# what docker-compose.gpu.yml asks for (TORCH_INDEX="").
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir torch==2.13.0 ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}
# One unprivileged user for every service: the store's same-host arena serves only callers of its own
# user. The folders that compose and Kubernetes mount volumes on belong to it alone (0700), so that new
# volumes do too (/credentials and /export/*: docker-compose.yml's credentials volumes); the services' umask
# (077) keeps what they write there theirs.
RUN useradd --uid 10001 --create-home kvserve \
    && mkdir -p /models /data /cores /credentials /export/kvstore /export/prefill /export/decode /export/router /export/http \
    && chown -R kvserve:kvserve /models /data /cores /credentials /export \
    && chmod -R go= /models /data /cores /credentials /export
WORKDIR /app
COPY . .
# EXTRAS=gpu (docker-compose.gpu.yml): cupy, for the store's device arena and CUDA IPC.
ARG EXTRAS=""
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"
# Where the engines look for their prebuilt C kernels (engine.native), root's: the services' user cannot change them.
ENV KVSERVE_KERNEL_DIR=/opt/kvserve/kernels

# The engine's C kernels (decode attention in place, the checking copy), built here with a compiler the final
# stage does without: for x86-64-v4 and x86-64-v3, the image may run on another CPU than it was built on, and each
# engine loads the best one its CPU runs. On a CPU without AVX2 the engines run the slower SDPA fallback, and
# `kvserve stats` says so.
FROM install AS kernels
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && kvserve build-kernels "$KVSERVE_KERNEL_DIR"

FROM install
COPY --from=kernels /opt/kvserve/kernels /opt/kvserve/kernels
USER 10001
# The models come from a volume: compose's model-init service and the Kubernetes pods' init container
# build the tiny test model there (`kvserve model init`), or mount your own model folder.
ENTRYPOINT ["kvserve"]
