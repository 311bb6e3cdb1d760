"""The parallelism planner: which layout (dp × tp × pp, ZeRO, recompute, schedule) to train a
model with on a cluster, from a cost model; no torch.

- `layout_costs`: what one layout costs (memory, traffic, step time) under Fathom's trainer, on
  the `hardware` (devices and clusters), for a model as `model_shapes` counts it (presets,
  parameters, FLOPs, the activations a layer saves);
- `search`: every candidate layout estimated, the ones that fit ranked, the winner explained;
- `cli` (`python -m training.planner`, also `python -m training.plan`): the command line;
- `paper_report`: the paper-scale report in docs/planning.md (`python -m training.planner report`);
- `calibrate` (`python -m training.planner.calibrate`): measures this machine as a planner device.
"""
