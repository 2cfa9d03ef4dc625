"""Synchronisation across ranks: one protocol, its implementations picked by a factory.

``local.py``: the protocol and the single-process and ``process_group`` syncs; ``ddp.py``: under
DistributedDataParallel; ``ddp_hook.py``: the DDP communication hook; ``stage_norm.py``: the clip
norm across pipeline stages; ``reducer.py``: the bucketed all-reduce of the fp32 window.
"""
