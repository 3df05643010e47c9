"""The routers users deploy instead of gorgo, as `gorgo simulate --policy NAME` choices: SMG's
(`smg.py`), vllm-router's (`vllm_router.py`), llm-d's EPP (`llmd.py`) and Dynamo's KV router
(`dynamo.py`), each rule read from its source (cited in its docstring; the shared survey is
/work/shared/peer-routers.md), fed what that router sees and no more (`feed.py`): SMG its
engine-load poll every --load-monitor-interval and its own text tree (`trees.py`), llm-d its
metrics scrape and its own prefix index, Dynamo the engines' KV events and its own books.

They are comparison baselines, so they live in the harness, in a registry of their own
(`base.RIVALS`, by name in `catalog.py`): the product's registry (ext_proc.policy) feeds the
config's validation and JSON schema, and a rival cannot decide without the simulator's view.
The simulator builds the router with a stand-in config policy and hands it the rival
(core.build.build_router's `policy`). `names.py` holds only the names, for the parsers.

May import the router's vocabulary and prompt constants, the emulator's engine model and
loadgen.traces. This file imports nothing.
"""
