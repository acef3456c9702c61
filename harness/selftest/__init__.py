"""The harness testing itself: the mutation catalogues of the code under test (mutations, run
by mutation_worker) and of the judge (judge_mutations), each mutant killed by a named check.

It may import every other room.
"""
