"""Fault isolation: no request can hurt another.

Input is checked at admission against the bounds of the step's arrays (`Engine.check_request`).
If building a step's inputs still raises, `isolate` finds the request it belongs to (`raises`:
does its batch alone fail to build?), ends only that request with `finish_reason="error"` (the
engine's `fail_request`: pages freed) and rebuilds the batch without it; since a row's bits do not
depend on the batch, the others' are unchanged. An error that belongs to no one request (the
device step itself) ends every request, and the engine's `recover` resets the KV pool
(`restore_kv`) and the page accounting and checks them (`check_clean`).

Plain functions over what they are given (the batch builder, the failure callback, the pool, the
page manager and scheduler): the engine owns that state and calls these; nothing here reaches
into it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from serving.sequence import Sequence

log = logging.getLogger("jdet.engine")


class EngineStepError(RuntimeError):
    """A step failed for a reason no single request explains; every request was ended with the
    error and the engine was reset to a clean, empty state (it can serve new requests)."""


class EngineBroken(RuntimeError):
    """Recovery after a failed step found inconsistent page accounting: the engine must not be
    used again (the server exits non-zero on this)."""


def isolate(
    plan: list[tuple[Sequence, int]],
    build: Callable[[list[tuple[Sequence, int]]], Any],
    fail: Callable[[str, str], None],
) -> tuple[list, Any]:
    """`(plan, build(plan))`; a sequence whose data makes `build` raise ends its request
    (`fail(request_id, error)`), and the inputs are rebuilt without it (the others' bits do not
    change). `(plan, (None, None))` when no sequence is left; re-raises an error that no single
    request explains."""
    while plan:
        try:
            return plan, build(plan)
        except Exception as e:  # noqa: BLE001 - find whose fault it was
            bad = {seq.request_id for seq, n in plan if raises(build, [(seq, n)])}
            if not bad:
                raise
            for rid in bad:
                log.warning("request %s failed while its batch was built: %r", rid, e)
                fail(rid, f"{type(e).__name__}: {e}")
            plan = [(s, n) for s, n in plan if s.request_id not in bad]
    return plan, (None, None)


def raises(build: Callable[[list[tuple[Sequence, int]]], Any], item: list) -> bool:
    """Whether building the inputs of `item` (one sequence's entry) alone raises."""
    try:
        build(item)
    except Exception:  # noqa: BLE001 - this is the question asked
        return True
    return False


def restore_kv(kv: Any) -> Any:
    """The KV pool after a failed step: re-created (zeroed, placed as before) if the step
    consumed the donated one, else `kv` itself."""
    if any(x.is_deleted() for x in jax.tree_util.tree_leaves(kv)):
        return jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), kv)
    return kv


def check_clean(page_manager: Any, scheduler: Any, error: str) -> None:
    """Raise EngineBroken unless every page is free and the scheduler holds no sequence."""
    try:
        page_manager.check([])
        assert not scheduler.has_work(), "the scheduler still holds sequences"
    except AssertionError as e:
        raise EngineBroken(f"page accounting is inconsistent after {error}: {e}") from e
