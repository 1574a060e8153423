"""RL step performance simulator: what speculation and draft adaptation buy, sync and async.

    draftadapt simulate recipes/sim_qwen3_8b_sync.yaml [key=value ...] [--json] [--plot PNG]
    python scripts/sim_reproduce.py            # every published figure beside its projection
    python scripts/sim_reproduce.py --refit    # and the 8B calibration (scripts/sim_paper.py)

Pure Python (numpy, scipy for fits, matplotlib for the PNG); no engine, no torch.

    hardware.py     GPU datasheets (GB200, B200, H100, H200) and target architectures (Qwen3)
    config.py       the recipe schema (SimConfig) and its input checks
    model.py        acceptance math, decode roofline, rollout simulation with the long tail,
                    sync / async pipelines, drift and adaptation over a run, the demo's
                    async step on shared CPU cores
    telemetry.py    reader for the JSON-lines telemetry a draftadapt run writes
    calibrate.py    fit free parameters to telemetry, report the fit error; the demo's
                    async step fitted and predicted leave-one-out (predict_demo_async)
    costbenefit.py  adapt_gain: does adapting the draft now pay?
    report.py       stdout table and projected-vs-published comparison
    plot.py         step-time breakdown and speedup against acceptance (PNG)
    cli.py          the `draftadapt simulate` command
"""
