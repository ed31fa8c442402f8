"""The engine: `Engine` (engine.py) and what it owns and calls: the scheduler, the page manager,
the model runner with its shapes, warm-up, host inputs and sampler variants, the KV pool's
sizing, metrics, faults, outputs and score requests; the offline API's loop (llm_backend.py)
and one engine over several processes (multihost.py)."""
