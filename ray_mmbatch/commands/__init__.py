"""The subcommands of ``ray-mmbatch`` (ray_mmbatch/cli.py), one module each with ``main(argv, prog)``.

``jobs/*.py`` call the same ``main`` for ``ray job submit --working-dir .``.
"""
