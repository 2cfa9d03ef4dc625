"""Checkpoints: the wrapper's state inside the torch optimizer state dict.

``assemble.py`` builds it, ``parse.py`` reads it back, ``live_state.py`` keeps ``opt.state`` a live
mapping of the inner optimizer's state over the masters.
"""
