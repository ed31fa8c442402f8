"""jdet: a deterministic LLM inference engine in JAX and Pallas.

The same request gives the same bits, whatever the batch, the chunking, the cache or the TP size.
"""

from typing import Any

from jdet.config import ModelConfig
from jdet.loader import Model, load, save
from jdet.spec_config import SpeculativeConfig
from jdet.version import __version__

# The names below are imported on first use (PEP 562 `__getattr__`). Why: `LLM`, `serve` and
# `train` are the entry points, above serving/ and sharding/, which import this package's core
# modules; imported here, they would re-enter this file half-initialised whenever serving/ or
# sharding/ is imported first. The request and result types follow them so that `import jdet`
# loads no kernel and no engine until one is used.
_LAZY = ("LLM", "train", "SamplingParams", "RequestOutput", "CompletionOutput")


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from jdet.api import LLM as value
    elif name == "train":
        import jdet.train as value
    elif name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        import jdet.sampling_params as params

        value = getattr(params, name)
    else:
        raise AttributeError(f"module 'jdet' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def serve(model: Model | str | None = None, **kwargs: object) -> None:
    """Blocking OpenAI-compatible server (settings: jdet/settings.py; serving/http/launch.py)."""
    from serving.http.launch import serve as _serve  # an entry point (see _LAZY); FastAPI: slow

    _serve(model, **kwargs)


__all__ = [
    "LLM",
    "Model",
    "ModelConfig",
    "SamplingParams",
    "SpeculativeConfig",
    "RequestOutput",
    "CompletionOutput",
    "load",
    "save",
    "serve",
    "train",
    "__version__",
]
