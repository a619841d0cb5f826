"""The run around training: checks before it, what it prints and writes, and the tools after it.

    defaults.py    the train settings left to the mode: the demo's, or a fine-tune's with --model (pure)
    plan.py        a run's plan: samples, epochs, steps, learning rate, tokens per step (pure)
    preflight.py   the driver's checks before any cluster work (data, tokenizer, budgets)
    guards.py      the skip-fraction guard and its reason -> fix hints
    rundir.py      a run folder: every file name (RunDir), the JSONL reader, the one writer
    progress.py    progress lines and the end-of-run summary (pure)
    trackers.py    --report-to: TensorBoard / W&B / MLflow, fed by the driver's run events
    raylogs.py     Ray's internal lines off the console (--verbose: all of them)
    report.py      the HTML report of a finished run (pure)
    verify.py      packing exactness: a packed batch against its samples run alone (torch)
    tune.py        the budget search with Ray Tune
"""
