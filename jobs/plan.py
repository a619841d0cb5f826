#!/usr/bin/env python
"""`ray-mmbatch plan` as a script, for `ray job submit --working-dir . -- python jobs/plan.py ...`.

The job runs in the uploaded copy of the repo, which Ray puts first on PYTHONPATH, so
`ray_mmbatch` imports from it (installed or not). Flags and --help: ray_mmbatch/commands/plan_memory.py.
"""
import sys

from ray_mmbatch.commands.plan_memory import main

if __name__ == "__main__":
    sys.exit(main())
