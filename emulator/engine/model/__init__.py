"""The engine model, pure: scheduler.py (`EngineModel`: FCFS, chunked prefill, batching,
priority and preemption, as SGLang or vLLM schedules) on queues.py (`EngineQueues`: its
queues, KV books and what the engines report of them). The twin (`gorgo engine`) drives it
on the wall clock, the simulator on a virtual one.

May import emulator.engine's prefix cache and priority settings and the router's engine
profiles. This file imports nothing.
"""
