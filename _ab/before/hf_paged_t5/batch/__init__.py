"""Batch jobs: `BatchGenerator` (continuous batching over a finite job), its rows, beams and
cache, the run that admits and retires rows between decode steps, and the command line.
"""
