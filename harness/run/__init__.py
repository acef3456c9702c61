"""How a run is driven and reported: collect (an implementation's outputs and the reference,
judged), the worker task of a point (tasks), the reports (report), `csa-parity` (cli), the
two-process run (multihost), the fixtures' regeneration from the reference (regenerate), the
backends' not-applicable table (platform_table) and the pytest plugin (pytest_plugin).

It imports every room below it: the bottom, judging, problems and sides.
"""
