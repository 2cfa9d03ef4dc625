"""The intake: how gradients reach the window during (and outside) backward.

``intake.py`` owns the per-param hooks and the bucket launches; ``hooks.py`` the hooks' common
case; ``user_hooks.py`` the user's own hooks around ours; ``unmoved.py`` gradients held for a later
move; ``guard.py`` the checks of what the user did to the params; ``backward.py`` what a backward
is (its begin and end, nesting, raising).
"""
