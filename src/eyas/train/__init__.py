"""`eyas train` (one process or torchrun, DDP or FSDP2) and `eyas plan`: the trainer, its setup, data, engine,
sharding and the run's arithmetic. `python -m eyas.train` is the torchrun entry.
"""
