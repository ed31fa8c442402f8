"""The engine: `Engine` (engine.py) and what it owns and calls: admission's one check of a
request (admission.py), the request table (request_table.py), the scheduler, the page manager,
the model runner with a step's inputs (step_inputs.py), its shapes, warm-up, host inputs and
sampler variants, the KV pool's sizing (memory.py), metrics, faults, outputs and score requests;
the offline API's loop (llm_backend.py) and one engine over several processes (multihost.py)."""
