"""What to do, decided from what is wanted and what is there: pure functions and values,
no I/O (the executor in lifecycle/ acts on them). ``units``: rendered x facts -> ok / ship /
start / restart per unit; ``orphans``: units no playbook names any more; ``verdicts``: the
record, probe and readiness decisions of a unit."""
