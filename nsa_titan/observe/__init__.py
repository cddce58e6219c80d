"""What a run reports: the step clock, console line and TensorBoard (`metrics`), Weights & Biases
(`wandb_run`), PNG charts (`plots`), validation (`validate`), the evaluations inside a run (`evals`) and
lm-evaluation-harness's interface over the model (`lm_harness`)."""
