"""Sizing a training job: which GPU type, how many, how long and at what cost.

`size_training(spec, devices, prices)` measures the spec's real model here (activation
memory, FLOPs per image), predicts fit and time on every device of the catalog at 1 to 8 GPUs,
prices them, and recommends the cheapest option that meets a deadline and a budget.
"""
