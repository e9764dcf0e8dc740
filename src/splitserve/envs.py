"""Every environment variable splitserve reads, declared once, and the one module that reads them.

Two kinds exist. A *setting's* variable stands in for its flag (``SPLITSERVE_L2_URL`` for ``--l2-url``): it is
declared at the config field with the flag (``splitserve.settings``) and read by the command line when the flag
is absent. The variables below are the others: credentials that never appear as flags, where the caches live,
the kernels' switches, and what Kubernetes and the supervisor tell a process about where it runs.
 ``splitserve.configdoc.every_variable`` lists both kinds, and ``docs/configuration.md`` documents them.

Nothing else in ``splitserve`` looks at ``os.environ`` for a value: it asks :func:`get` here. Passing the whole
environment on to a child process (:func:`copy`) is the one other use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Variable:
    """An environment variable: its name, what it means, and its value when unset."""

    name: str
    help: str
    default: str = ""


# -- credentials: never flags, so they stay out of process listings and resource files
API_KEY = Variable("SPLITSERVE_API_KEY", "A client key /v1/* accepts, beside the --api-key flags.")
VLLM_API_KEY = Variable("VLLM_API_KEY", "A client key, as vLLM reads it (splitserve accepts it too).")
CLUSTER_SECRET = Variable(
    "SPLITSERVE_CLUSTER_SECRET",
    "The cluster secret (the router's credential at the workers), when no --cluster-secret-file is given.",
)
REDIS_USERNAME = Variable("SPLITSERVE_REDIS_USERNAME", "The Redis ACL user of the L2 tier, when its URL names none.")
REDIS_PASSWORD = Variable("SPLITSERVE_REDIS_PASSWORD", "The Redis password of the L2 tier, when its URL has none.")

# -- where things are kept
HOME = Variable("SPLITSERVE_HOME", "Where local endpoints keep their state and logs (default ~/.splitserve).")
CACHE_DIR = Variable("SPLITSERVE_CACHE_DIR", "Where tokenizers are cached (default $XDG_CACHE_HOME/splitserve).")
XDG_CACHE_HOME = Variable("XDG_CACHE_HOME", "The user's cache directory (default ~/.cache).")
KERNEL_CACHE = Variable(
    "SPLITSERVE_KERNEL_CACHE", "Where the native CPU kernels are built (default $XDG_CACHE_HOME/splitserve/kernels)."
)

# -- the native kernels
NATIVE_KERNELS = Variable("SPLITSERVE_NATIVE_KERNELS", "0: no native CPU kernels (PyTorch only).", "1")
KERNEL_ISA = Variable(
    "SPLITSERVE_KERNEL_ISA", "The kernel build to load (avx512, avx2, neon, scalar...); auto: the CPU's best.", "auto"
)
FORWARD_STEP = Variable(
    "SPLITSERVE_FORWARD_STEP",
    "0: run a GGUF-quantized model module by module instead of in the native forward step (for comparisons).",
    "1",
)
PREBUILT_KERNELS = Variable(
    "SPLITSERVE_PREBUILT_KERNELS",
    "A directory of kernel libraries built ahead (python -m splitserve.model.kernel_build DIR): used before any build.",
)
CC = Variable("CC", "The C compiler that builds the kernels (default cc, else gcc).")

# -- local endpoints
VLLM_PYTHON = Variable("SPLITSERVE_VLLM_PYTHON", "The python of an environment with vLLM, for local vLLM workers.")
CUDA_VISIBLE_DEVICES = Variable("CUDA_VISIBLE_DEVICES", "The GPUs a local endpoint may hand to its workers.")
LMCACHE_CONFIG_FILE = Variable("LMCACHE_CONFIG_FILE", "An LMCache YAML file whose settings a worker takes.")

# -- Kubernetes: set by the cluster or by the manifests splitserve renders
KUBERNETES_SERVICE_HOST = Variable("KUBERNETES_SERVICE_HOST", "The API server, inside a pod.")
KUBERNETES_SERVICE_PORT = Variable("KUBERNETES_SERVICE_PORT", "The API server's port, inside a pod.", "443")
POD_NAME = Variable("SPLITSERVE_POD_NAME", "This pod's name (the downward API).")
POD_IP = Variable("SPLITSERVE_POD_IP", "This pod's IP (the downward API).")
POD_NAMESPACE = Variable("SPLITSERVE_POD_NAMESPACE", "This pod's namespace (the downward API).")

VARIABLES: tuple[Variable, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Variable))


def get(variable: Variable, environ: Mapping[str, str] | None = None) -> str:
    """The variable's value, stripped; its default when unset or blank."""
    value = (os.environ if environ is None else environ).get(variable.name, "").strip()
    return value or variable.default


def raw(variable: Variable) -> str | None:
    """The variable's value as set (an empty one too), or None when it is unset."""
    return os.environ.get(variable.name)


def copy() -> dict[str, str]:
    """This process's whole environment, for a child process to start from."""
    return dict(os.environ)


def live() -> MutableMapping[str, str]:
    """The process's environment itself, for the one writer: a worker taking LMCache's settings
    (``lmcache_env.apply``) before its options are parsed."""
    return os.environ


def cache_home() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``."""
    return Path(get(XDG_CACHE_HOME) or Path.home() / ".cache")
