"""What is checked: the case catalogue (cases), the matrix of points each sample runs
(matrix), the fixture format (fixtures), the drawn random problems (random_configs) and the
near-tie analysis (near_ties).

It imports the bottom and the judging room (a random problem is judged where it is drawn); the
catalogue, the matrix and the fixture format import no framework.
"""
