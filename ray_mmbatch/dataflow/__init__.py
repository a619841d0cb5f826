"""The Ray shell of the data path: the Ray Data graph over the pure core, and its in-process twin.

    pipeline.py       the Ray Data graph: read -> measure -> plan -> materialize (one BATCH row per batch)
    read.py           read units as Ray tasks (formats/units.py does the listing and the reading)
    stages.py         the stage objects (measure, plan, materialize): plain callables, no Ray
    payloads.py       the payload holder actors (payload_store.py: their pure store, and LocalPayloads)
    pools.py          actor pool sizes from the cluster's nodes, and the resource pre-flight
    inspection.py     the inspect job (every sample read, measured and materialized, counted)
    local.py          local_batches: the same stages in one process, no Ray
    throughput.py     inspect --throughput: samples per CPU second through those stages, in one process
    timing.py         each stage's wall seconds riding in the rows to the train loop (summary.json data_time)
    operator.py       batch_by_token_budget: the planners over any user's Ray Dataset

stages.py, timing.py, payload_store.py, pools.py, local.py and throughput.py import no Ray (tests/test_pure_imports.py
runs local_batches without loading it); the rest is Ray's.
"""
