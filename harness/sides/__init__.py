"""Who computes: the implementations behind one protocol (implementations), the crash-isolating
worker processes (worker), the persistent caches and the clocks of their calls (reference_cache,
timing), and the one-kernel check (kernel_check).

It imports the bottom, judging and problems (a side reads its fixture). A worker runs a task
named by a function reference, so nothing here imports the rooms that drive it.
"""
