"""Programs the tests start as subprocesses: ``python -m tests.support.programs.<name>`` from the
repository root (``tests.support.processes.program`` builds the command)."""
