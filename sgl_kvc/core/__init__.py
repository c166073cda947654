"""The engine-agnostic core: plain torch, never imports SGLang.

What a compressing server keeps per request and does between forward steps, written against
tensors and small duck-typed surfaces (a KV pool with `get_key_buffer(layer)`, a slot table)
so that it is unit-tested, on CPU and CUDA, without SGLang installed:

* `request_state`: one request's logical positions and per-head tables (`ReqKvState`);
* `store`: the observation store the attention backend writes (window queries, statistics);
* `decode`: one decode step's plan and its batched attention;
* `views`: what a policy sees of a request (`LayerView`s read from the pool);
* `passes`: per-head passes, staged over scheduler steps;
* `compaction`: moving kept KV entries inside a pool;
* `host`: index tensors listed on the host, sent to the device without waiting for it.

Device rule: every tensor follows the device of the data it is computed from; host-side
bookkeeping says `device="cpu"` where it is made. `tests/device_guard.py` enforces it.
The SGLang side (`sgl_kvc.adapter`) applies these to SGLang's objects.
"""
