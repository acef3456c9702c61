"""csa-parity harness: fixtures, implementations, comparators, the parity matrix and its reports."""
