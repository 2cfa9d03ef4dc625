"""The ``StateDictOptions`` a user can hand DCP's ``get_state_dict``/``set_state_dict``, by name:
what the checkpoint tests run every path through (tests/optim/checkpoint/test_checkpoint_dcp.py,
tests/integrations/test_checkpoint_size.py)."""

from __future__ import annotations

from torch.distributed.checkpoint.state_dict import StateDictOptions

STATE_DICT_OPTIONS = {
    "default": StateDictOptions(),
    "full": StateDictOptions(full_state_dict=True),
    "cpu": StateDictOptions(cpu_offload=True),
    "full_cpu": StateDictOptions(full_state_dict=True, cpu_offload=True),
    "flatten": StateDictOptions(flatten_optimizer_state_dict=True),
    "flatten_cpu": StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True),
    "flatten_full": StateDictOptions(flatten_optimizer_state_dict=True, full_state_dict=True),
}
