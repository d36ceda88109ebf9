"""Tensor parallelism: one model split over several processes (devices or machines) on
torch.distributed (gloo on CPUs, NCCL on GPUs), rendezvous through torchrun's environment.

- shard.py: which heads, channels and vocabulary rows a rank holds, and the rank's model config;
- layers.py: the modules that communicate (row-parallel all-reduce, vocab-parallel embedding
  and logits);
- group.py: the process group, its timed collectives and the worker processes;
- runner.py: rank 0's runner, which broadcasts each step's inputs, and the workers' loop.
See docs/engine.md, "Tensor parallelism".
"""
