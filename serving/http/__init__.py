"""The OpenAI-compatible HTTP server over one engine (server.py, protocol.py, request_parsing.py,
responses.py, auth.py, driver.py: the engine thread; launch.py: `jdet.serve`) and the
data-parallel router in front of several (router.py, replica.py)."""
