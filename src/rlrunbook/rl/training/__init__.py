"""Training: the loop on top of the other stages.

It owns the run plan (the config read once, into what each stage receives), the loop itself
(sample, score, advantages, datums, forward_backward, optim_step, log), dynamic sampling, the
loop's side of data parallelism, and the guards of each update (non-finite steps, the
sampler-trainer mismatch).
"""
