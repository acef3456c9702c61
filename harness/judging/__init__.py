"""How it is judged: the comparators (compare), the measured tolerances and their reasons
(tolerance), the rules that turn an implementation's outputs and the reference into checks
(judge), the quantizer's boundary-tie rule (codes) and the memory bounds.

Pure and one-way: arrays in, verdicts out. It imports only the bottom (harness.outputs,
harness.points, harness.platforms): no framework, no fixture code, no runner.
"""
