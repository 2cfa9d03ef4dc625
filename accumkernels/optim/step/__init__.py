"""The step: a real step in named phases (``step.py``), closures (``closure.py``), and the fused
master step for fused AdamW/Adam/SGD inner optimizers (``fused_master.py``).
"""
