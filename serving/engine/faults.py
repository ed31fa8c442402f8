"""Fault isolation: no request can hurt another.

Input is checked at `add_request` against the bounds of the step's arrays. If building the batch
still raises, `_prepare` finds the request it belongs to (`_faulty`: does its batch alone build?),
ends only that request with `finish_reason="error"` (`fail_request`: pages freed) and rebuilds
the batch without it; since a row's bits do not depend on the batch, the others' are unchanged.
An error that belongs to no one request (the device step itself) ends every request, and
`recover` resets the KV pool and the page accounting and checks them. `FaultIsolation` holds
these methods of serving/engine/engine.py's `Engine` (it reads the engine's requests, scheduler,
page manager, runner and metrics).
"""

from __future__ import annotations

import logging
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


class FaultIsolation:
    """The fault-isolation methods of `Engine` (module docstring)."""

    fault_injector: Any

    def _prepare(self, plan: list[tuple[Sequence, int]]) -> tuple[list, Any]:
        """Build the step's arrays; a sequence whose data makes this raise ends its request
        with an error, and the batch is rebuilt without it (the others' bits do not change)."""
        while plan:
            try:
                return plan, self._prepare_rows(plan)
            except Exception as e:  # noqa: BLE001 - find whose fault it was
                bad = {seq.request_id for seq, n in plan if self._faulty([(seq, n)])}
                if not bad:
                    raise
                for rid in bad:
                    log.warning("request %s failed while its batch was built: %r", rid, e)
                    self.fail_request(rid, f"{type(e).__name__}: {e}")
                plan = [(s, n) for s, n in plan if s.request_id not in bad]
        return plan, (None, None)

    def _prepare_rows(self, plan: list[tuple[Sequence, int]]) -> tuple[Any, Any]:
        """(the sampling rows' inputs, the score rows' inputs); None where the step has none."""
        if self.fault_injector is not None:
            for seq, _ in plan:
                self.fault_injector(seq)
        sampling = [(s, n) for s, n in plan if not s.is_score]
        scoring = [(s, n) for s, n in plan if s.is_score]
        prepared = self.runner.prepare(sampling) if sampling else None
        if prepared is not None and self.speculator is not None:  # rejection mode
            prepared = self.speculator.verify_inputs(sampling, prepared)
        return prepared, self.runner.prepare_score(scoring) if scoring else None

    def _faulty(self, item: list[tuple[Sequence, int]]) -> bool:
        try:
            self._prepare_rows(item)
        except Exception:  # noqa: BLE001 - this is the question asked
            return True
        return False

    def fail_request(self, request_id: str, error: str) -> None:
        """End one request because of an error of its own: its samples finish with reason
        "error", their pages are freed now, and the next step reports the final output."""
        req = self.requests.get(request_id)
        if req is None:
            return
        req.error = error[:2000]
        for s in req.seqs:
            if not s.is_finished:
                self._finish(s, "error")
            self._pending[s] = None

    def recover(self, error: str) -> None:
        """After an unattributable failure: end every request with `error` (no output for them
        follows: the caller is told by the exception), drop the prefix cache (a failed step may
        have left junk K/V), re-create the KV cache if the failed step consumed the donated one,
        and check the page accounting. Raises EngineBroken if the accounting is not clean."""
        for rid in list(self.requests):
            req = self.requests.pop(rid)
            for s in req.seqs:
                if not s.is_finished:
                    self.scheduler.finish(s)
                    s.finish_reason = "error"
            self.metrics.finished.labels("error").inc()
        self._pending.clear()
        pm = self.page_manager
        pm.hash_to_page.clear()
        pm.page_to_hash.clear()
        leaves = jax.tree_util.tree_leaves(self.runner.kv)
        if any(x.is_deleted() for x in leaves):
            self.runner.kv = jax.tree_util.tree_map(
                lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), self.runner.kv
            )
        try:
            pm.check([])
            assert not self.scheduler.has_work(), "the scheduler still holds sequences"
        except AssertionError as e:
            raise EngineBroken(f"page accounting is inconsistent after {error}: {e}") from e
        self.refresh_gauges()
