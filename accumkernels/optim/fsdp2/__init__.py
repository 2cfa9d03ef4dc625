"""FSDP2: the window shaped like each param's local shard.

``layout.py`` the sharded layout, ``intake.py`` FSDP2's post-reduce-scatter hooks into the window,
``checkpoint.py`` DCP state dicts, ``recipe.py`` what is refused and why, ``wire.py`` the opt-in
bf16 reduce-scatter summed in fp32.
"""
