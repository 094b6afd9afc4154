"""The embedded engine: continuous batching over one ragged forward per step.

``llm_engine`` (the loop: schedule → forward → verify → postprocess), ``async_engine``
(worker thread + asyncio front), ``scheduler`` (batch scheduler), ``sequence``,
``kv_cache``, ``prefix_cache``, ``detokenizer``, ``sampler``, ``logprobs``, ``profile``
(``sparkgate profile``). Empty on purpose: importing a submodule (e.g. the sampler, which
the speculation package uses) never imports the engine loop.
"""
