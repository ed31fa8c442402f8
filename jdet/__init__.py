"""jdet: a deterministic LLM inference engine in JAX and Pallas.

The same request gives the same bits, whatever the batch, the chunking, the cache or the TP size.
"""

from jdet import train  # differentiable log-probs with the sampler's bits (jdet/train.py)
from jdet.api import LLM
from jdet.config import ModelConfig
from jdet.loader import Model, load, save
from jdet.sampling_params import CompletionOutput, RequestOutput, SamplingParams
from jdet.spec_config import SpeculativeConfig
from jdet.version import __version__


def serve(model: Model | str | None = None, **kwargs: object) -> None:
    """Blocking OpenAI-compatible server (settings: jdet/settings.py; serving/launch.py)."""
    from serving.launch import serve as _serve

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
