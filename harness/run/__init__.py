"""How a run is driven and reported: collect (an implementation's outputs and the reference,
judged), the worker task of a point (tasks), the reports (report), `csa-parity` (cli), the
two-process run (multihost), the fixtures' regeneration from the reference (regenerate) and the
backends' not-applicable table (platform_table).

It imports every room below it: the bottom, judging, problems and sides.
"""
