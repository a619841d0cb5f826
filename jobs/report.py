#!/usr/bin/env python
"""`ray-mmbatch report` as a script, for `ray job submit --working-dir . -- python jobs/report.py ...`.

The job runs in the uploaded copy of the repo, which Ray puts first on PYTHONPATH, so
`ray_mmbatch` imports from it (installed or not). Flags and --help: ray_mmbatch/commands/report.py.
"""
import sys

from ray_mmbatch.commands.report import main

if __name__ == "__main__":
    sys.exit(main())
