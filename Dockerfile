# syntax=docker/dockerfile:1
#
# One image for every specdec role; the role is the command (the model fetched into a
# volume first: `serve` never downloads; and bound to every interface, in plaintext here):
#   docker run --rm -v specdec-models:/models IMAGE models fetch qwen2.5-coder-1.5b-instruct --cache-dir /models
#   docker run --rm -v specdec-models:/models -e SPECD_CACHE_DIR=/models -p 50053:50053 IMAGE \
#     serve target --model qwen2.5-coder-1.5b-instruct --host 0.0.0.0 --insecure
#
# CUDA build (default; for GPU nodes). The PyPI torch wheel for linux/x86_64 bundles the
# CUDA runtime as nvidia-* wheels, so a plain Python base suffices: the node supplies
# only the driver (NVIDIA container toolkit / device plugin).
#   docker build -t ghcr.io/specdec/specdec:0.1.0 .
# CPU build (no CUDA libraries, several GB smaller; used by deploy/overlays/cpu-dev):
#   docker build --build-arg TORCH_VARIANT=cpu -t ghcr.io/specdec/specdec:0.1.0-cpu .
# A specific CUDA build from the PyTorch index: --build-arg TORCH_VARIANT=cu126
#
# No model weights are baked in: pods fetch them into a volume at /models
# (`specd models fetch`, see deploy/ and docs/deploy.md).

# Pinned tag; for reproducible builds also pin the digest:
#   --build-arg PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:<digest>
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build

ARG TORCH_VERSION=2.13.0
# cuda (PyPI's CUDA build) | cpu | cuNNN (download.pytorch.org/whl/cuNNN)
ARG TORCH_VARIANT=cuda

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/specd/bin:$PATH

RUN python -m venv /opt/specd

# torch first and from the index matching the variant: the project's loose `torch>=2.4`
# then never pulls a different build over it.
RUN case "${TORCH_VARIANT}" in \
      cuda) pip install "torch==${TORCH_VERSION}" ;; \
      cpu|cu[0-9]*) pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
                      "torch==${TORCH_VERSION}" ;; \
      *) echo "TORCH_VARIANT must be cuda, cpu or cuNNN, not '${TORCH_VARIANT}'" >&2; exit 1 ;; \
    esac

WORKDIR /src
# Source only (see .dockerignore); the gRPC stubs are generated from protos/ by setup.py.
COPY pyproject.toml setup.py README.md ./
COPY protos/ protos/
COPY specdec/ specdec/
COPY draft_service/ draft_service/
COPY target_service/ target_service/
COPY orchestrator/ orchestrator/
RUN pip install . \
 && specd --help > /dev/null


FROM ${PYTHON_IMAGE} AS runtime

ARG TORCH_VARIANT=cuda

LABEL org.opencontainers.image.title="specdec" \
      org.opencontainers.image.description="Distributed speculative decoding: draft, target and orchestrator roles (specd)" \
      org.opencontainers.image.source="https://github.com/specdec/specdec" \
      org.opencontainers.image.licenses="Apache-2.0"

# Numeric user so that Kubernetes' runAsNonRoot can verify it. /models (model cache)
# and /cache (HF / torch / triton caches) are volumes in a pod; they are made writable
# here too so that a plain `docker run` works.
RUN groupadd --system --gid 10001 specd \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/specd \
      --create-home --shell /usr/sbin/nologin specd \
 && mkdir -p /models /cache \
 && chown 10001:10001 /models /cache

# A GPU image needs a C compiler at run time: Triton builds a small launcher for each
# kernel at its first launch (with the python image's own headers). Without one the
# engine falls back to SDPA, without CUDA graphs (engine/model_facts.py).
RUN if [ "${TORCH_VARIANT}" != cpu ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends gcc libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi

COPY --from=build /opt/specd /opt/specd

# HF_HUB_OFFLINE: models come from the cache dir or a path, never from a hub.
# NVIDIA_DRIVER_CAPABILITIES: what the NVIDIA runtime mounts into a GPU pod. The image
# deliberately sets no NVIDIA_VISIBLE_DEVICES: the device plugin sets it for pods that
# request nvidia.com/gpu, and "all" here would expose every GPU to CPU-only pods.
ENV PATH=/opt/specd/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SPECD_CACHE_DIR=/models \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1 \
    TRITON_CACHE_DIR=/cache/triton \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

USER 10001:10001
WORKDIR /home/specd

# orchestrator, draft, target gRPC; draft and target lanes (as deploy/ sets --lane-port); Prometheus metrics
EXPOSE 50051 50052 50053 50062 50063 9464

ENTRYPOINT ["specd"]
CMD ["--help"]
