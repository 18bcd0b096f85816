"""Plan a job before launching it: memory per rank, FLOPs, communication, bubble, fit check.

The planner is organised by feature, like the runtime: ``dense`` (attention and MLP blocks,
tp/sp), ``pipeline`` (stages, vpp, bubble, p2p), ``recompute``, ``context_parallel``,
``data_parallel`` (ZeRO states, buckets, ZeRO 3 gathers, dp collectives and their exposed time)
and ``moe``; each says what its feature costs in memory, communication and time, and
``estimate`` (memory, per-stage volumes) and ``step_time`` only add those terms up. A new
feature's planner terms go in one new file of the same shape, called once from the adders; a rule
the trainer also follows is imported from the runtime package that owns it.
"""
