"""Pallas kernels whose reduction order depends on model shapes only, each with a pure-jnp
reference. This package knows nothing about models (docs/ARCHITECTURE.md, "Layers")."""

from pallas_kernels import _platform
from pallas_kernels._platform import Backend, backend
from pallas_kernels.matmul import matmul, matmul_reference
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.rms_norm import rms_norm, rms_norm_reference
from pallas_kernels.tree_matmul import (
    TREE_WIDTH,
    combine_tree,
    tree_matmul,
    tree_matmul_partial,
    tree_matmul_reference,
    tree_plan,
)
from pallas_kernels.vocab import (
    log_softmax,
    log_softmax_reference,
    logsumexp,
    logsumexp_reference,
)


def kernel_backend() -> str:
    """A name for the kernel implementation the invariant modes run here (its bits differ from
    the others'): `Backend.kernels`, e.g. 'xla-fixed-cpu', 'pallas-interpret', 'mosaic-gpu'. The
    system fingerprint includes it."""
    return _platform.backend().kernels


__all__ = [
    "Backend",
    "backend",
    "kernel_backend",
    "TREE_WIDTH",
    "combine_tree",
    "tree_plan",
    "log_softmax",
    "log_softmax_reference",
    "logsumexp",
    "logsumexp_reference",
    "matmul",
    "matmul_reference",
    "paged_attention",
    "paged_attention_reference",
    "rms_norm",
    "rms_norm_reference",
    "tree_matmul",
    "tree_matmul_partial",
    "tree_matmul_reference",
]
