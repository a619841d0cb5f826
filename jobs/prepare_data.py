#!/usr/bin/env python
"""`ray-mmbatch prepare` as a script, for `ray job submit --working-dir . -- python jobs/prepare_data.py ...`.

The job runs in the uploaded copy of the repo, which Ray puts first on PYTHONPATH, so
`ray_mmbatch` imports from it (installed or not). Flags and --help: ray_mmbatch/commands/prepare_data.py.
"""

from ray_mmbatch.commands.prepare_data import main

if __name__ == "__main__":
    main()
