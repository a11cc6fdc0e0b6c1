"""The scheduler process's core: request state, batch construction, policies and event loops.

Nothing is re-exported here: importing a submodule (e.g. `scheduler.req`, which constrained/ does)
must not load the Scheduler and everything it imports (test/unit/test_import_cycles.py).
"""
