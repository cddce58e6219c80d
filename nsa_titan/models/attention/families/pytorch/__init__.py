"""The branch-by-branch path (`fast.nsa_fast`) and its families: torch, flash (`family.py`)."""
