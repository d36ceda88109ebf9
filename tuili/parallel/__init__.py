"""Tensor parallelism: one model split over several processes (devices or machines) on
torch.distributed (gloo on CPUs, NCCL on GPUs), rendezvous through torchrun's environment.

- shard.py: which heads, channels and vocabulary rows a rank holds, and the rank's model config;
- layers.py: the modules that communicate (row-parallel all-reduce, vocab-parallel embedding
  and logits);
- group.py: the process group, its timed collectives and the worker processes;
- runner.py: rank 0's runner, which broadcasts each step's inputs, and the workers' loop.
See docs/engine.md, "Tensor parallelism".

Pipeline parallelism (layers split into stages, one rank each) runs on the same group and
processes: pipeline.py (the split, a stage's network), pipeline_runner.py (micro-batches sent
stage to stage, logits back to rank 0). See docs/engine.md, "Pipeline parallelism".
"""
